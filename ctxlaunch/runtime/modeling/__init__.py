"""The model the trainer builds: the decoder, its loss, the tiled feed-forward and the
activation offload; no process group."""
