"""Parameter counts and model FLOPs of the Llama-style decoder (and its families' additions:
q/k/v biases, q/k norms, head_dim free of hidden / heads), in both MFU conventions.

Model FLOPs per token (forward + backward, recomputation not counted) =
    6 * N_matmul                       the weight matmuls
  + 12 * L * heads * head_dim * s      attention scores and values over all s x s entries

`N_matmul` is every parameter except the input embedding table (a lookup, not a matmul), as
torchtitan counts it; a tied embedding is counted once, as the output head. The biases and norm
gains are counted in it too (as torchtitan's count of all parameters does): a few in a million.
In a mixture-of-experts model it counts the active parameters, those a token's matmuls use:
the router, the experts_per_token experts it is routed to (not all E) and the shared expert with
its gate, so MFU means for a sparse model what it means for a dense one (torchtitan and
Megatron count MoE FLOPs the same way).

Two conventions are in use and differ by up to ~1.8x at 128K+ tokens, so both are reported:
- "full": the whole score matrix is counted (PaLM, torchtitan, NeMo);
- "causal": the attention term is halved for causal masking (Megatron-LM).
Neither counts activation recomputation (that would be hardware FLOPs, not model FLOPs).

A local (sliding-window) layer's attention is its window's: each token's query meets at most
`window` keys, so in the "full" convention a local layer counts `window` keys per token where a
full layer counts s, and in the "causal" convention the band's exact area, s*w - w(w-1)/2 pairs
per sequence, where a full layer counts s^2 / 2 (`attention_keys_per_token`). The step-time
model scales the attention it executes by the same share (`window_attention_fraction`).

A document mask (training.data.document_mask) computes only each document's causal triangle:
`document_attention_fraction` is that share of the causal area, which the step-time model
applies to the attention it executes (the MFU conventions above stay those of the published
runs: they count the score matrix of the whole sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ctxlaunch.contract.families.family import BlockShape, WindowedShape

if TYPE_CHECKING:
    from ctxlaunch.contract.families.experts import ExpertsShape

MfuConvention = Literal["full", "causal"]
CONVENTIONS: tuple[MfuConvention, ...] = ("full", "causal")


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the decoder, by part."""

    embedding: int
    """Input embedding table (vocab x hidden)."""
    per_layer: int
    """One dense transformer block: attention (q, k, v, o, and the family's q/k/v biases and
    q/k norms), SwiGLU (gate, up, down), two norms."""
    layers: int
    final_norm: int
    head: int
    """Output projection (0 when tied to the embedding)."""
    moe_layers: int = 0
    """Blocks whose feed-forward is a mixture of experts (the others are dense)."""
    moe_block: int = 0
    """One mixture-of-experts block: attention, the router, every expert, the shared expert
    and its gate, two norms."""
    experts_per_block: int = 0
    """The routed experts' parameters of one mixture-of-experts block (E x 3 x h x f_e): what
    expert parallelism splits."""
    active_experts_per_block: int = 0
    """The routed experts' parameters one token uses in a mixture-of-experts block (top-k of
    them)."""

    @property
    def blocks(self) -> int:
        """Every block's parameters."""
        return self.per_layer * (self.layers - self.moe_layers) + self.moe_block * self.moe_layers

    @property
    def total(self) -> int:
        return self.embedding + self.blocks + self.final_norm + self.head

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters of every block (0 for a dense model)."""
        return self.experts_per_block * self.moe_layers

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        return self.total - (self.experts_per_block - self.active_experts_per_block) * (
            self.moe_layers
        )

    @property
    def matmul(self) -> int:
        """Active parameters that take part in matmuls (the 6N of model FLOPs)."""
        head = self.head if self.head else self.embedding
        inactive = (self.experts_per_block - self.active_experts_per_block) * self.moe_layers
        return self.blocks - inactive + self.final_norm + head

    def block_params(self, layer: int, moe: ExpertsShape | None) -> int:
        """Parameters of block `layer` (a mixture of experts where `moe` says)."""
        return self.moe_block if moe is not None and moe.is_moe_layer(layer) else self.per_layer


def count_params(model: BlockShape) -> ParamCount:
    """The decoder's parameters, by part."""
    h, f = model.hidden, model.ffn_hidden
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o
    if model.qkv_bias:
        attention += q + 2 * kv  # biases on q, k and v
    if model.o_bias:
        attention += h  # the output projection's bias
    if model.qk_norm:
        attention += 2 * model.head_dim  # q/k norms: one gain over each head of q, one of k
    if model.attention_sinks:
        attention += model.heads  # one sink logit per query head
    mlp = 3 * h * f  # gate, up, down
    norms = 4 * h if model.post_norms else 2 * h  # before (and after) each sub-block
    embedding = model.vocab * h
    moe = model.moe
    sparse: dict[str, int] = {}
    if moe is not None:
        expert = 3 * h * moe.ffn_hidden
        router = moe.experts * h
        if model.expert_biases:
            expert += 2 * moe.ffn_hidden + h  # gate/up and down biases
            router += moe.experts
        experts = moe.experts * expert
        shared = (
            3 * h * moe.shared_ffn_hidden + h
            if model.shared_expert and moe.shared_ffn_hidden
            else 0
        )
        sparse = dict(
            moe_layers=len([i for i in range(model.layers) if moe.is_moe_layer(i)]),
            moe_block=attention + norms + router + experts + shared,
            experts_per_block=experts,
            active_experts_per_block=moe.experts_per_token * expert,
        )
    return ParamCount(
        embedding=embedding,
        per_layer=attention + mlp + norms,
        layers=model.layers,
        final_norm=h,
        head=0 if model.tie_embeddings else model.vocab * h,
        **sparse,
    )


