"""Checkpoints: committed steps, their integrity, the allow-listed unpickler, resharding
across layouts, and Hugging Face weights in and out."""
