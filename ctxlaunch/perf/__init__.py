"""What a job costs: the one Layout, FLOPs, memory, communication volume, step time, the machine a
prediction runs on."""
