"""Hugging Face checkpoints in and out: reading one rank's slice of each weight lazily from
safetensors, and writing a trained checkpoint back as a Hugging Face directory of the family's
own class. The names on both sides, and the config keys a family writes, are the family's
(`ctxlaunch.contract.families`).

Reading: each rank asks safetensors for the rows (and, for wo and w_down, the columns) of its
TP slice of each part, and under FSDP2 only the DP x CP row chunk it keeps (`local_rows`), so
no rank reads or holds more than its share. Writing: the whole model in one process, fp32 (or
the dtype asked for), in shards with model.safetensors.index.json, written to a temporary
directory that is renamed into place only when complete.

A family whose checkpoints stack a layer's experts (`StackedExperts`) keeps each expert matrix
as (input, output) with gate and up interleaved along the output; `from_stacked` and
`to_stacked` turn that layout into ctxlaunch's (output, input), gate rows then up rows, and
back, exactly (a transpose and a permutation).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ctxlaunch.contract.families import FAMILIES, Family
from ctxlaunch.contract.families.experts import (
    EXPERTS_DOWN,
    EXPERTS_GATE_UP,
    EXPERTS_GATE_UP_BIAS,
    is_expert_parameter,
)
from ctxlaunch.contract.families.family import parameter_shapes
from ctxlaunch.contract.families.hfconfig import CONFIG_FILE, read_config
from ctxlaunch.contract.fsutil import missing_directories
from ctxlaunch.contract.spec import DefaultRope, ModelSpec, YarnRope
from ctxlaunch.runtime.modeling.weight_sharding import Sharding
from ctxlaunch.runtime.progress import Progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
"""Copied from the init_from directory into an export, when there."""


class HFCheckpointError(RuntimeError):
    """A Hugging Face checkpoint cannot be read, or an export cannot be written."""


def hf_names(name: str, model: ModelSpec) -> tuple[str, ...]:
    """The Hugging Face tensors that make up ctxlaunch parameter `name` of `model`'s family."""
    return FAMILIES[model.family].hf_names(name)


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory, read a slice at a time."""

    def __init__(self, directory: str | Path, family: Family | None = None):
        self.directory = Path(directory)
        self.family = family
        """Whose names to look for under a wrapper's prefix (`Family.stored_name`)."""
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        from safetensors import safe_open

        if single.is_file():
            with safe_open(str(single), framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), SINGLE_FILE)
        elif index.is_file():
            try:
                self.files = dict(json.loads(index.read_text())["weight_map"])
            except (OSError, ValueError, KeyError) as exc:
                raise HFCheckpointError(f"cannot read {index}: {exc}") from None
        else:
            raise HFCheckpointError(
                f"model.init_from: {self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}"
            )
        self._handles: dict[str, Any] = {}

    def _slice(self, hf_name: str) -> Any:
        if self.family is not None:
            hf_name = self.family.stored_name(hf_name, self.files)
        if hf_name not in self.files:
            raise HFCheckpointError(f"{self.directory} has no tensor {hf_name!r}")
        file = self.files[hf_name]
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self._handles[file].get_slice(hf_name)

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return tuple(self._slice(hf_name).get_shape())

    def read(
        self, hf_name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows [start, stop) (and columns, if given) of one tensor, read from disk alone."""
        piece = self._slice(hf_name)
        if cols is None:
            return piece[rows[0] : rows[1]]
        return piece[rows[0] : rows[1], cols[0] : cols[1]]

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's tensors (of its embedding)."""
        return self.read("model.embed_tokens.weight", (0, 1)).dtype

    def close(self) -> None:
        self._handles.clear()


def check_shapes(
    checkpoint: SafetensorsCheckpoint, shapes: dict[str, torch.Size], model: ModelSpec
) -> None:
    """Every parameter's parts are in the checkpoint with the shapes the spec implies."""
    family = FAMILIES[model.family]
    for name, shape in shapes.items():
        for hf_name, want in family.hf_parts(name, tuple(shape), model):
            got = checkpoint.shape(hf_name)
            if got != want:
                raise HFCheckpointError(
                    f"{checkpoint.directory}: {hf_name} has shape "
                    f"{list(got)}, the model needs {list(want)}"
                )


def read_local(
    checkpoint: SafetensorsCheckpoint,
    model: ModelSpec,
    name: str,
    full_shape: torch.Size,
    sharding: Sharding | None,
    tp: int,
    tp_rank: int,
    rows: tuple[int, int],
    experts: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Rows [start, stop) of this TP rank's slice of parameter `name` (the rows it keeps
    under FSDP2), read from the checkpoint without reading the rest; of an expert parameter,
    experts [first + start, first + stop) of the `experts` (first, count) this rank holds."""
    if is_expert_parameter(name):
        first = experts[0] if experts is not None else 0
        return read_experts(checkpoint, model, name, full_shape, first + rows[0], first + rows[1])
    parts = hf_names(name, model)
    lo, hi = rows
    if sharding is None:
        if len(parts) == 1:
            return checkpoint.read(parts[0], (lo, hi))
        # A fused weight TP does not split (a shared expert's gate and up): its parts whole.
        sizes = [s[0] for _, s in FAMILIES[model.family].hf_parts(name, tuple(full_shape), model)]
        sharding, tp, tp_rank = Sharding(0, tuple(sizes)), 1, 0
    if sharding.dim == 1:
        width = full_shape[1] // tp
        return checkpoint.read(parts[0], (lo, hi), (tp_rank * width, (tp_rank + 1) * width))
    pieces, offset = [], 0
    for hf_name, size in zip(parts, sharding.parts, strict=True):
        local = size // tp  # this part's rows in the TP slice: [offset, offset + local)
        start, stop = max(lo, offset), min(hi, offset + local)
        if start < stop:
            base = tp_rank * local - offset
            pieces.append(checkpoint.read(hf_name, (base + start, base + stop)))
        offset += local
    if not pieces:
        return torch.empty((0, *full_shape[1:]))
    return torch.cat(pieces, dim=0)


def read_experts(
    checkpoint: SafetensorsCheckpoint,
    model: ModelSpec,
    name: str,
    full_shape: torch.Size,
    start: int,
    stop: int,
) -> torch.Tensor:
    """Experts [start, stop) of expert parameter `name` (whole shape `full_shape`: E first),
    each stacked from its Hugging Face parts (gate and up; down)."""
    family = FAMILIES[model.family]
    parts = family.hf_parts(name, tuple(full_shape), model)
    if start >= stop:
        return torch.empty((0, *full_shape[1:]))
    if family.experts is not None and family.experts.stacked is not None:
        (hf_name, _), leaf = parts[0], name.split(".", 2)[-1]
        return from_stacked(leaf, checkpoint.read(hf_name, (start, stop)))
    per_expert = len(parts) // full_shape[0]
    return torch.stack(
        [
            torch.cat(
                [
                    checkpoint.read(hf_name, (0, shape[0]))
                    for hf_name, shape in parts[j * per_expert : (j + 1) * per_expert]
                ]
            )
            for j in range(start, stop)
        ]
    )


def from_stacked(leaf: str, tensor: torch.Tensor) -> torch.Tensor:
    """A stacked checkpoint's experts tensor (E, ...) in ctxlaunch's layout: matrices
    transposed to (output, input), the interleaved gate/up columns as gate rows then up
    rows."""
    if leaf in (EXPERTS_GATE_UP, EXPERTS_DOWN):
        tensor = tensor.transpose(1, 2)
    if leaf in (EXPERTS_GATE_UP, EXPERTS_GATE_UP_BIAS):
        tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    return tensor.contiguous()


def to_stacked(leaf: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of `from_stacked`: ctxlaunch's experts tensor in the stacked layout."""
    if leaf in (EXPERTS_GATE_UP, EXPERTS_GATE_UP_BIAS):
        gate, up = tensor.chunk(2, dim=1)
        tensor = torch.stack([gate, up], dim=2).flatten(1, 2)
    if leaf in (EXPERTS_GATE_UP, EXPERTS_DOWN):
        tensor = tensor.transpose(1, 2)
    return tensor.contiguous()


# -- export ------------------------------------------------------------------------------------
def to_hf(state: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """ctxlaunch's whole-model state (name -> tensor) as Hugging Face tensors."""
    family = FAMILIES[model.family]
    stacked = family.experts is not None and family.experts.stacked is not None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        parts = family.hf_parts(name, tuple(tensor.shape), model)
        if stacked and is_expert_parameter(name):
            out[parts[0][0]] = to_stacked(name.split(".", 2)[-1], tensor)
            continue
        flat = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() == 3 else tensor
        pieces = flat.split([shape[0] for _, shape in parts], dim=0) if len(parts) > 1 else (flat,)
        for (hf_name, _), piece in zip(parts, pieces, strict=True):
            out[hf_name] = piece.contiguous()
    return out


def hf_config(
    model: ModelSpec,
    *,
    dtype: torch.dtype,
    max_positions: int | None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json of the family's causal LM with the spec's shape and RoPE (rope_theta and
    rope_scaling, the spelling transformers 4.x and 5.x both read). Keys of `base` (the
    init_from config: token ids and the like) are kept unless the model decides them."""
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "dtype")}
    scaling = model.rope_scaling
    rope: dict[str, Any] | None = None
    if not isinstance(scaling, DefaultRope):
        rope = scaling.model_dump(exclude_none=True)
        rope["rope_type"] = rope.pop("type")
    positions = max(
        filter(None, (config.get("max_position_embeddings"), max_positions)), default=None
    )
    family = FAMILIES[model.family]
    config.update(
        {
            "architectures": [family.architecture],
            "model_type": family.model_type,
            "vocab_size": model.vocab,
            "hidden_size": model.hidden,
            "intermediate_size": model.ffn_hidden,
            "num_hidden_layers": model.layers,
            "num_attention_heads": model.heads,
            "num_key_value_heads": model.kv_heads,
            "head_dim": model.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta,
            "rope_scaling": rope,
            "tie_word_embeddings": model.tie_embeddings,
            "torch_dtype": str(dtype).removeprefix("torch."),
            **family.export_keys(model, config),
        }
    )
    if isinstance(scaling, YarnRope):
        # transformers checks YaRN's factor against max_position_embeddings / the original
        # length: the stretched context is the model's maximum.
        positions = round(scaling.original_max_position_embeddings * scaling.factor)
    if positions is not None:
        config["max_position_embeddings"] = positions
    return dict(sorted(config.items()))


def _shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_hf(
    out: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    shard_bytes: int,
    tokenizer_from: Path | None = None,
    tokenizer_file: tuple[Path, str] | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Write a Hugging Face directory at `out` (which must not exist): config.json, the
    safetensors shards and their index, the tokenizer files of `tokenizer_from` and
    `tokenizer_file` (a file and the name it takes in `out`). Written
    in a temporary directory beside `out` and renamed into place, so `out` is never half
    written. `progress` is advanced by each shard's tensors as the shard is written. Returns
    the files written."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise HFCheckpointError(f"{out} already exists; export writes a new directory")
    # The directories made for `out` go again with the temporary one when the export fails
    # (an empty tree left behind would be a half-written output).
    made = missing_directories(out.parent)
    try:
        for directory in made:
            directory.mkdir()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except BaseException:
        _remove_empty(made)
        raise
    try:
        shards = _shards(tensors, shard_bytes)
        weight_map: dict[str, str] = {}
        total = 0
        for number, shard in enumerate(shards, 1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            try:
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
            except SafetensorError as exc:
                # safetensors reports a failed write (a full disk) in its own error type: it is
                # the output's fault, not the checkpoint's.
                raise OSError(f"{out}: writing {file} failed ({exc})") from None
            for name, tensor in shard.items():
                weight_map[name] = file
                total += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress.advance(len(shard), note=file)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_from / name).is_file():
                    shutil.copy2(tokenizer_from / name, tmp / name)
        if tokenizer_file is not None:
            shutil.copy2(tokenizer_file[0], tmp / tokenizer_file[1])
        written = sorted(p.name for p in tmp.iterdir())
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise
    return written


def _remove_empty(directories: list[Path]) -> None:
    """Remove `directories` (outermost first), innermost first, each only while still empty:
    another writer may have put its output there meanwhile."""
    for directory in reversed(directories):
        with contextlib.suppress(OSError):
            directory.rmdir()


# -- reading a training checkpoint -------------------------------------------------------------
def _whole_name(key: str) -> tuple[str, int]:
    name, _, part = key.removeprefix("model/").partition("#")
    return name, int(part) if part else 0


def _dim_of(name: str) -> int:
    return 1 if name.endswith(("wo.weight", "w_down.weight")) else 0


def check_declared_shapes(
    path: Path, declared: dict[str, Any], expected: dict[str, tuple[int, ...]]
) -> None:
    """HFCheckpointError unless every tensor the checkpoint's metadata declares (`model/NAME`
    or its parts `model/NAME#i`) is one of the model's, with sizes that are not negative and
    parts that add up to no more than the model's tensor: checked before anything of the
    declared size is allocated (a metadata claiming 2^60 elements would otherwise be)."""
    counts: dict[str, int] = {}
    for key, meta in declared.items():
        name, _ = _whole_name(key)
        size = [int(dim) for dim in meta.size]
        if name not in expected:
            raise HFCheckpointError(
                f"{path}: the checkpoint declares {key}, which this model does not have"
            )
        if any(dim < 0 for dim in size):
            raise HFCheckpointError(
                f"{path}: the checkpoint declares {key} of shape {size}: a size is negative"
            )
        counts[name] = counts.get(name, 0) + math.prod(size)
        if counts[name] > math.prod(expected[name]):
            raise HFCheckpointError(
                f"{path}: the checkpoint declares {key} of shape {size}, more than this model's "
                f"{name} holds ({list(expected[name])}): it was saved by a different model, or "
                "its metadata is damaged"
            )


def read_dcp_weights(
    path: Path, expected: dict[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's weights of a torch.distributed.checkpoint checkpoint (reshard.py's
    `model/<name>[#part]` keys), read in this one process, no process group; with `expected`
    (the model's shapes), the declared shapes are checked against it first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ctxlaunch.runtime.checkpointing.checkpoint_integrity import check_dcp_files, load_failure
    from ctxlaunch.runtime.checkpointing.safe_unpickle import SafeFileSystemReader, SafeLoadPlanner

    metadata = check_dcp_files(path)
    reader = SafeFileSystemReader(str(path))
    declared = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)
    }
    if expected is not None:
        check_declared_shapes(path, declared, expected)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in declared.items()
    }
    if not state:
        raise HFCheckpointError(f"{path}: no model weights in this checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException
            raise load_failure(exc, path) from None
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        name, index = _whole_name(key)
        parts.setdefault(name, {})[index] = tensor
    return {
        name: torch.cat([by_index[i] for i in sorted(by_index)], dim=_dim_of(name))
        for name, by_index in sorted(parts.items())
    }


def read_deepspeed_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights of a DeepSpeed checkpoint (zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ctxlaunch.runtime.checkpointing.safe_unpickle import (
        deepspeed_reads_weights_only,
        weights_only_load,
    )

    for states in path.glob("*model_states.pt"):
        # DeepSpeed writes "num_experts" only where its engine knew the model had experts:
        # ctxlaunch's expert parallelism, each rank's experts in its own partition files.
        if "num_experts" in weights_only_load(states, map_location="cpu", mmap=True):
            raise HFCheckpointError(
                f"{path} was saved by DeepSpeed with expert parallelism (each rank's experts "
                "in its own partition files), which zero_to_fp32 cannot merge; resume it at "
                "its layout, or train with training.engine fsdp2 to export"
            )
    with deepspeed_reads_weights_only(path):
        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    return {name.removeprefix("module."): tensor for name, tensor in state.items()}


def read_training_weights(
    path: Path, expected: dict[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """The weights of one checkpoint step directory, whichever engine wrote it (`expected`:
    the model's shapes, which a DCP checkpoint's declared shapes must fit before anything is
    allocated)."""
    if (path / ".metadata").is_file():
        return read_dcp_weights(path, expected)
    if any(path.glob("*model_states.pt")):
        return read_deepspeed_weights(path)
    raise HFCheckpointError(
        f"{path} is not a ctxlaunch checkpoint (no torch.distributed."
        "checkpoint .metadata, no DeepSpeed *model_states.pt)"
    )


def export_dtype(name: str, model: ModelSpec, saved: torch.dtype) -> torch.dtype:
    """The dtype an export writes: `name` (fp32, bf16, fp16) or, for auto, the dtype of the
    init_from checkpoint when there is one (so import then export is bitwise identical, bf16
    in, bf16 out), else the saved weights' (fp32: ctxlaunch keeps fp32 master weights)."""
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name != "auto":
        return table[name]
    if model.init_from and Path(model.init_from, CONFIG_FILE).is_file():
        try:
            return SafetensorsCheckpoint(model.init_from, FAMILIES[model.family]).dtype()
        except HFCheckpointError:
            pass
    return saved


def init_from_config(model: ModelSpec) -> dict[str, Any] | None:
    """The init_from directory's config.json, if it is still there."""
    if model.init_from and Path(model.init_from, CONFIG_FILE).is_file():
        return read_config(model.init_from)
    return None


def resolve_step_dir(path: Path) -> Path:
    """A checkpoint step directory: `path` itself, or the newest committed step under it."""
    from ctxlaunch.runtime.checkpointing.checkpoint import MARKER, latest_step, step_dir

    if (path / MARKER).is_file():
        return path
    step = latest_step(path)
    if step is None:
        raise HFCheckpointError(
            f"{path} is neither a committed checkpoint (no {MARKER}) nor a "
            "checkpoint directory with one"
        )
    return step_dir(path, step)


def saved_info(step: Path) -> dict[str, Any]:
    """What the trainer recorded beside a checkpoint (its COMMITTED marker)."""
    from ctxlaunch.runtime.checkpointing.checkpoint import MARKER

    try:
        return dict(json.loads((step / MARKER).read_text()))
    except (OSError, ValueError) as exc:
        raise HFCheckpointError(f"cannot read {step / MARKER}: {exc}") from None


def export(
    checkpoint: Path,
    out: Path,
    *,
    model: ModelSpec | None = None,
    dtype: str = "auto",
    shard_bytes: int = 5 * 2**30,
    tokenizer: Path | None = None,
    show_progress: bool = False,
) -> tuple[Path, list[str]]:
    """Write the checkpoint (a step directory, or the newest under a checkpoint directory) as
    a Hugging Face directory of the model's family at `out`. The model section is `model`, else the one the
    trainer stored with the checkpoint. The tokenizer files are the init_from directory's, and
    `tokenizer` (a tokenizer.json, SentencePiece model or tiktoken file) when given.
    `show_progress` reports the tensors written on stderr (runtime/progress.py). Returns the
    step directory read and the files."""
    tokenizer_file, tokenizer_vocab = None, 0
    if tokenizer is not None:
        from ctxlaunch.runtime.data.tokenizers import load_tokenizer

        loaded = load_tokenizer(tokenizer)  # TokenizerError (a ValueError) names the problem
        tokenizer_vocab = loaded.vocab_size
        tokenizer_file = (
            loaded.path,
            "tokenizer.json" if loaded.kind == "huggingface" else "tokenizer.model",
        )
    step = resolve_step_dir(Path(checkpoint))
    info = saved_info(step)
    if model is None:
        if "model" not in info:
            raise HFCheckpointError(
                f"{step} does not record its model (written before ctxlaunch "
                "stored it); pass --spec with the spec it was trained with"
            )
        data = dict(info["model"])
        if data.get("init_from") and not Path(data["init_from"], CONFIG_FILE).is_file():
            # Moved or deleted since: the stored section is resolved, so it stands without it
            # (and there are no tokenizer files to copy).
            data["init_from"] = None
        model = ModelSpec.model_validate(data)
    if tokenizer_file is not None and tokenizer_vocab > model.vocab:
        raise HFCheckpointError(
            f"--tokenizer {tokenizer}: {tokenizer_vocab} ids, more than "
            f"the model's vocab {model.vocab}"
        )
    expected = parameter_shapes(model)
    weights = read_training_weights(step, expected)
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise HFCheckpointError(
            f"{step} does not hold the model described: missing "
            f"{missing[:5]}, unexpected {extra[:5]}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise HFCheckpointError(
                f"{step} does not hold the model described: {name} is "
                f"{list(weights[name].shape)}, the model needs {list(shape)}"
            )
    saved = next(iter(weights.values())).dtype
    target = export_dtype(dtype, model, saved)
    tensors = {k: v.to(target) for k, v in to_hf(weights, model).items()}
    base = init_from_config(model)
    config = hf_config(model, dtype=target, max_positions=info.get("seq_len"), base=base)
    tokenizer_dir = Path(model.init_from) if base is not None and model.init_from else None
    with (
        Progress("export: tensors written", total=len(tensors))
        if show_progress
        else contextlib.nullcontext()
    ) as progress:
        return step, write_hf(
            out,
            tensors,
            config,
            shard_bytes=shard_bytes,
            tokenizer_from=tokenizer_dir,
            tokenizer_file=tokenizer_file,
            progress=progress,
        )
