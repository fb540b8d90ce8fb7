"""Megatron's indexed dataset: token ids in `PREFIX.bin`, their index in `PREFIX.idx`.

The format is Megatron-core's (`megatron/core/datasets/indexed_dataset.py`), so files that
Megatron's `tools/preprocess_data.py` writes train here, and files written here train there.

`PREFIX.bin` is the token ids of every sequence, back to back, in one dtype. `PREFIX.idx` is,
all little-endian:

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code of the .bin (DTYPE_CODES)
    uint64    S, the number of sequences
    uint64    D + 1, the length of the document index
    int32[S]  each sequence's length in tokens
    int64[S]  each sequence's byte offset in the .bin
    int64[D+1] the document index: document d is sequences [index[d], index[d+1])
    int8[S]   (multimodal files only) each sequence's mode

Beside them `data prepare --chat` writes PREFIX.lossmask (not Megatron's): one byte per token of
the .bin, in its order, 1 where the token is a target the loss counts (an assistant's).

A Megatron "sequence" is a sentence when preprocess_data splits sentences; otherwise each
document is one sequence. Either way a document's tokens are contiguous in the .bin, and this
module deals in documents. Nothing here reads a whole file: both files are memory-mapped.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from array import array
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from ctxlaunch.contract.spec import indexed_files, indexed_prefix, loss_mask_file

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
"""magic, version, dtype code, sequence count, document-index length: 34 bytes."""

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron's DType enum: the .idx's code -> the .bin's numpy dtype."""

UINT16_VOCAB_LIMIT = 65500
"""Megatron stores ids as uint16 below this vocabulary size and int32 from it on
(DType.optimal_dtype); `token_dtype` follows the same rule so both write identical files."""


class IndexedDataError(ValueError):
    """A .bin/.idx pair that is missing, truncated or not in Megatron's format."""


def token_dtype(vocab_size: int) -> type[np.number]:
    """The .bin dtype for a vocabulary of `vocab_size` ids: uint16 when it fits, else int32."""
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def dtype_code(dtype: type[np.number]) -> int:
    """Megatron's code for a numpy dtype."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no Megatron code")


class IndexedDataset:
    """A read-only, memory-mapped Megatron indexed dataset, by document.

    `document(d)` is a view of document d's token ids; `document_starts` gives every document's
    first token as an offset into the whole token stream (length D + 1, the last entry the
    total), which is all packing needs to find document boundaries.
    """

    def __init__(self, path: str | Path):
        self.prefix = indexed_prefix(path)
        self.bin_path, self.idx_path = indexed_files(path)
        for needed in (self.idx_path, self.bin_path):
            if not needed.is_file():
                raise IndexedDataError(
                    f"{needed}: no such file (an indexed dataset is a "
                    f"{self.prefix.name}.bin and .idx pair)"
                )
        with open(self.idx_path, "rb") as stream:
            head = stream.read(HEADER.size)
        if len(head) < HEADER.size:
            raise IndexedDataError(
                f"{self.idx_path}: {len(head)} bytes, too short for the {HEADER.size}-byte header"
            )
        magic, version, code, sequences, index_length = HEADER.unpack(head)
        if magic != INDEX_MAGIC:
            raise IndexedDataError(f"{self.idx_path}: not a Megatron index (header {magic!r})")
        if version != INDEX_VERSION:
            raise IndexedDataError(f"{self.idx_path}: index version {version}, expected 1")
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{self.idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_count = int(sequences)
        idx_size = self.idx_path.stat().st_size
        arrays_end = HEADER.size + 12 * self.sequence_count + 8 * int(index_length)
        if index_length < 1 or idx_size < arrays_end:
            raise IndexedDataError(
                f"{self.idx_path}: {idx_size} bytes, but its header "
                f"promises {arrays_end} ({sequences} sequences, "
                f"{index_length} document-index entries)"
            )

        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sequence_lengths: npt.NDArray[np.int32] = np.frombuffer(
            index, dtype=np.int32, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers: npt.NDArray[np.int64] = np.frombuffer(
            index, dtype=np.int64, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices: npt.NDArray[np.int64] = np.frombuffer(
            index, dtype=np.int64, count=int(index_length), offset=offset
        )

        itemsize = self.dtype.itemsize
        bin_size = self.bin_path.stat().st_size
        total = int(self.sequence_lengths.sum(dtype=np.int64))
        if bin_size < total * itemsize:
            raise IndexedDataError(
                f"{self.bin_path}: {bin_size} bytes, but the index holds "
                f"{total} tokens of {itemsize} bytes"
            )
        # Token offset of each sequence's start, then the end: a document with no sequences
        # (Megatron writes one for an empty text) starts and ends where the next one starts.
        sequence_starts = np.empty(self.sequence_count + 1, dtype=np.int64)
        sequence_starts[:-1] = self.sequence_pointers // itemsize
        sequence_starts[-1] = (
            total
            if self.sequence_count == 0
            else sequence_starts[-2] + int(self.sequence_lengths[-1])
        )
        self.document_starts: npt.NDArray[np.int64] = sequence_starts[self.document_indices]
        self.tokens: npt.NDArray[np.generic] = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(total,))
            if total
            else np.zeros(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        """The number of documents."""
        return len(self.document_indices) - 1

    @property
    def token_count(self) -> int:
        """Tokens in the whole file."""
        return int(self.document_starts[-1])

    def document_lengths(self) -> npt.NDArray[np.int64]:
        """Each document's length in tokens."""
        return np.diff(self.document_starts)

    def document(self, index: int) -> npt.NDArray[np.generic]:
        """Document `index`'s token ids (a view of the mapped .bin)."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.prefix}: document {index} of {len(self)}")
        return self.tokens[self.document_starts[index] : self.document_starts[index + 1]]

    def loss_mask(self) -> npt.NDArray[np.uint8]:
        """PREFIX.lossmask, mapped: one byte per token of the .bin, 1 where the loss counts
        the token as a target."""
        path = loss_mask_file(self.prefix)
        if not path.is_file():
            raise IndexedDataError(
                f"{path}: no such file (training.data.loss_mask reads the mask "
                "`ctxlaunch data prepare --chat` writes beside PREFIX.bin)"
            )
        if path.stat().st_size != self.token_count:
            raise IndexedDataError(
                f"{path}: {path.stat().st_size} bytes for the {self.token_count} tokens of "
                f"{self.bin_path}: it was written for other data"
            )
        if not self.token_count:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(self.token_count,))


class IndexedWriter:
    """Writes a Megatron indexed dataset, one document (one sequence) at a time, whole or not at
    all: tokens go to temporary files beside the output, renamed to PREFIX.bin and PREFIX.idx
    only by `commit`; `abort` (or an exception inside `with`) removes them.
    """

    def __init__(self, path: str | Path, dtype: type[np.number], *, loss_mask: bool = False):
        self.prefix = indexed_prefix(path)
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(dtype)
        # The directories made for the output, innermost last: `abort` removes them again, so a
        # run that writes nothing leaves no empty directories behind.
        self._made_dirs = [
            parent for parent in reversed(self.prefix.parents) if not parent.exists()
        ]
        self._tmp: dict[str, Path] = {}
        self._lengths = array("q")
        self._open_length = 0
        """Tokens written of a document not yet ended (add_document's `ends`)."""
        try:
            self.prefix.parent.mkdir(parents=True, exist_ok=True)
            for suffix in (".bin", ".idx") + ((".lossmask",) if loss_mask else ()):
                fd, name = tempfile.mkstemp(
                    dir=self.prefix.parent, prefix=f".{self.prefix.name}{suffix}.", suffix=".tmp"
                )
                os.close(fd)
                self._tmp[suffix] = Path(name)
        except BaseException:
            self._remove_temporaries()
            raise
        self._bin = open(self._tmp[".bin"], "wb")  # closed by commit or abort
        self._mask = open(self._tmp[".lossmask"], "wb") if loss_mask else None

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is not None:
            self.abort()
        elif self._tmp:
            self.commit()

    def add_document(
        self,
        ids: Iterable[int] | npt.NDArray[np.integer],
        loss_mask: npt.NDArray[np.bool_] | None = None,
        *,
        ends: bool = True,
    ) -> None:
        """Append one document's token ids (already ending with the end-of-document id) and,
        for a writer made with `loss_mask`, which of them the loss counts as targets. With
        `ends=False` the ids are a piece of a document that the next call continues."""
        tokens = np.asarray(ids, dtype=self.dtype)
        if self._mask is not None:
            if loss_mask is None or len(loss_mask) != tokens.size:
                raise ValueError("a loss-masked dataset needs one mask entry per token")
            self._mask.write(np.asarray(loss_mask, dtype=np.uint8).tobytes())
        self._bin.write(tokens.tobytes(order="C"))
        self._open_length += tokens.size
        if ends:
            self._lengths.append(self._open_length)
            self._open_length = 0

    @property
    def document_count(self) -> int:
        """Documents added so far."""
        return len(self._lengths)

    def commit(self) -> tuple[Path, Path]:
        """Write the index and move the files into place; returns (bin, idx). A failure (a full
        disk, a directory in the way) removes the temporary files before it propagates."""
        try:
            return self._commit()
        except BaseException:
            self.abort()
            raise

    def _commit(self) -> tuple[Path, Path]:
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            self.abort()
            raise IndexedDataError(
                f"{self.prefix}: a document of {lengths.max()} tokens "
                "exceeds the format's int32 sequence length"
            )
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(lengths.size + 1, dtype=np.int64)
        with open(self._tmp[".idx"], "wb") as index:
            index.write(
                HEADER.pack(INDEX_MAGIC, INDEX_VERSION, self.code, lengths.size, documents.size)
            )
            index.write(lengths.astype(np.int32).tobytes())
            index.write(pointers.tobytes())
            index.write(documents.tobytes())
        bin_path, idx_path = indexed_files(self.prefix)
        # The index goes last: a reader finding the new .idx finds the new .bin with it.
        for tmp in self._tmp.values():
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; data is shared like any output file
        os.replace(self._tmp[".bin"], bin_path)
        if ".lossmask" in self._tmp:
            os.replace(self._tmp[".lossmask"], loss_mask_file(self.prefix))
        os.replace(self._tmp[".idx"], idx_path)
        self._tmp = {}
        return bin_path, idx_path

    def abort(self) -> None:
        """Remove the temporary files and the directories made for them; nothing is left at
        PREFIX.bin/.idx by this writer."""
        # Closing flushes what is buffered, which fails again on a full disk: the files go anyway.
        with contextlib.suppress(OSError):
            self._bin.close()
        if self._mask is not None:
            with contextlib.suppress(OSError):
                self._mask.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for tmp in self._tmp.values():
            tmp.unlink(missing_ok=True)
        self._tmp = {}
        for directory in reversed(self._made_dirs):
            # Only while still empty: another writer may have put its output there meanwhile.
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._made_dirs = []
