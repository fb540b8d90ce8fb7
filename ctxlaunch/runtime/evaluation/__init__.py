"""Evaluation at length: the held-out data, passkey prompts, the evaluator, the weights it
scores and `ctxlaunch eval`'s rank entry."""
