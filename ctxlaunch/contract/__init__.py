"""What a job is: the spec and its rules, presets, hardware, exit codes, and the run directory the
launcher and the job share."""
