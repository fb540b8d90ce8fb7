# Shapes: hidden (B, S, h) with S this rank's tokens (sequence-parallel under TP); the router's
# tokens (T, h) = the hidden flattened; routings (T, k); rows (R, h) the routings gathered and
# sorted by expert; E experts in all, E_local = E / ep on this rank.
"""The mixture-of-experts feed-forward: a router, the experts as one grouped computation, a
shared expert where the family has one, and the load-balancing loss's statistics.

The router is transformers' (its mixture-of-experts families'): softmax over the experts in fp32,
top-k, the k probabilities renormalised to sum to 1 where the model says, cast back to the
hidden dtype; or, where the family's router takes the top-k first (`top_k_first`), the top-k of
the logits (with the router's bias where it has one) and a softmax over those k alone. Each
token's output is the sum of its k experts' SwiGLU outputs weighted by them, plus the shared
expert's output times sigmoid(gate . token). Dropless unless `capacity_factor` is set. Experts
may have biases (added to each projection's output) and the clamped SwiGLU (`_ClampedSwiGLU`)
as their activation.

The model never touches a process group: moving the routings to their experts and back is
`dispatch`, installed by `parallelize` (`local_dispatch` by default: every expert here; under
expert parallelism `parallel.expert_parallel`'s all-to-all). Experts run as one grouped
computation (`Experts.forward`): on the CPU a loop over the experts' row blocks, on CUDA in bf16
torch's grouped GEMM where this torch has one.

The load-balancing loss (transformers' `load_balancing_loss_func`):

    aux = E x sum_e (C_e / N) x (P_e / N)

with C_e the routings to expert e and P_e the sum of its router probabilities, both over every
token of the micro-batch and every mixture-of-experts layer of the model, and N the tokens x
those layers. Its gradient reaches only P (C counts), and the one of a rank's own tokens needs
the global C: so each rank records its layers' counts and probability sums during its forward
(`RoutingPass`), the counts are summed over every rank holding a part of the micro-batch
(`reduce`, installed by `parallelize`: DP x CP x TP of the stage), and the gradient
coef x E x C_e / N^2 (times the engine's averaging scale) is injected into each rank's P at the
start of the part's backward (`_RouterLoss`): the gradients equal one process's over the whole
batch, however the tokens fall on the ranks. Under pipeline parallelism the counts of the
stages before ride forward with the hidden states and the totals come back with their gradient
(`send_counts`, `receive_counts`), so every stage's loss term sees the whole model's counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ctxlaunch.runtime.modeling.pointwise import _upcast, gated_backward

if TYPE_CHECKING:
    from ctxlaunch.contract.families.experts import ExpertsShape

Dispatch = Callable[..., torch.Tensor]
"""dispatch(tokens (T, h), index (T, k), weights (T, k), experts, keep (T*k,) | None) ->
the experts' weighted outputs summed per token (T, h)."""
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""reduce(x): x summed over every rank holding a part of the micro-batch (in place)."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (expert weights under expert parallelism:
    their gradient gathers the tokens of ep ranks, and the engines average it over the
    dp x cp / ep ranks holding the same experts, so 1 / ep makes that the average over
    dp x cp, as for every other weight)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _grouped_mm_usable(rows: torch.Tensor) -> bool:
    return (
        rows.device.type == "cuda"
        and rows.dtype == torch.bfloat16
        and hasattr(F, "grouped_mm")
        and torch.cuda.get_device_capability(rows.device)[0] >= 9
    )


