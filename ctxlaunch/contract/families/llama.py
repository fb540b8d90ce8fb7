"""Llama (2, 3, 3.1, 3.2): the common block as it is, and the CPU-sized shapes the demo and
the tests use."""

from __future__ import annotations

from ctxlaunch.contract.families.family import Family

_LLAMA3 = dict(vocab=128256, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False)
_TINY = dict(vocab=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)

FAMILY = Family(
    name="llama",
    architecture="LlamaForCausalLM",
    model_type="llama",
    releases="Llama 2, 3, 3.1, 3.2",
    presets={
        # Meta Llama 3 (params.json of the released checkpoints).
        "llama3-8b": dict(
            layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, **_LLAMA3
        ),
        "llama3-70b": dict(
            layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, **_LLAMA3
        ),
        "llama3-405b": dict(
            layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, **_LLAMA3
        ),
        "llama3.2-1b": dict(
            layers=16,
            hidden=2048,
            heads=32,
            kv_heads=8,
            ffn_hidden=8192,
            **{**_LLAMA3, "tie_embeddings": True},
        ),
        # CPU-sized shapes for the local demo and the tests (byte-level vocabulary).
        "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=384, **_TINY),
        "tiny-mha": dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn_hidden=384, **_TINY),
        "small": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=704, **_TINY),
    },
)
