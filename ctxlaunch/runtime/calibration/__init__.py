"""Measuring a machine for the step-time model: this CPU (`cpu`), a GPU node (`gpu`), the fits
both use (`fitting`), and the calibration job that runs either on a node of the spec's target
(`job`). The records and their files live in ctxlaunch.perf.machine."""
