"""The weights of `model.init_from`, checked against the model by their safetensors headers at
validation time, before any rank starts.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (each tensor's
dtype, shape and `data_offsets` [begin, end) into the data that follows; an optional
`__metadata__`), then the data. Only the header is read here, never the data, so checking a
70B checkpoint costs a few hundred kilobytes of reading. A sharded checkpoint's
`model.safetensors.index.json` maps each tensor to its shard.

Refused, each in one sentence naming the file and the tensor: a file that is empty, truncated,
not a regular file, or whose header is not a safetensors header; an index that is not JSON,
names a shard outside the directory or one that is missing; a tensor the model needs that is
absent (or absent from the shard its index names); a shape other than the model's; a dtype
that holds no weights (integers, booleans); data offsets outside the file or disagreeing with
the shape and dtype. Tensors the model does not read (a saved `rotary_emb.inv_freq`, a tied
`lm_head`) are not checked.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import MAX_CONFIG_BYTES, BoundedReadError, read_bounded_json
from ctxlaunch.contract.families.family import BlockShape, Family

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors library itself accepts (its MAX_HEADER_SIZE): a longer
claimed length is a damaged or hostile file, refused before any of it is read."""

DTYPE_BYTES: dict[str, float] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
"""Every dtype the safetensors format names, with its size in bytes."""

WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")
"""The dtypes the trainer loads weights from (it converts each to the training precision)."""


class HFWeightsError(ValueError):
    """A checkpoint's weights that do not match the model; the message is one sentence naming
    the file and the tensor."""


def has_weights(directory: str | Path) -> bool:
    """Whether `directory` holds model.safetensors or model.safetensors.index.json (a directory
    with config.json alone plans and renders; the trainer refuses it, naming both files)."""
    return any(os.path.lexists(Path(directory) / name) for name in (SINGLE_FILE, INDEX_FILE))


def check_weights(directory: str | Path, model: BlockShape, family: Family) -> None:
    """Every tensor the model reads is in `directory`'s safetensors files with the model's shape,
    a weight dtype and its data inside its file; an HFWeightsError (one sentence naming the file
    and the tensor) otherwise. Reads the headers alone."""
    directory = Path(directory)
    files, listing = _tensor_files(directory)
    for canonical, want in family.hf_tensors(model).items():
        # A wrapper's checkpoint (a multimodal class) keeps the decoder under its own prefix.
        name = family.stored_name(canonical, files)
        file = files.get(name)
        if file is None:
            raise HFWeightsError(f"{listing}: no tensor {name}, which the model needs")
        path = directory / file
        entry = read_header(path).get(name)
        if entry is None:
            raise HFWeightsError(
                f"{path}: no tensor {name}, which {directory / INDEX_FILE} says this shard holds"
            )
        dtype, got = entry
        if got != want:
            raise HFWeightsError(
                f"{path}: tensor {name} has shape {list(got)}, the model (config.json) needs "
                f"{list(want)}"
            )
        if dtype not in WEIGHT_DTYPES:
            raise HFWeightsError(
                f"{path}: tensor {name} is {dtype}, not a floating-point dtype weights are read "
                f"from ({', '.join(WEIGHT_DTYPES)})"
            )


def _tensor_files(directory: Path) -> tuple[dict[str, str], Path]:
    """Tensor name -> the file (relative to `directory`) that holds it, and the file that lists
    them (model.safetensors itself, or the index of a sharded checkpoint)."""
    single = directory / SINGLE_FILE
    if os.path.lexists(single):
        return dict.fromkeys(read_header(single), SINGLE_FILE), single
    index = directory / INDEX_FILE
    try:
        data = read_bounded_json(index, MAX_CONFIG_BYTES * 8, INDEX_FILE)
    except BoundedReadError as exc:
        raise HFWeightsError(str(exc)) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(value, str) for value in weight_map.values()
    ):
        raise HFWeightsError(
            f"{index}: no weight_map object of tensor name -> shard file, as transformers writes"
        )
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in (".", ".."):
            raise HFWeightsError(
                f"{index}: shard {shard!r} is not a file name in the checkpoint's directory"
            )
        if not os.path.lexists(directory / shard):
            raise HFWeightsError(f"{index}: shard {shard} is missing from {directory}")
    return {str(name): shard for name, shard in weight_map.items()}, index


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from the safetensors header of `path`, each entry checked
    (a known dtype, a shape of non-negative integers, data offsets inside the file that hold
    exactly the shape's bytes); an HFWeightsError naming the file (and tensor) otherwise."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise HFWeightsError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise HFWeightsError(f"{path}: not a regular file; a weights file is a safetensors file")
    return _cached_header(str(path), info.st_size, info.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _cached_header(path: str, size: int, mtime_ns: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """read_header's work, once per file version (a sweep validates the same spec many times)."""
    if size < 8:
        raise HFWeightsError(
            f"{path}: {size} bytes, too short for a safetensors file (empty or truncated)"
        )
    try:
        with open(path, "rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise HFWeightsError(
                    f"{path}: not a safetensors file, or truncated: its first bytes announce a "
                    f"header of {length:,} bytes in a file of {size:,}"
                )
            raw = stream.read(length)
    except OSError as exc:
        raise HFWeightsError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise HFWeightsError(f"{path}: its header is not the JSON object of a safetensors file")
    data_bytes = size - 8 - length
    return {
        str(name): _entry(path, str(name), entry, data_bytes)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _entry(path: str, name: str, entry: Any, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    """One header entry as (dtype, shape), checked against the data that follows the header."""
    if not isinstance(entry, dict):
        raise HFWeightsError(f"{path}: tensor {name}'s header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise HFWeightsError(f"{path}: tensor {name} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise HFWeightsError(f"{path}: tensor {name} has no shape of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
    ):
        raise HFWeightsError(f"{path}: tensor {name} has no data_offsets [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise HFWeightsError(
            f"{path}: tensor {name}'s data, bytes [{begin:,}, {end:,}) after the header, lies "
            f"outside the file's {data_bytes:,} bytes of data (truncated or damaged)"
        )
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != needed:
        raise HFWeightsError(
            f"{path}: tensor {name} is {dtype} of shape {shape}, {needed:,g} bytes, but its "
            f"data_offsets hold {end - begin:,}"
        )
    return dtype, tuple(shape)
