"""Tokenized training data: Megatron-compatible indexed token files (`indexed`), the tokenizers
that make them (`tokenizers`), the `ctxlaunch data prepare` pipeline (`prepare`) and the packing
of documents into training sequences with a held-out evaluation split (`packing`)."""
