"""Count what autograd keeps for backward: the activation memory the planner predicts.

    with SavedTensorMeter(exclude=model.parameters()) as meter:
        loss = model(...)
    meter.bytes   # unique storages saved for backward, parameters excluded

Tensors that share a storage (views, chunks) count once, as they do in memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorMeter:
    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and storage.nbytes() > 0:
            self._storages[key] = storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())
