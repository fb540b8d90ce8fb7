"""Reading a checkpoint never runs code from it.

A checkpoint is data, but two of the formats ctxlaunch reads hold pickles, and a pickle can
name any callable for the reader to call (`os.system` with a command is the classic):

- torch.distributed.checkpoint's `.metadata` is a plain pickle of its `Metadata` dataclasses,
  which torch reads with `pickle.load`; its non-tensor entries (the LR schedule's state) are
  read with `torch.load(weights_only=False)`;
- DeepSpeed's `*_model_states.pt` and `*_optim_states.pt` are `torch.save` files that DeepSpeed
  (its engine and `zero_to_fp32`) reads with `torch.load(weights_only=False)`.

Here each is read through an allow-list instead: the metadata with an unpickler that builds
only DCP's own metadata classes, `torch.Size`, torch's dtypes and layouts and a few plain
containers; every `torch.load` with `weights_only=True` (torch's restricted unpickler) with
the handful of DeepSpeed classes its files hold registered beside torch's own. A file that needs
anything else is refused with `CheckpointRefused`, naming the file and the callable it asked
for; nothing of it has run by then. The tensors' bytes were already read with
`weights_only=True` by torch.

What is trusted, then: the checkpoint's numbers (a tampered one trains or exports wrong
weights, as any data can be wrong), never its code.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class CheckpointRefused(ValueError):
    """A checkpoint file asks for a callable outside the allow-list: it is not loaded."""


class CheckpointDamaged(ValueError):
    """A checkpoint cannot be read as written: a file is missing, cut short or changed."""


class CheckpointOfAnotherModel(CheckpointDamaged):
    """A checkpoint that is intact but holds another model's tensors (a name missing, a shape
    that differs): bad input, not damage."""


METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        # StorageMeta.checkpoint_id: the path the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)
"""What a torch.distributed.checkpoint `.metadata` pickle may name: the metadata dataclasses
(whose construction and `__setstate__` only assign fields), torch.Size, dtypes and layouts
(looked up by name), plain containers and the checkpoint's own path."""

DEEPSPEED_GLOBALS: tuple[tuple[str, str], ...] = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)
"""The classes DeepSpeed's checkpoint files hold beyond tensors and containers (the loss
scaler's state, the ZeRO stage, a fragment's address): registered with torch's weights-only
loading while DeepSpeed reads its files. Instances only get their fields assigned."""


