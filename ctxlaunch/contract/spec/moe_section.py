"""The model section's `moe`: a mixture-of-experts feed-forward (its experts, the router, which
layers have it, the load-balancing loss), for the families whose block has one."""

from __future__ import annotations

from pydantic import Field, NonNegativeInt, model_validator

from ctxlaunch.contract.spec.fields import PositiveInt, _Strict


class MoESpec(_Strict):
    """A mixture-of-experts feed-forward in place of the dense one (the layers `layer_step` and
    `dense_layers` choose): a router scores the token against every expert (softmax), the
    token goes to its `experts_per_token` best, and their SwiGLU outputs are summed, weighted
    by those probabilities (renormalised to sum to 1 where `norm_topk_prob` says), as
    transformers' routers compute it."""

    experts: PositiveInt
    """Routed experts in each mixture-of-experts layer (config.json's num_experts or
    num_local_experts). parallel.ep must divide it."""
    experts_per_token: PositiveInt
    """Experts each token is sent to (the router's top-k; num_experts_per_tok)."""
    ffn_hidden: PositiveInt
    """Each expert's SwiGLU width (config.json's moe_intermediate_size, or intermediate_size in
    families whose every layer is sparse)."""
    shared_ffn_hidden: PositiveInt | None = None
    """The shared expert's SwiGLU width, in families that have one (every token passes through
    it, its output scaled by a sigmoid gate of the token; shared_expert_intermediate_size);
    null in the others."""
    layer_step: PositiveInt = 1
    """Every layer_step-th layer (the ones whose index + 1 it divides) is a mixture of experts,
    the others dense (model.ffn_hidden wide); config.json's decoder_sparse_step."""
    dense_layers: list[NonNegativeInt] = []
    """Layers (0-based) that stay dense whatever layer_step says (mlp_only_layers; a model's
    first dense layers)."""
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' probabilities to sum to 1 (norm_topk_prob); families
    whose router always does need it true."""
    aux_loss_coef: float = Field(0.001, ge=0)
    """The load-balancing auxiliary loss's coefficient (router_aux_loss_coef): the training
    objective is the language-model loss + aux_loss_coef x the Switch-style loss
    E x sum_e (share of routings to e) x (mean probability of e), its statistics over every
    token of the micro-batch on every rank and over every mixture-of-experts layer, as
    transformers' load_balancing_loss_func computes them. 0 turns it off."""
    swiglu_limit: float | None = Field(None, gt=0)
    """The clamped SwiGLU of the families whose experts use it (config.json's swiglu_limit):
    the gate clamped to at most this, the up projection to within +-this, and each expert's
    activation (up + 1) x gate x sigmoid(swiglu_alpha x gate). null in the other families
    (plain SwiGLU)."""
    swiglu_alpha: float | None = Field(None, gt=0)
    """The clamped SwiGLU's sigmoid gain (config.json's swiglu_alpha, 1.702 in the released
    models): set together with swiglu_limit, null without it."""
    planned_load: float | None = Field(None, ge=1)
    """The routing load the planner admits under expert parallelism: the routings the busiest
    rank of an EP group receives over the mean, for which it plans the dispatch buffers and
    the experts' activations. null: ep (dropless, every routing of the group may reach one
    rank), or the capacity factor's bound where one is set. A run's measured load is the
    expert_rank_load metric; the alert fires as it nears this."""
    capacity_factor: float | None = Field(None, gt=0)
    """null (the default): dropless, every token reaches its experts. A number c: each expert
    takes at most ceil(c x tokens x experts_per_token / experts) of a rank's routings per layer,
    the rest dropped (their expert output is 0) and counted in the tokens-dropped metric; a
    capacity tuned on short sequences does not carry over to long ones."""

    @model_validator(mode="after")
    def _top_k(self) -> MoESpec:
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"experts_per_token = {self.experts_per_token} exceeds experts = "
                f"{self.experts}: a token can go to at most every expert"
            )
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ValueError(
                f"swiglu_limit = {self.swiglu_limit} and swiglu_alpha = {self.swiglu_alpha}: "
                "the clamped SwiGLU needs both, the plain one neither"
            )
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) is a mixture of experts (transformers' rule: not in
        mlp_only_layers and (layer + 1) divisible by decoder_sparse_step)."""
        return layer not in self.dense_layers and (layer + 1) % self.layer_step == 0

    def moe_layers(self, layers: int) -> list[int]:
        """The mixture-of-experts blocks of a model of `layers` blocks."""
        return [i for i in range(layers) if self.is_moe_layer(i)]