class _ClampedSwiGLU(torch.autograd.Function):
    """(clamp(up, -limit, limit) + 1) x g x sigmoid(alpha x g), g = clamp(gate, max=limit):
    transformers' GptOss experts' activation. Saves gate and up as `_SwiGLU` does and
    recomputes the rest in backward, in fp32 over chunks of rows as `_SwiGLU` does (so its
    temporaries are a chunk's, as the planner counts them); a clamped side's gradient is 0
    beyond its limit (torch's clamp passes it at the limit itself)."""

    @staticmethod
    def forward(
        ctx, gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.limit, ctx.alpha = limit, alpha
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(alpha * g))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha

        def rows_backward(
            gate: torch.Tensor,
            up: torch.Tensor,
            grad: torch.Tensor,
            grad_gate: torch.Tensor,
            grad_up: torch.Tensor,
        ) -> None:
            # Out of place: an fp32 input's upcast is the saved tensor itself. At most three
            # fp32 (chunk x f) temporaries live at once, the clamps' masks aside.
            g, u = _upcast(gate), _upcast(up)
            inside_gate, inside_up = g <= limit, u.abs() <= limit
            g = g.clamp(max=limit)
            sig = torch.sigmoid(g * alpha)
            dy = _upcast(grad)
            grad_up.copy_((g * sig).mul_(dy).mul_(inside_up))
            # d/dg of g * sigmoid(alpha g) = sig * (1 + alpha * g * (1 - sig))
            work = torch.sub(1, sig).mul_(g).mul_(alpha).add_(1).mul_(sig)
            del g, sig
            work.mul_(dy).mul_(inside_gate)
            del dy
            grad_gate.copy_(work.mul_(u.clamp(-limit, limit).add_(1)))

        return (*gated_backward(gate, up, grad, rows_backward), None, None)


def clamped_swiglu(limit: float, alpha: float) -> Callable[..., torch.Tensor]:
    """The experts' activation of a family with the clamped SwiGLU: (gate, up) -> out."""

    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _ClampedSwiGLU.apply(gate, up, limit, alpha)

    return activation


class Experts(nn.Module):
    """This rank's experts, [first, first + local) of E: their gate/up (local, 2f, h) and down
    (local, h, f) projections, as one tensor each, and with `biases` their biases (local, 2f)
    and (local, h)."""

    def __init__(
        self,
        experts: int,
        hidden: int,
        ffn_hidden: int,
        swiglu: Callable[..., torch.Tensor],
        *,
        biases: bool = False,
    ):
        super().__init__()
        self.total, self.ffn_hidden = experts, ffn_hidden
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * ffn_hidden, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.b_gate_up: nn.Parameter | None = (
            nn.Parameter(torch.empty(experts, 2 * ffn_hidden)) if biases else None
        )
        self.b_down: nn.Parameter | None = (
            nn.Parameter(torch.empty(experts, hidden)) if biases else None
        )
        self.first = 0
        """The global index of this rank's first expert (`parallelize` keeps a slice)."""
        self.gradient_scale = 1.0
        """What each expert weight's gradient is multiplied by (see `_ScaleGradient`)."""
        self.swiglu = swiglu

    @property
    def local(self) -> int:
        """Experts held here."""
        return self.w_gate_up.shape[0]

    @property
    def leaves(self) -> tuple[str, ...]:
        """The names of its parameters, each one slice per expert (what EP splits)."""
        return ("w_gate_up", "w_down") + (
            ("b_gate_up", "b_down") if self.b_down is not None else ()
        )

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The SwiGLU of each row block through its expert: rows (R, h) sorted by expert,
        `counts[e]` of them for local expert e -> (R, h)."""
        w_gate_up, w_down = self.w_gate_up, self.w_down
        b_gate_up, b_down = self.b_gate_up, self.b_down
        if self.gradient_scale != 1.0:
            w_gate_up = _ScaleGradient.apply(w_gate_up, self.gradient_scale)
            w_down = _ScaleGradient.apply(w_down, self.gradient_scale)
            if b_gate_up is not None and b_down is not None:
                b_gate_up = _ScaleGradient.apply(b_gate_up, self.gradient_scale)
                b_down = _ScaleGradient.apply(b_down, self.gradient_scale)
        if _grouped_mm_usable(rows):
            offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
            gate_up = F.grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offsets)
            if b_gate_up is not None:
                gate_up = gate_up + _per_row(b_gate_up, counts, rows.shape[0])
            gate, up = gate_up.chunk(2, -1)
            out = F.grouped_mm(
                self.swiglu(gate.contiguous(), up.contiguous()),
                w_down.transpose(-2, -1),
                offs=offsets,
            )
            return out if b_down is None else out + _per_row(b_down, counts, rows.shape[0])
        # split and unbind, not slicing and indexing: their backward assembles the rows' and
        # the weights' gradients once, where a slice's would allocate a whole-size zero
        # gradient for each expert. An expert no routing reached runs on no rows: its weights
        # still get a (zero) gradient, so every rank reduces the same gradients.
        local = self.local
        gate_up_biases = b_gate_up.unbind(0) if b_gate_up is not None else (None,) * local
        down_biases = b_down.unbind(0) if b_down is not None else (None,) * local
        outputs = [
            F.linear(self.swiglu(*F.linear(block, gate_up, b_in).chunk(2, dim=-1)), down, b_out)
            for block, gate_up, down, b_in, b_out in zip(
                rows.split(counts),
                w_gate_up.unbind(0),
                w_down.unbind(0),
                gate_up_biases,
                down_biases,
                strict=True,
            )
        ]
        return torch.cat(outputs)


def _per_row(biases: torch.Tensor, counts: list[int], rows: int) -> torch.Tensor:
    """Each row's expert's bias: biases (E_local, n) repeated by `counts` -> (rows, n)."""
    repeats = torch.tensor(counts, device=biases.device)
    return biases.repeat_interleave(repeats, dim=0, output_size=rows)


def sort_routings(index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routings' order by expert, stable in token order; routings per expert (E,))."""
    flat = index.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=experts)