def _refusal(path: object, wanted: str) -> CheckpointRefused:
    return CheckpointRefused(
        f"{path}: refused: loading it would call {wanted}, which a checkpoint never needs "
        "(ctxlaunch builds only tensors, torch's and the checkpoint formats' own metadata "
        "classes from a checkpoint); the file is damaged or was made to run code, so it is "
        "not read"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler, with every global looked up in METADATA_GLOBALS (the documented way
    to restrict unpickling: `find_class` is the one door to a callable)."""

    def __init__(self, stream: IO[bytes] | io.IOBase, where: str | os.PathLike[str]):
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise _refusal(self.where, f"{module}.{name}")


def load_metadata(stream: IO[bytes] | io.IOBase, where: str | os.PathLike[str]) -> Metadata:
    """A DCP `.metadata` pickle read through the allow-list; CheckpointRefused for a global
    outside it, ValueError naming the file for anything that is not DCP metadata."""
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except CheckpointRefused:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{where}: not a torch.distributed.checkpoint metadata file ({exc or 'truncated'})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"{where}: not a torch.distributed.checkpoint metadata file (it holds a "
            f"{type(metadata).__name__})"
        )
    return metadata


def read_metadata_file(path: str | Path) -> Metadata:
    """`load_metadata` of a file."""
    with open(path, "rb") as stream:
        return load_metadata(stream, path)


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, reading `.metadata` through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None  # set just above
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner, reading non-tensor entries with weights-only loading."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = weights_only_load(value, where=f"entry {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


_UNSUPPORTED = re.compile(r"GLOBAL (\S+)|reduce for (\S+)|global (\S+)")


def weights_only_load(
    source: Any, where: str | Path | None = None, *, _import_deepspeed: bool = False, **kwargs: Any
) -> Any:
    """`torch.load(source, weights_only=True, ...)` with DeepSpeed's checkpoint classes
    allowed; a file that needs any other callable is CheckpointRefused, naming it.

    DeepSpeed's classes are allowed from its modules already imported; a file that names one
    of them before DeepSpeed is imported is read again with them imported (importing DeepSpeed
    costs seconds of CPU that a run which never touches it should not pay)."""
    allowed = [
        _deepspeed_class(module, name, _import_deepspeed) for module, name in DEEPSPEED_GLOBALS
    ]
    kwargs.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals([cls for cls in allowed if cls is not None]):
            return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED.search(str(exc))
        if found is None:  # not a refusal: the bytes are not a pickle torch can read
            lines = str(exc).strip().splitlines()
            raise CheckpointDamaged(
                f"{where or source}: not a readable torch file ({lines[0] if lines else exc!r})"
            ) from None
        wanted = next(group for group in found.groups() if group).rstrip(".,:")
        if not _import_deepspeed and wanted in _DEEPSPEED_NAMES:
            if hasattr(source, "seek"):
                source.seek(0)
            return weights_only_load(source, where, _import_deepspeed=True, **kwargs)
        raise _refusal(where or source, wanted) from None
    except (RuntimeError, EOFError) as exc:  # a zip archive cut short or overwritten
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointDamaged(
            f"{where or source}: cannot be read, the file is damaged ({first.split('. ')[0]})"
        ) from None


_DEEPSPEED_NAMES = frozenset(f"{module}.{name}" for module, name in DEEPSPEED_GLOBALS)


def _deepspeed_class(module: str, name: str, import_it: bool) -> Any:
    """One of DEEPSPEED_GLOBALS: None where DeepSpeed is not installed (a DCP-only run), or
    where its module is not imported yet and `import_it` is false."""
    import importlib

    if not import_it and module not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


class _WeightsOnlyTorch:
    """The `torch` a DeepSpeed module sees while it reads a checkpoint: torch itself, except
    that `load` is `weights_only_load`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(source: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs.setdefault("map_location", args[0])
        return weights_only_load(
            source, where=source if isinstance(source, str) else None, **kwargs
        )


DEEPSPEED_READERS = (
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
)
"""The DeepSpeed modules that `torch.load` checkpoint files (with weights_only=False)."""


@contextlib.contextmanager
def deepspeed_reads_weights_only(step: Path) -> Iterator[None]:
    """While inside, the DeepSpeed modules that read checkpoint files load them with
    `weights_only_load` (their module-level `torch` is swapped for one whose `load` is it),
    and a failure to read the checkpoint at `step` is one sentence naming it
    (CheckpointDamaged) instead of DeepSpeed's own error."""
    import importlib

    modules = [importlib.import_module(name) for name in DEEPSPEED_READERS]
    # A module's own globals: `module.torch` is torch, imported at its top.
    saved = [vars(module)["torch"] for module in modules]
    try:
        for module in modules:
            vars(module)["torch"] = _WeightsOnlyTorch()
        yield
    except (CheckpointRefused, CheckpointDamaged):
        raise
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, AssertionError) as exc:
        raise load_failure(exc, step) from None
    finally:
        for module, original in zip(modules, saved, strict=True):
            vars(module)["torch"] = original


def load_failure(exc: BaseException, step: Path) -> CheckpointDamaged:
    """A one-sentence CheckpointDamaged for a failure inside torch.distributed.checkpoint's or
    DeepSpeed's reading of `step` (their own errors name no file, or bury it in a traceback)."""
    cause = _innermost(exc)
    text = str(cause).strip().splitlines()
    detail = text[-1] if text else type(cause).__name__
    if isinstance(cause, EOFError):
        detail = "a file ends early (EOFError)"
    if "size mismatch" in detail or "mismatch sizes" in detail or "shape" in detail:
        return CheckpointOfAnotherModel(
            f"{step} does not hold this model's weights ({detail}): it was saved by a "
            "different model or layout"
        )
    return CheckpointDamaged(f"{step} cannot be read: {type(cause).__name__}: {detail}")


def _innermost(exc: BaseException) -> BaseException:
    """The first rank's own exception inside torch's CheckpointException (else `exc`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return exc
