"""A tiny Hugging Face Llama checkpoint written with safetensors alone (no transformers), and a
spec that trains from it: what an installed `ctxlaunch train` / `export` can run in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 32, 4, 2, 64, 64


def write_tiny_llama(directory: Path, *, seed: int = 0) -> int:
    """config.json and model.safetensors of a random 2-layer LlamaForCausalLM in `directory`;
    returns the number of tensors."""
    import torch
    from safetensors.torch import save_file

    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
            f"{layer}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"{layer}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FFN),
        }
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (1 + 0.1 * torch.randn(shape, generator=generator))
        if len(shape) == 1
        else 0.1 * torch.randn(shape, generator=generator)
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(tensors)


def tiny_spec(init_from: Path, checkpoints: Path, *, steps: int = 2) -> dict[str, Any]:
    """One CPU rank training `steps` steps from `init_from`, checkpointing into `checkpoints`."""
    return {
        "name": "tiny-hf",
        "model": {"init_from": str(init_from), "dtype": "fp32"},
        "training": {
            "seq_len": 64,
            "micro_batch": 1,
            "global_batch": 1,
            "steps": steps,
            "log_interval": 1,
            "optimizer": {"lr": 1e-3},
            "checkpoint": {"dir": str(checkpoints), "interval": steps},
        },
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }
