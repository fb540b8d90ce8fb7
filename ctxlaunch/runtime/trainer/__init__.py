"""The bundled trainer: a Llama-style decoder with ring, Ulysses and hybrid context-parallel
attention, ZeRO through DeepSpeed. Entry point: `python -m ctxlaunch.runtime.trainer` (or
`ctxlaunch train`)."""
