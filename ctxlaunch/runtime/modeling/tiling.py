# Shapes: x (B, S, h), S the tokens this rank holds; tiles are (B, T, h) slices of S.
"""The feed-forward over sequence tiles, in forward and in backward (Arctic Long Sequence
Training's tiled MLP).

A block's feed-forward half (RMSNorm, fused gate/up projection, SwiGLU, down projection) works
on each token alone, so it can run on a tile of T tokens at a time: its (tokens x ffn)
intermediates then exist for one tile, never for the whole sequence. Forward runs each tile
without autograd and writes its rows of the output; only the input is kept. Backward runs each
tile again with autograd and differentiates it at once, its rows of the incoming gradient in,
its rows of the input's gradient out, the weights' gradients accumulated tile by tile (under
DeepSpeed ZeRO each parameter is marked not ready until the last tile, so that its gradient
enters the reduce bucket once). The cost is one more feed-forward pass per step.

Backward re-enters the autocast state forward ran under, so each tile computes as it did in
forward. Under TP the tile's input projection gathers the tile over the TP ranks and its exit
reduce-scatters it: every TP rank runs the same tiles in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn


def _tiles(tokens: int, tile_tokens: int) -> Iterator[slice]:
    for start in range(0, tokens, tile_tokens):
        yield slice(start, min(start + tile_tokens, tokens))


def _forward_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int
) -> torch.Tensor:
    """fn over each tile without autograd, written into one output."""
    out: torch.Tensor | None = None
    with torch.no_grad():
        for rows in _tiles(x.shape[1], tile_tokens):
            tile_out = fn(x[:, rows])
            if out is None:  # the output's dtype is the tile's (autocast's, if on)
                shape = (x.shape[0], x.shape[1], *tile_out.shape[2:])
                out = torch.empty(shape, dtype=tile_out.dtype, device=x.device)
            out[:, rows] = tile_out
            del tile_out  # before the next tile's, not after
    assert out is not None  # a sequence has at least one token
    return out


class _TiledFeedForward(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        fn: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        tile_tokens: int,
        params: Sequence[nn.Parameter],
    ) -> torch.Tensor:
        device = x.device.type
        ctx.fn, ctx.tile_tokens = fn, tile_tokens
        ctx.params = [p for p in params if p.requires_grad]
        ctx.autocast = (
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
        )
        ctx.save_for_backward(x)
        return _forward_tiles(fn, x, tile_tokens)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        x = x.detach()
        # Each tile's input gradient accumulates (in place: autograd adds into a defined .grad)
        # straight into its rows of the whole input's gradient.
        grad_x = torch.zeros_like(x)
        enabled, dtype = ctx.autocast
        tiles = list(_tiles(x.shape[1], ctx.tile_tokens))
        for index, rows in enumerate(tiles):
            last = index == len(tiles) - 1
            for param in ctx.params:
                param.ds_grad_is_ready = last  # DeepSpeed: one bucket entry per parameter
            tile = x[:, rows].requires_grad_()
            tile.grad = grad_x[:, rows]
            with (
                torch.enable_grad(),
                torch.autocast(x.device.type, dtype=dtype, enabled=enabled),
            ):
                tile_out = ctx.fn(tile)
            torch.autograd.backward(tile_out, grad_out[:, rows])
            del tile_out, tile
        for param in ctx.params:
            param.ds_grad_is_ready = True
        return None, grad_x, None, None


def tiled_feed_forward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile_tokens: int,
    params: Sequence[nn.Parameter],
) -> torch.Tensor:
    """`fn(x)` computed over tiles of `tile_tokens` tokens of x's sequence dimension (dim 1) in
    forward and again, with autograd, in backward; `fn` must work on each token alone (a
    feed-forward), and `params` are the parameters it uses (their gradients accumulate over
    the tiles). Differentiable in x; only x is kept for backward."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be at least 1, got {tile_tokens}")
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return _forward_tiles(fn, x, tile_tokens)  # nothing to differentiate (evaluation)
    return _TiledFeedForward.apply(fn, x, tile_tokens, list(params))
