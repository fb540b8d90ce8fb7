# Shapes: q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D), Hq % Hkv == 0; out (B, Hq, Sq, D); lse (B, Hq, Sq).
"""One FlexAttention call per block under a document mask or a local layer's window: a ring
hop's queries over the K/V it holds, a local layer's own block or halo block (``window.py``),
or a whole sequence's documents, in a single kernel call with a block mask (one per layer
kind: the window is part of the mask's key).

The per-rectangle path (``documents.block_pieces``) makes one dense kernel call per (query run,
K/V run, document) rectangle: thousands for a sequence of short documents, each with a fixed
launch cost on a GPU. Here a block is one call to FlexAttention, whose block mask is built from
each row's global position and document (visible: same document, key not after the query);
tiles the mask hides entirely are skipped inside the kernel. The block masks of a step are
built once and reused by every layer, forward and backward (``HopMasks`` keeps them).

Backward needs the gradient of a block given the *final* (merged) out and lse of its rows, as
the dense kernels take them (``kernels.attention_backward``): FlexAttention's backward operator
takes out and lse as arguments, so it is called directly with the merged ones. Both operators
are torch 2.13's own (``torch._higher_order_ops.flex_attention``, what its public
``flex_attention`` calls); their lse is in log2 units (the Triton backend, forced here), which
this module converts. On CUDA each runs compiled (Inductor's fused Triton kernel); on the CPU
they run torch's dense reference implementation, exact and slow, which is what the tests check
this path with against the per-rectangle one.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .documents import CuSeqlens, RingShards

_LN2 = math.log(2.0)
BLOCK_TOKENS = 128
"""The block mask's tile (FlexAttention's default): tiles it hides entirely are never computed."""

Rows = tuple[int, int]
"""(first, stop) of the local query rows a block mask covers."""


def _identity_score(score, batch, head, q_index, kv_index):
    return score


def _kernel_options(q: torch.Tensor) -> dict:
    from torch.nn.attention.flex_attention import _apply_kernel_options

    # TRITON fixes the lse convention (log2); FLASH, which AUTO may pick, returns natural logs.
    options = {"BACKEND": "TRITON"} if q.is_cuda else None
    return dict(_apply_kernel_options(q, q, q, True, options))  # type: ignore[arg-type]  # None is its default


def _forward_op(q, k, v, block_mask: tuple, scale: float, options: dict):
    from torch._higher_order_ops.flex_attention import flex_attention as flex_forward_op

    out, lse_log2, _ = flex_forward_op(q, k, v, _identity_score, block_mask, scale, options)
    return out, lse_log2


def _backward_op(grad_out, q, k, v, out, lse_log2, block_mask: tuple, scale: float, options):
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    # No joint graph: the operator derives it from the score function (the identity here).
    joint_graph: Any = None
    dq, dk, dv, _ = flex_attention_backward(
        q, k, v, out, lse_log2, grad_out, None, _identity_score, joint_graph, block_mask, scale,
        options, (), (),
    )  # fmt: skip
    return dq, dk, dv


@functools.cache
def _compiled(which: str) -> Callable:
    """The operator compiled (once per process; Inductor generates the fused kernel on CUDA)."""
    return torch.compile(_forward_op if which == "forward" else _backward_op, fullgraph=True)


def _op(which: str, device: torch.device) -> Callable:
    if device.type == "cuda":
        return _compiled(which)
    return _forward_op if which == "forward" else _backward_op


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k, v where ``block_mask`` allows: ``(out in q.dtype, lse)`` with lse
    in natural log, -inf (and out 0) on rows that see no key. One kernel call."""
    out, lse_log2 = _op("forward", q.device)(
        q, k, v, block_mask.as_tuple(), scale, _kernel_options(q)
    )
    return out, lse_log2 * _LN2


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_mask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the final ``out`` and natural-log ``lse`` of its rows
    (dk, dv with k's Hkv heads). One kernel call."""
    lse_log2 = (lse / _LN2).to(torch.promote_types(q.dtype, torch.float32))
    return _op("backward", q.device)(
        grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse_log2, block_mask.as_tuple(), scale,
        _kernel_options(q),
    )  # fmt: skip


def _row_documents(bounds: tuple[int, ...], positions: Sequence[int]) -> list[int]:
    return [bisect.bisect_right(bounds, p) - 1 for p in positions]


def _positions(runs) -> list[int]:
    return [start + i for _, start, length in runs for i in range(length)]


def document_block_mask(
    q_positions: torch.Tensor,
    q_documents: torch.Tensor,
    kv_positions: torch.Tensor,
    kv_documents: torch.Tensor,
    window: int | None = None,
):
    """The block mask of queries at global ``q_positions`` (B, Sq) in ``q_documents`` over keys
    at ``kv_positions`` (B, Sk) in ``kv_documents``: same document, key not after the query,
    and with a ``window`` (a local layer's) less than window positions before it. A batch of
    one broadcasts over any batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_index, kv_index):
        same = q_documents[b, q_index] == kv_documents[b, kv_index]
        distance = q_positions[b, q_index] - kv_positions[b, kv_index]
        if window is None:
            return same & (distance >= 0)
        return same & (distance >= 0) & (distance < window)

    batch, q_len = q_positions.shape
    device = q_positions.device
    return create_block_mask(
        visible,
        batch,
        None,
        q_len,
        kv_positions.size(1),
        device=device,
        BLOCK_SIZE=BLOCK_TOKENS,
        _compile=device.type == "cuda",
    )


class HopMasks:
    """The block masks of a ring's hops for one packed batch, built on first use and kept for
    the step's other layers and its backward (keyed by the batch's documents, the ring's
    shards, the two ranks and the query rows). Holds the last ``capacity`` masks."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._masks: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.built = 0
        """How many masks were built (the rest were reused)."""

    def get(
        self,
        documents: CuSeqlens,
        shards: RingShards | None,
        rank: int,
        src: int,
        rows: Rows,
        device: torch.device,
    ):
        """The mask of ring rank ``rank``'s query rows ``rows`` over ring rank ``src``'s K/V
        (``shards`` None: the whole sequence in order, as Ulysses and CP 1 hold it)."""
        key = (documents, shards, rank, src, rows, str(device))
        mask = self._masks.get(key)
        if mask is None:
            mask = self._build(documents, shards, rank, src, rows, device)
            self.built += 1
            self._masks[key] = mask
            if len(self._masks) > self.capacity:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return mask

    @staticmethod
    def _build(documents, shards, rank, src, rows, device):
        q_pos, kv_pos, q_doc, kv_doc = [], [], [], []
        for bounds in documents:
            if shards is None:
                q_all = kv_all = list(range(bounds[-1]))
            else:
                q_all = _positions(shards.runs(bounds, rank))
                kv_all = q_all if src == rank else _positions(shards.runs(bounds, src))
            q_rows = q_all[rows[0] : rows[1]]
            q_pos.append(q_rows)
            kv_pos.append(kv_all)
            q_doc.append(_row_documents(bounds, q_rows))
            kv_doc.append(_row_documents(bounds, kv_all))
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return document_block_mask(
            as_tensor(q_pos), as_tensor(q_doc), as_tensor(kv_pos), as_tensor(kv_doc)
        )


MASKS = HopMasks()
"""The process's block masks (every attention layer of a rank shares them)."""
