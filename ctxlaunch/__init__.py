"""ctxlaunch: plan, render, submit and run long-context training jobs."""

__version__ = "0.1.0"
