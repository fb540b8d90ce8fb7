"""How a layout is applied to the model: the ranks' process groups, tensor and pipeline
parallelism, and `parallelize`."""