def attention_keys_per_token(seq_len: int, window: int | None, convention: MfuConvention) -> float:
    """Keys one token's query is counted against in a layer: a full layer's s ("full") or
    s / 2 ("causal"); a local layer's window ("full") or its band's area per token
    ("causal")."""
    if window is None or window >= seq_len:
        return float(seq_len) if convention == "full" else seq_len / 2
    if convention == "full":
        return float(window)
    return (seq_len * window - window * (window - 1) / 2) / seq_len


def attention_flops_per_token(
    model: WindowedShape, seq_len: int, convention: MfuConvention
) -> float:
    """Attention score + value FLOPs per token, forward and backward, summed over the layers
    (each local layer's over its window)."""
    keys = sum(attention_keys_per_token(seq_len, w, convention) for w in model.layer_windows)
    return 12.0 * model.heads * model.head_dim * keys


def window_attention_fraction(model: WindowedShape, seq_len: int) -> float:
    """The share of the causal attention area of all layers that the model computes: 1 with
    no local layer, less where local layers see only their window."""
    keys = sum(attention_keys_per_token(seq_len, w, "causal") for w in model.layer_windows)
    return keys / (len(model.layer_windows) * seq_len / 2)


def flops_per_token(model: WindowedShape, seq_len: int, convention: MfuConvention) -> float:
    """Model FLOPs per trained token (forward + backward) for sequences of seq_len tokens."""
    return 6.0 * count_params(model).matmul + attention_flops_per_token(model, seq_len, convention)


def mfu(
    tokens_per_second_per_gpu: float,
    model: WindowedShape,
    seq_len: int,
    peak_flops_per_gpu: float,
    convention: MfuConvention,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the GPU's peak."""
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be positive, got {peak_flops_per_gpu}")
    return (
        tokens_per_second_per_gpu * flops_per_token(model, seq_len, convention) / peak_flops_per_gpu
    )


def token_weighted_document_tokens(document_lengths: Iterable[int]) -> float:
    """Sum of squared document lengths over the sum of lengths: the length of the document an
    average token belongs to (what a document mask's attention cost follows)."""
    lengths = [int(n) for n in document_lengths]
    total = sum(lengths)
    if total <= 0:
        raise ValueError("document lengths must include at least one token")
    return sum(n * n for n in lengths) / total


def document_attention_fraction(seq_len: int, document_tokens: float) -> float:
    """The share of the causal score area (S(S+1)/2 pairs) a document mask computes when the
    token-weighted mean document length is `document_tokens`: sum over documents of
    L(L+1)/2 over S(S+1)/2 = (m + 1) / (S + 1) with m = sum L^2 / S, m capped at S (documents
    longer than a sequence are cut into whole sequences). 1 when m >= S."""
    if seq_len < 1 or document_tokens <= 0:
        raise ValueError(
            f"seq_len ({seq_len}) and document_tokens ({document_tokens}) must be positive"
        )
    return (min(float(document_tokens), seq_len) + 1) / (seq_len + 1)
