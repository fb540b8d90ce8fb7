"""Counting what a schedule would launch on a GPU, from the aten calls it makes (on ``meta`` or
CPU tensors): the counting `benchmarks/ring_counts.py` reports and the tests assert on.

A TorchDispatchMode sees each aten op: views and bare allocations launch nothing; every other
op is one launch, whose bytes are its tensor inputs read plus its outputs written (an in-place
op reads and writes its target; ``copy_`` reads the source and writes the target; fills only
write). An op whose name holds "attention" is an attention kernel call: the dense kernels
(``_scaled_dot_product_flash_attention``...) and FlexAttention's operators, which reach the
mode whole (``supports_higher_order_operators``: one call each, however their CPU reference
computes it)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
FILLS = ("zero_", "fill_", "zeros", "zeros_like", "full", "full_like", "scalar_tensor")


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_name(func) -> str:
    """An aten op's name (``_scaled_dot_product_flash_attention``), or a higher-order
    operator's (``flex_attention``, ``flex_attention_backward``)."""
    packet = getattr(func, "overloadpacket", None)
    return packet.__name__ if packet is not None else func.name()


class Counter(TorchDispatchMode):
    """Launches and bytes per category: ``attention`` (attention kernel calls), ``merge`` (ops
    while ``section`` says so), ``other``; ``attention_calls`` lists each attention call's name
    in order."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.section = "other"
        self.counts: dict[str, dict[str, int]] = {}
        self.attention_calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = op_name(func)
        view = getattr(func, "is_view", False)
        if view or name in ALLOCATIONS or name in ("detach", "alias", "lift_fresh"):
            return result
        if "attention" in name:
            section = "attention"
            self.attention_calls.append(name)
        else:
            section = self.section
        ins, outs = _tensors((args, kwargs)), _tensors(result)
        if name == "copy_":
            moved = nbytes(args[1]) + nbytes(args[0])
        elif name in FILLS:
            moved = sum(nbytes(t) for t in outs)
        else:
            moved = sum(nbytes(t) for t in ins) + sum(nbytes(t) for t in outs)
        entry = self.counts.setdefault(section, {"launches": 0, "bytes": 0})
        entry["launches"] += 1
        entry["bytes"] += moved
        return result
