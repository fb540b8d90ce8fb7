# Shapes: tokens (T, h) this rank's tokens of one mixture-of-experts layer; routings (T, k);
# rows (R, h) the routings gathered and sorted by expert; counts (E,) routings per expert;
# E_local = E / ep experts on each rank of the EP group.
"""Expert parallelism, folded over DP x CP: each rank of an EP group (ep consecutive ranks of
the ranks holding the same dense weights, `contract.parallel_dims`) holds E / ep experts of
every mixture-of-experts layer, and the tokens go to their experts' ranks and back by
all-to-all.

    sort the routings by expert            rows (T*k, h), counts (E,)
    exchange the counts (all-to-all)       what each rank will send to each of my experts
    dispatch (all-to-all, uneven splits)   the rows of my experts, by source rank
    group them by expert, run the experts  one grouped computation (moe.Experts)
    combine (all-to-all back)              each routing's output at its token's rank
    weight and sum per token               moe.combine

The counts go first so that every rank knows the sizes of what it receives (dropless: no
capacity pads the exchange). Both all-to-alls are one autograd Function each, whose backward is
the reverse exchange of the same bytes. `apply_expert_parallel` keeps each rank's experts of
the model and installs the dispatch and the router statistics' reduction, as `parallelize`
installs attention: the model never touches a process group.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ctxlaunch.runtime.modeling.model import Transformer
from ctxlaunch.runtime.modeling.moe import Experts, MoEFeedForward, combine, sort_routings
from ctxlaunch.runtime.parallel.context import ParallelContext


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group
        )
        return back, None, None, None


def expert_parallel_dispatch(
    tokens: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    experts: Experts,
    *,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The experts' weighted outputs summed per token (T, h), the experts spread over the EP
    `group` (this rank's are `experts`, E / ep of them, in rank order)."""
    ep, local, k = dist.get_world_size(group), experts.local, index.shape[1]
    order, counts = sort_routings(index, experts.total)
    # What every rank sends to each of my experts, before the rows themselves.
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts, group=group)
    send = counts.view(ep, local).sum(1).tolist()
    by_source = arriving.view(ep, local)  # [source rank, my expert]
    receive = by_source.sum(1).tolist()
    # The rows arrive by source rank, then expert: group them by expert for the experts.
    expert_of = torch.arange(local, device=counts.device).repeat(ep)
    regroup = torch.argsort(expert_of.repeat_interleave(by_source.reshape(-1)), stable=True)
    restore = torch.empty_like(regroup)
    restore[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    held = by_source.sum(0).tolist()
    # One expression, no names: each routing-sized buffer (the rows sent, the rows arrived,
    # the experts' outputs, the outputs back) is a temporary, released as soon as the next
    # holds its rows; combine drops the last before its product.
    return combine(
        tokens,
        order,
        k,
        _AllToAll.apply(
            experts(_AllToAll.apply(tokens[order // k], receive, send, group)[regroup], held)[
                restore
            ],
            send,
            receive,
            group,
        ),
        weights,
    )


def _sum_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def apply_expert_parallel(model: Transformer, ctx: ParallelContext) -> dict[str, tuple[int, int]]:
    """Keep this rank's experts of every mixture-of-experts block (a slice of the meta or whole
    tensors), install the dispatch over its EP group and the router counts' reduction over
    the ranks holding a part of the micro-batch. Returns each expert parameter's (first,
    count) of the experts this rank holds, by its name in the whole model."""
    d = ctx.dims
    held: dict[str, tuple[int, int]] = {}
    for owner, module in model.named_modules():
        if not isinstance(module, MoEFeedForward):
            continue
        experts = module.experts
        count = experts.total // d.ep
        first = ctx.ep_rank * count
        if d.ep > 1:
            assert ctx.ep_group is not None  # ep > 1
            with torch.no_grad():
                for leaf in experts.leaves:
                    whole = getattr(experts, leaf)
                    setattr(
                        experts, leaf, nn.Parameter(whole.detach()[first : first + count].clone())
                    )
            experts.first = first
            experts.gradient_scale = 1.0 / d.ep
            module.dispatch = partial(expert_parallel_dispatch, group=ctx.ep_group)
        for leaf in experts.leaves:
            held[f"{owner}.experts.{leaf}"] = (first, count)
    if model.routing is not None and d.world_size // d.pp > 1:
        # Where the stage has one rank the counts are already whole; with one stage the
        # group is the whole job (None).
        model.routing.reduce = partial(_sum_over, group=ctx.tokens_group)
    return held