def combine(
    tokens: torch.Tensor, order: torch.Tensor, k: int, out_rows: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's experts' outputs (rows in `order`) back in token order, times their router
    weights, summed per token: (T, h). Un-permuted by an index (which keeps only the index for
    backward), not added in place by `index_add` (which would keep the weighted rows too)."""
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    per_token = out_rows[restore].view(tokens.shape[0], k, -1)
    del out_rows  # the caller passes its only reference: gone before the weighted product
    # (T, 1, k) @ (T, k, h): the weighted sum as one batched matmul (half the time of a
    # product and a sum on the CPU), keeping what they would: the rows and the weights.
    return torch.bmm(weights.unsqueeze(1).to(per_token.dtype), per_token).squeeze(1)


def local_dispatch(
    tokens: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    experts: Experts,
) -> torch.Tensor:
    """Every expert on this rank: the routings sorted by expert, one grouped computation,
    combined back (`combine`)."""
    order, counts = sort_routings(index, experts.total)
    k = index.shape[1]
    return combine(tokens, order, k, experts(tokens[order // k], counts.tolist()), weights)


@dataclass
class RoutingPass:
    """What one forward of a model part's mixture-of-experts layers routed, and the share of
    the load-balancing loss its tokens carry."""

    experts: int
    layers: int
    """Mixture-of-experts layers of the whole model (N counts every one)."""
    gradient_scale: float
    """coef x E x the engine's averaging scale: times C / N^2, the gradient of each P."""
    counts: list[torch.Tensor] = field(default_factory=list)
    """This rank's routings per expert, per layer of the part, in order (no gradient)."""
    layer_index: list[int] = field(default_factory=list)
    """Each recorded layer's place among the model's mixture-of-experts layers."""
    probabilities: list[torch.Tensor] = field(default_factory=list)
    """This rank's router probabilities summed per expert, per layer (with their graph)."""
    tokens: int = 0
    """This rank's tokens (every layer routes the same ones)."""
    dropped: int = 0
    """Routings over capacity, this rank, every layer of the part."""
    carried: torch.Tensor | None = None
    """The global counts of the stages before (under pipeline parallelism)."""
    layer_counts: torch.Tensor | None = None
    """The part's layers' counts summed over every rank of the micro-batch (layers, E)."""
    global_tokens: float = 0.0
    total: torch.Tensor | None = None
    """The whole model's global counts summed over its layers (E,): known at the end of the
    last stage's forward, and on other stages when their backward brings it back."""
    aux_loss: float = 0.0
    """This rank's share of the load-balancing loss (set when `total` is known)."""

    def record(
        self,
        layer: int,
        counts: torch.Tensor,
        probabilities: torch.Tensor,
        tokens: int,
        dropped: int,
    ) -> None:
        """One layer's routing (`MoEFeedForward` calls it)."""
        self.layer_index.append(layer)
        self.counts.append(counts)
        self.probabilities.append(probabilities)
        self.tokens = tokens
        self.dropped += dropped

    def so_far(self) -> torch.Tensor:
        """The global counts of the model's layers up to this part's last."""
        total = torch.zeros(self.experts, dtype=torch.float64)
        if self.layer_counts is not None:
            total = total + self.layer_counts.sum(0)
        if self.carried is not None:
            total = total + self.carried.cpu()
        return total

    def fill(self, total: torch.Tensor) -> None:
        """The whole model's global counts: this part's loss share is now known."""
        self.total = total.to(torch.float64).cpu()
        n = max(self.global_tokens * self.layers, 1.0)
        if self.probabilities:
            mine = torch.stack([p.detach() for p in self.probabilities]).sum(0).double().cpu()
            self.aux_loss = float(self.experts * (self.total * mine).sum() / (n * n))


class _RouterLoss(torch.autograd.Function):
    """Identity on the part's output; in backward, the load-balancing loss's gradient into this
    rank's summed router probabilities: gradient_scale x C_e / N^2 (C the whole model's global
    counts, by then in `routing.total`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probabilities: torch.Tensor, routing: RoutingPass):
        ctx.routing = routing
        ctx.dtype = probabilities.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        routing: RoutingPass = ctx.routing
        if routing.total is None:
            raise RuntimeError("the router counts of the later pipeline stages never came back")
        n = max(routing.global_tokens * routing.layers, 1.0)
        scale = routing.gradient_scale / (n * n)
        return grad, (routing.total * scale).to(device=grad.device, dtype=ctx.dtype), None


# -- the counts between pipeline stages -----------------------------------------------------------
COUNT_DIGITS = 4
"""Each count rides as four base-256 digits: integers up to 255 are exact in bf16 and fp32, so
the counts arrive exactly whatever dtype the stages exchange."""


def carried_rows(experts: int, hidden: int) -> int:
    """Rows (positions) appended to the hidden states between stages to carry E counts."""
    return math.ceil(COUNT_DIGITS * experts / hidden)


def _encode(counts: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    whole = counts.round().to(torch.int64)
    digits = torch.stack([(whole >> (8 * d)) & 255 for d in range(COUNT_DIGITS)], dim=-1)
    flat = torch.zeros(rows * like.shape[-1], dtype=like.dtype, device=like.device)
    flat[: digits.numel()] = digits.reshape(-1).to(like.dtype)
    return flat.view(1, rows, like.shape[-1]).expand(like.shape[0], rows, like.shape[-1])


def _decode(row: torch.Tensor, experts: int) -> torch.Tensor:
    digits = row[0].reshape(-1)[: COUNT_DIGITS * experts].round().to(torch.int64)
    digits = digits.view(experts, COUNT_DIGITS)
    whole = torch.zeros(experts, dtype=torch.int64, device=row.device)
    for d in range(COUNT_DIGITS):
        whole += digits[:, d] << (8 * d)
    return whole.to(torch.float64).cpu()


class _SendCounts(torch.autograd.Function):
    """Forward: the hidden states with the counts so far appended (rows positions more);
    backward: the whole model's counts read from those rows' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: RoutingPass, rows: int) -> torch.Tensor:
        ctx.routing, ctx.rows = routing, rows
        return torch.cat([x, _encode(routing.so_far(), x, rows)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = ctx.rows
        ctx.routing.fill(_decode(grad[:, -rows:].detach().to(torch.float64), ctx.routing.experts))
        return grad[:, :-rows], None, None


class _ReceiveCounts(torch.autograd.Function):
    """Forward: the counts of the stages before split off the hidden states; backward: the
    whole model's counts sent back in those rows' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: RoutingPass, rows: int) -> torch.Tensor:
        ctx.routing, ctx.rows = routing, rows
        routing.carried = _decode(x[:, -rows:].detach().to(torch.float64), routing.experts)
        return x[:, :-rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        routing: RoutingPass = ctx.routing
        if routing.total is None:
            raise RuntimeError("the router counts of the later pipeline stages never came back")
        back = torch.cat([grad, _encode(routing.total, grad, ctx.rows)], dim=1)
        return back, None, None


class MoEFeedForward(nn.Module):
    """A mixture-of-experts feed-forward: `forward(x (B, S, h))` -> (B, S, h)."""

    def __init__(
        self,
        hidden: int,
        moe: ExpertsShape,
        *,
        renormalise: bool,
        swiglu: Callable[..., torch.Tensor],
        shared: nn.Module | None = None,
        biases: bool = False,
        top_k_first: bool = False,
    ):
        super().__init__()
        self.top_k, self.renormalise = moe.experts_per_token, renormalise
        self.top_k_first = top_k_first
        """Top-k of the logits, then a softmax over those k (else softmax, then top-k)."""
        self.capacity_factor = moe.capacity_factor
        self.router = nn.Linear(hidden, moe.experts, bias=biases)
        if moe.swiglu_limit is not None and moe.swiglu_alpha is not None:
            swiglu = clamped_swiglu(moe.swiglu_limit, moe.swiglu_alpha)
        self.experts = Experts(moe.experts, hidden, moe.ffn_hidden, swiglu, biases=biases)
        self.shared = shared
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared is not None else None
        self.dispatch: Dispatch = local_dispatch
        """Moves the routings to their experts and back (`parallelize` installs expert
        parallelism's)."""
        self.index = 0
        """Its place among the model's mixture-of-experts layers (set by the model)."""
        self.routing: RoutingPass | None = None
        """Where this forward records its routing (set by `begin_routing` for one forward;
        None outside one, as in a checkpointed block's recomputation)."""

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fp32 probabilities (T, E), chosen experts (T, k), their weights (T, k) in the
        tokens' dtype), as transformers' routers compute them."""
        # Through the module: DeepSpeed ZeRO-3 gathers a weight in its module's hooks.
        logits = self.router(tokens)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.top_k_first:
            top_logits, index = torch.topk(logits, self.top_k, dim=-1)
            return probabilities, index, torch.softmax(top_logits, dim=-1)
        top, index = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return probabilities, index, top.to(logits.dtype)

    def _capacity(self, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Weights with the routings beyond each expert's capacity zeroed (in token order:
        the first ones keep their place), and how many were dropped."""
        if self.capacity_factor is None:
            return weights, 0
        experts = self.experts.total
        capacity = math.ceil(self.capacity_factor * index.numel() / experts)
        order, counts = sort_routings(index, experts)
        starts = torch.cumsum(counts, 0) - counts
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(
            counts
        )
        kept = (place < capacity).view_as(index)
        return weights * kept.to(weights.dtype), int((~kept).sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        if torch.is_autocast_enabled(x.device.type):
            # Cast once: the router, the experts' rows (and the all-to-all's bytes) and the
            # shared expert then share one 16-bit copy instead of autocast making one each.
            tokens = tokens.to(torch.get_autocast_dtype(x.device.type))
        probabilities, index, weights = self.route(tokens)
        weights, dropped = self._capacity(index, weights)
        if self.routing is not None:
            counts = torch.bincount(index.reshape(-1), minlength=self.experts.total)
            self.routing.record(
                self.index,
                counts.detach().to(torch.float64),
                probabilities.sum(0),
                tokens.shape[0],
                dropped,
            )
        out = self.dispatch(tokens, index, weights, self.experts)
        if self.shared is not None and self.shared_gate is not None:
            gate = torch.sigmoid(self.shared_gate(tokens))
            out = out + gate * self.shared(tokens)
        return out.view(b, s, h).to(x.dtype)


def _moe_layers(blocks: Sequence[nn.Module]) -> list[MoEFeedForward]:
    found = [getattr(block, "ffn", None) for block in blocks]
    return [ffn for ffn in found if isinstance(ffn, MoEFeedForward)]


class Routing:
    """The model's side of the load-balancing loss: opens a `RoutingPass` for each forward of
    a part's blocks and closes it (the counts reduced, the loss's gradient attached). Installed
    on a mixture-of-experts `Transformer` as `routing`."""

    def __init__(self, experts: int, layers: int, coef: float, hidden: int):
        self.experts, self.layers, self.coef = experts, layers, coef
        self.rows = carried_rows(experts, hidden)
        self.reduce: Reduce = _identity
        """Sums the counts over every rank holding a part of the micro-batch (`parallelize`)."""
        self.scale = 1.0
        """The engine's averaging scale of this step: replicas / micro-batches (engines.py)."""
        self.passes: list[RoutingPass] = []
        """This step's passes (read and cleared by `drain`)."""

    def begin(self, blocks: Sequence[nn.Module]) -> RoutingPass | None:
        """A pass recording the routing of `blocks`' mixture-of-experts layers (None in a
        forward without gradients: evaluation records nothing)."""
        if not torch.is_grad_enabled():
            return None
        routing = RoutingPass(self.experts, self.layers, self.coef * self.experts * self.scale)
        for layer in _moe_layers(blocks):
            layer.routing = routing
        self.passes.append(routing)
        return routing

    def end(
        self, routing: RoutingPass, blocks: Sequence[nn.Module], x: torch.Tensor, *, last: bool
    ) -> torch.Tensor:
        """Close `routing`: no more recording (a checkpointed block's recomputation records
        nothing), the counts and tokens summed over the micro-batch's ranks, and the
        load-balancing loss's gradient attached to `x` (the part's output)."""
        for layer in _moe_layers(blocks):
            layer.routing = None
        local = torch.zeros(len(routing.counts) * self.experts + 1, dtype=torch.float64)
        if routing.counts:
            local[:-1] = torch.stack(routing.counts).reshape(-1).cpu()
        local[-1] = routing.tokens
        summed = self.reduce(local.to(x.device)).cpu()
        routing.layer_counts = summed[:-1].view(len(routing.counts), self.experts)
        routing.global_tokens = float(summed[-1])
        if last:
            routing.fill(routing.so_far())
        if routing.probabilities and self.coef > 0:
            probabilities = torch.stack(routing.probabilities).sum(0)
            x = _RouterLoss.apply(x, probabilities, routing)
        return x

    def send_counts(self, x: torch.Tensor, routing: RoutingPass | None) -> torch.Tensor:
        """The hidden states a stage sends on, with the counts so far appended (zeros in a
        forward that records nothing)."""
        if routing is None:
            return torch.cat([x, x.new_zeros(x.shape[0], self.rows, x.shape[2])], dim=1)
        return _SendCounts.apply(x, routing, self.rows)

    def receive_counts(self, x: torch.Tensor, routing: RoutingPass | None) -> torch.Tensor:
        """The hidden states a stage received, the counts of the stages before taken off."""
        if routing is None:
            return x[:, : -self.rows]
        return _ReceiveCounts.apply(x, routing, self.rows)

    def drain(self) -> list[RoutingPass]:
        """This step's passes, cleared."""
        passes, self.passes = self.passes, []
        return passes

    def step_summary(self, passes: list[RoutingPass], micro_batches: int) -> torch.Tensor:
        """What this rank adds to the step's routing summary (float64): its share of the
        load-balancing loss (mean over micro-batches), the routings it dropped, then every
        mixture-of-experts layer's global counts (layers x E) where its passes saw them
        (zeros elsewhere). Summed over the job, divided by the ranks of a stage for the
        counts, it is `summarise`'s input."""
        out = torch.zeros(2 + self.layers * self.experts, dtype=torch.float64)
        counts = out[2:].view(self.layers, self.experts)
        for routing in passes:
            out[0] += routing.aux_loss / micro_batches
            out[1] += routing.dropped
            if routing.layer_counts is not None:
                for row, layer in enumerate(routing.layer_index):
                    counts[layer] += routing.layer_counts[row]
        return out


def summarise(summed: torch.Tensor, experts: int, ep: int, stage_ranks: int) -> dict:
    """The step's routing figures from `Routing.step_summary` summed over the job:
    aux_loss, tokens_dropped, expert_load (and per layer), expert_rank_load."""
    counts = summed[2:].view(-1, experts) / stage_ranks
    loads: list[float] = []
    rank_loads: list[float] = []
    for row in counts:
        mean = float(row.mean())
        loads.append(float(row.max()) / mean if mean else 1.0)
        per_rank = row.view(ep, experts // ep).sum(1)
        rank_mean = float(per_rank.mean())
        rank_loads.append(float(per_rank.max()) / rank_mean if rank_mean else 1.0)
    return {
        "aux_loss": float(summed[0]),
        "tokens_dropped": int(round(float(summed[1]))),
        "expert_load": max(loads, default=1.0),
        "expert_load_layers": tuple(round(x, 4) for x in loads),
        "expert_rank_load": max(rank_loads, default=1.0),
    }
