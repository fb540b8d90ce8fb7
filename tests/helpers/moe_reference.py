"""transformers' own mixture-of-experts models (Qwen3MoeForCausalLM, MixtralForCausalLM,
Qwen2MoeForCausalLM, GptOssForCausalLM; test-only references) stepped as the trainer steps: the language-model
loss, the load-balancing loss and every gradient of the first step, named as ctxlaunch names
its parameters. transformers is imported inside the functions (the spawned ranks of the
multi-process tests import this module and need none of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tests.helpers.hf_models import build_trainer, one_process

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MOE_LEAVES = {
    "mlp.gate.weight": "ffn.router.weight",
    "mlp.experts.gate_up_proj": "ffn.experts.w_gate_up",
    "mlp.experts.down_proj": "ffn.experts.w_down",
    "mlp.shared_expert.down_proj.weight": "ffn.shared.w_down.weight",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
    "mlp.router.weight": "ffn.router.weight",
    "mlp.router.bias": "ffn.router.bias",
}
"""transformers' in-memory names of a sparse block's tensors (its experts fused as ctxlaunch
fuses them) -> ctxlaunch's, under model.layers.{i}. / blocks.{i}."""
DENSE_LEAVES = {
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.o_proj.bias": "attn.wo.bias",
    "self_attn.sinks": "attn.sinks",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
}
FUSED = {
    "attn.wqkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.wqkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "ffn.w_gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ffn.shared.w_gate_up.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
}


STACKED_LEAVES = {
    "mlp.experts.gate_up_proj": "ffn.experts.w_gate_up",
    "mlp.experts.down_proj": "ffn.experts.w_down",
    "mlp.experts.gate_up_proj_bias": "ffn.experts.b_gate_up",
    "mlp.experts.down_proj_bias": "ffn.experts.b_down",
}
"""A family whose experts are stacked (transformers' GptOss: (input, output), gate and up
interleaved): its experts' tensors, turned into ctxlaunch's layout by the import's own
`from_stacked`."""


def ctxlaunch_grads(reference: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The reference's gradients under ctxlaunch's parameter names (fused q/k/v and gate/up
    concatenated along dim 0, as the trainer fuses them; stacked experts turned)."""
    from ctxlaunch.contract.families import family_of_model_type
    from ctxlaunch.runtime.checkpointing.hf import from_stacked

    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    family = family_of_model_type(reference.config.model_type)
    if family is not None and family.experts is not None and family.experts.stacked is not None:
        for i in range(reference.config.num_hidden_layers):
            for theirs, ours in STACKED_LEAVES.items():
                name = f"model.layers.{i}.{theirs}"
                if name in grads:
                    grads[f"model.layers.{i}.stacked.{theirs}"] = from_stacked(
                        ours, grads.pop(name)
                    )
    out: dict[str, torch.Tensor] = {
        "embed.weight": grads["model.embed_tokens.weight"],
        "norm.weight": grads["model.norm.weight"],
    }
    if "lm_head.weight" in grads:
        out["head.weight"] = grads["lm_head.weight"]
    layers = reference.config.num_hidden_layers
    for i in range(layers):
        prefix = f"model.layers.{i}."
        stacked = {f"stacked.{theirs}": ours for theirs, ours in STACKED_LEAVES.items()}
        for theirs, ours in {**MOE_LEAVES, **DENSE_LEAVES, **stacked}.items():
            if prefix + theirs in grads:
                out[f"blocks.{i}.{ours}"] = grads[prefix + theirs]
        for ours, parts in FUSED.items():
            if all(prefix + part in grads for part in parts):
                out[f"blocks.{i}.{ours}"] = torch.cat([grads[prefix + part] for part in parts])
    return out


def transformers_step(reference: PreTrainedModel, data: dict) -> dict[str, Any]:
    """transformers' first step of `data` as a one-process trainer of it reads the batches:
    the language-model loss (the token mean over the step), the load-balancing loss (the mean
    over the micro-batches of transformers' aux_loss), and the gradients of the objective
    both make (sum of token losses / predicted tokens + coef x mean aux), by ctxlaunch name."""
    trainer = build_trainer(0, 1, one_process(data))
    batches = [trainer.batches.get(0, m) for m in range(trainer.spec.grad_accum)]
    predicted = sum(int((b.targets != -100).sum()) for b in batches)
    coef = reference.config.router_aux_loss_coef
    reference.zero_grad(set_to_none=True)
    lm = aux = 0.0
    for batch in batches:
        out = reference(batch.tokens, output_router_logits=True)
        token_losses = F.cross_entropy(
            out.logits.flatten(0, 1), batch.targets.flatten(), reduction="sum", ignore_index=-100
        )
        objective = token_losses / predicted + coef * out.aux_loss / len(batches)
        objective.backward()
        lm += float(token_losses) / predicted
        aux += float(out.aux_loss) / len(batches)
    return {"loss": lm, "aux_loss": aux, "grads": ctxlaunch_grads(reference)}
