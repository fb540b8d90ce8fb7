"""Named model shapes. A spec's `model: {preset: llama3-8b}` starts from one of these; any field
written beside the preset overrides it."""

from __future__ import annotations

from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Meta Llama 3 (params.json of the released checkpoints).
    "llama3-8b": dict(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab=128256,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
    "llama3-70b": dict(
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn_hidden=28672,
        vocab=128256,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
    "llama3-405b": dict(
        layers=126,
        hidden=16384,
        heads=128,
        kv_heads=8,
        ffn_hidden=53248,
        vocab=128256,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
    "llama3.2-1b": dict(
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        ffn_hidden=8192,
        vocab=128256,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # CPU-sized shapes for the local demo and the tests (byte-level vocabulary).
    "tiny": dict(
        layers=2,
        hidden=128,
        heads=4,
        kv_heads=2,
        ffn_hidden=384,
        vocab=256,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
    "tiny-mha": dict(
        layers=2,
        hidden=128,
        heads=4,
        kv_heads=4,
        ffn_hidden=384,
        vocab=256,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
    "small": dict(
        layers=4,
        hidden=256,
        heads=8,
        kv_heads=4,
        ffn_hidden=704,
        vocab=256,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    ),
}
