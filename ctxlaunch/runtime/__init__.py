"""What runs inside the job: the trainer, its telemetry, the pod entry point and the calibration
measurements."""
