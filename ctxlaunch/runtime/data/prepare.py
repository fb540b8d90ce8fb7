"""`ctxlaunch data prepare`: text in, a Megatron indexed dataset out.

Documents: a `.jsonl` or `.json` input is JSON lines, one document per line, its text in a
named field; this is the only input Megatron's `tools/preprocess_data.py` reads (without
--split-sentences it too makes one document of each line's field). Any other input (`.txt`)
is one document per file: blank lines separate paragraphs, not documents, and a book or a
source file is one document. Each document's ids get the end-of-document id appended (as
preprocess_data's --append-eod does); a record whose text is empty is skipped and counted (it
would have no tokens to train on).

A document longer than PIECE_CHARS is tokenized a piece at a time (cut before a space that
follows a word, where the ids do not change): a text file is read a piece at a time too, so
memory follows the piece, not the document. Several processes tokenize; the parent writes, in
input order, so the output does not depend on the number of workers. Any bad input stops the
run and removes what was written.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from ctxlaunch.contract.spec import indexed_files
from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype
from ctxlaunch.runtime.data.tokenizers import (
    PIECE_CHARS,
    Tokenizer,
    cut_point,
    load_tokenizer,
    not_a_regular_file,
    text_pieces,
)

JSON_SUFFIXES = (".jsonl", ".json")
BATCH_BYTES = 1 << 20
"""Text sent to a worker at a time: large enough to amortise the pickling, small enough that
the progress bar moves and memory stays flat."""


class PrepareError(ValueError):
    """Bad input: the message names the input (file and line where there is one) and why."""


@dataclass(frozen=True)
class PrepareResult:
    """What one `prepare` run wrote."""

    bin_path: Path
    idx_path: Path
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    empty_skipped: int
    vocab_size: int
    eod_id: int | None
    """The end-of-document id appended to each document; None for chat data (the template's
    own end-of-turn tokens end each conversation)."""
    supervised_tokens: int | None = None
    """Chat data: the tokens the loss mask marks."""
    loss_mask_path: Path | None = None
    """Chat data: OUTPUT.lossmask."""

    @property
    def tokens_per_second(self) -> float:
        """Tokens written per second of the whole run (reading, tokenizing and writing)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Record:
    """One document's text as read: where it came from, and the raw text or JSON line."""

    source: str
    """file, or file:line for JSON lines."""
    raw: str
    is_json: bool
    continues: bool = False
    """A piece of a text file's document after its first: encoded as a continuation."""
    ends_document: bool = True
    """The document's last piece, which gets the end-of-document id."""


def _records(path: Path) -> Iterator[_Record]:
    """The documents of one input file, unparsed (workers parse JSON, in parallel)."""
    try:
        if path.suffix.lower() in JSON_SUFFIXES:
            with open(path, encoding="utf-8") as stream:
                for number, line in enumerate(stream, start=1):
                    if line.strip():
                        yield _Record(f"{path}:{number}", line, True)
        else:
            yield from _text_file_pieces(path)
    except UnicodeDecodeError as exc:
        raise PrepareError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start} of a read block)"
        ) from None
    except OSError as exc:
        raise PrepareError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _text_file_pieces(path: Path) -> Iterator[_Record]:
    """A text file's one document, read and handed on a piece (PIECE_CHARS) at a time."""
    limit = PIECE_CHARS
    with open(path, encoding="utf-8") as stream:
        held = ""
        first = True
        while True:
            chunk = stream.read(limit)
            held += chunk
            while len(held) > limit or (not chunk and held):
                cut = cut_point(held, limit) if len(held) > limit else len(held)
                piece, held = held[:cut], held[cut:]
                last = not chunk and not held
                yield _Record(str(path), piece, False, continues=not first, ends_document=last)
                first = False
            if not chunk:
                return


def parse_json_line(raw: str, source: str) -> object:
    """One JSON line, parsed; a PrepareError naming `source` when it is not JSON or nests
    deeper than the parser's recursion allows (such a line is no document anyone meant)."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise PrepareError(f"{source}: not a JSON object ({exc})") from None
    except RecursionError:
        raise PrepareError(
            f"{source}: JSON nested too deep to read (a document is a flat object)"
        ) from None


def check_unicode(text: str, source: str) -> None:
    """A PrepareError naming `source` when `text` holds a lone surrogate (a JSON escape such as
    \\ud800 with no pair): it is not Unicode, and the tokenizers' native code cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PrepareError(
            f"{source}: the text holds a lone surrogate U+{ord(text[exc.start]):04X} at "
            f"character {exc.start}, which is not Unicode and cannot be tokenized"
        ) from None


@contextlib.contextmanager
def output_errors(output: str | Path) -> Iterator[None]:
    """An OSError inside the block (a directory that cannot be made, a read-only or full file
    system, a file or directory in the way) becomes a PrepareError naming the output."""
    try:
        yield
    except OSError as exc:
        target = exc.filename2 or exc.filename  # os.replace names the destination second
        where = f" ({target})" if target else ""
        reason = (
            "a file stands where a directory is needed"
            if isinstance(exc, (FileExistsError, NotADirectoryError))
            else exc.strerror or str(exc)
        )
        raise PrepareError(f"-o {output}: cannot write the output{where}: {reason}") from None


_worker_tokenizer: Tokenizer | None = None
_worker_field = "text"


def _start_worker(tokenizer_path: str, eod_token: str | None, json_field: str) -> None:
    """Load the tokenizer once per process (a worker, or the parent when it encodes alone)."""
    global _worker_tokenizer, _worker_field
    _worker_tokenizer = load_tokenizer(tokenizer_path, eod_token)
    _worker_field = json_field


def _work(conn: Connection, init_args: tuple[str, str | None, str]) -> None:
    """A worker process: load the tokenizer, then encode each batch the parent sends until
    it sends None or goes away. Ctrl-C is left to the parent (it reaches the whole process
    group), which ends the workers with SIGTERM, whose default action ends them quietly: no
    traceback per worker. An error is sent back for the parent to raise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    failure: Exception | None = None
    try:
        _start_worker(*init_args)
    except Exception as error:  # sent to the parent, which names it
        failure = error
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        result: tuple[str, object]
        if failure is not None:
            result = ("error", failure)
        else:
            try:
                result = ("ok", _encode_batch(batch))
            except Exception as error:  # sent to the parent, which names it
                result = ("error", error)
        try:
            conn.send(result)
        except OSError:  # the parent has gone (interrupted): nobody to answer
            return


class _Workers:
    """Tokenizer processes, each fed one batch at a time over a pipe of its own; results come
    back in the order the batches were read.

    Pipes rather than multiprocessing.Pool: a worker killed by a signal while it waits for a
    task holds the Pool's shared queue lock, and Pool.terminate then waits for that lock
    forever. Here nothing is shared between workers: a dead worker is an end of file on its
    own pipe, and ending the workers is a signal and a bounded join."""

    def __init__(self, count: int, init_args: tuple[str, str | None, str]) -> None:
        # spawn: the parent may hold threads (rich's live display, tokenizers' pool) that a
        # fork would copy in an unknown state.
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        # Started with SIGINT ignored, which a spawned interpreter keeps from its first
        # instruction: a Ctrl-C while a worker is still importing prints no traceback. (A
        # blocked one would not do: the child's signal mask is cleared at exec.) The parent
        # ignores it only while it starts each one, a few milliseconds, and before it writes
        # any output; a Ctrl-C that lands in them is lost.
        try:
            for _ in range(count):
                ours, theirs = context.Pipe()
                process = context.Process(target=_work, args=(theirs, init_args), daemon=True)
                with _sigint_ignored():
                    process.start()
                theirs.close()
                self._pipes.append(ours)
                self._processes.append(process)
        except BaseException:
            self.close(finished=False)
            raise

    def map(self, batches: Iterator[list[_Record]]) -> Iterator[list[npt.NDArray[np.int64] | None]]:
        """Encoded batches in input order. Batch k goes to worker k mod count, and a worker
        is sent its next batch only once its result is read, so neither side ever blocks
        writing to a pipe the other is not reading."""
        count = len(self._pipes)
        in_flight: collections.deque[int] = collections.deque()
        for worker in range(count):
            batch = next(batches, None)
            if batch is None:
                break
            self._send(worker, batch)
            in_flight.append(worker)
        while in_flight:
            worker = in_flight.popleft()
            yield self._receive(worker)
            batch = next(batches, None)
            if batch is not None:
                self._send(worker, batch)
                in_flight.append(worker)

    def _send(self, worker: int, batch: list[_Record]) -> None:
        try:
            self._pipes[worker].send(batch)
        except (BrokenPipeError, ConnectionResetError):
            self._ended(worker)

    def _receive(self, worker: int) -> list[npt.NDArray[np.int64] | None]:
        try:
            kind, value = self._pipes[worker].recv()
        except (EOFError, ConnectionResetError):
            self._ended(worker)
        if kind == "error":
            raise value
        return value

    def _ended(self, worker: int) -> NoReturn:
        """A worker's pipe closed under us: the signal that reached the whole group is an
        interrupt; anything else (the OOM killer, kill -9) is named."""
        process = self._processes[worker]
        process.join(timeout=5)
        code = process.exitcode
        if code is not None and -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            raise KeyboardInterrupt from None
        raise PrepareError(
            f"a tokenizer worker (process {process.pid}) ended with exit code {code}"
        ) from None

    def close(self, *, finished: bool) -> None:
        """End every worker. Finished: a stop message to each, and a bounded wait. Otherwise
        (an error or an interrupt) no wait for the batches in hand. Then SIGTERM to any still
        running, then SIGKILL."""
        for pipe in self._pipes:
            if finished:
                with contextlib.suppress(OSError):
                    pipe.send(None)
            pipe.close()
        for process in self._processes:
            process.join(timeout=5 if finished else 0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored inside the block (in the main thread; elsewhere signals are not ours)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _encode_batch(batch: list[_Record]) -> list[npt.NDArray[np.int64] | None]:
    """Token ids per record (the end-of-document id after a document's last piece); None for
    an empty text."""
    tokenizer = _worker_tokenizer
    assert tokenizer is not None, "worker used before _start_worker"
    out: list[npt.NDArray[np.int64] | None] = []
    for record in batch:
        text = _text_of(record, _worker_field)
        if not text:
            out.append(None)
            continue
        check_unicode(text, record.source)
        # Each piece's ids become an array at once: a long document's ids as Python ints
        # would take 36 bytes each (a 50 MB JSON line: 13 million ids, 470 MB).
        if record.continues:
            arrays = [np.asarray(tokenizer.encode_continuation(text), dtype=np.int64)]
        else:
            arrays = [
                np.asarray(
                    tokenizer.encode(piece)
                    if number == 0
                    else tokenizer.encode_continuation(piece),
                    dtype=np.int64,
                )
                for number, piece in enumerate(text_pieces(text))
            ]
        if record.ends_document:
            arrays.append(np.asarray([tokenizer.eod_id], dtype=np.int64))
        out.append(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))
    return out


def _text_of(record: _Record, field: str) -> str:
    if not record.is_json:
        return record.raw
    data = parse_json_line(record.raw, record.source)
    if not isinstance(data, dict) or field not in data:
        keys = ", ".join(sorted(data)) if isinstance(data, dict) else type(data).__name__
        raise PrepareError(
            f"{record.source}: no field {field!r} (has: {keys}); choose the field with --json-field"
        )
    text = data[field]
    if not isinstance(text, str):
        raise PrepareError(f"{record.source}: field {field!r} is {type(text).__name__}, not text")
    return text


def _batches(inputs: Sequence[Path]) -> Iterator[tuple[list[_Record], int]]:
    """Records in input order, in batches of about BATCH_BYTES, with the bytes each holds."""
    batch: list[_Record] = []
    size = 0
    for path in inputs:
        for record in _records(path):
            batch.append(record)
            size += len(record.raw.encode("utf-8"))
            if size >= BATCH_BYTES:
                yield batch, size
                batch, size = [], 0
    if batch:
        yield batch, size


def check_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Every input exists and holds something; the first problem is a PrepareError."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise PrepareError("no input files")
    for path in paths:
        # A FIFO would block the reader, a device never end, a directory is no document.
        problem = not_a_regular_file(path)
        if problem is not None:
            raise PrepareError(f"{path}: {problem}")
        if path.stat().st_size == 0:
            raise PrepareError(f"{path}: the file is empty (no documents)")
    return paths


def check_output(output: str | Path) -> None:
    """A PrepareError unless `output` is a prefix the dataset's files can be named by: not
    empty, not `.` or `..`, not a directory (OUTPUT.bin would land beside it, named after
    it, or `..bin` in it)."""
    text = str(output)
    name = Path(text).name
    if not text or name in ("", ".", "..") or text.endswith("/") or Path(text).is_dir():
        raise PrepareError(
            f"-o {text!r}: names a directory, not a prefix; give DIR/NAME (writes "
            "DIR/NAME.bin and DIR/NAME.idx)"
        )


def prepare(
    inputs: Sequence[str | Path],
    tokenizer_path: str | Path,
    output: str | Path,
    *,
    json_field: str = "text",
    workers: int = 1,
    model_vocab: int | None = None,
    eod_token: str | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Tokenize `inputs` into OUTPUT.bin / OUTPUT.idx (see the module docstring for what a
    document is). `model_vocab`, when given, must hold every id the tokenizer can produce.
    `on_progress(bytes)` is called as each batch of input text is written. Raises PrepareError
    (or TokenizerError) on bad input, leaving nothing at OUTPUT."""
    started = time.perf_counter()
    check_output(output)
    paths = check_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path, eod_token)
    if model_vocab is not None and tokenizer.vocab_size > model_vocab:
        raise PrepareError(
            f"tokenizer {tokenizer.path}: vocabulary of {tokenizer.vocab_size} "
            f"ids is larger than the model's {model_vocab} (model.vocab)"
        )
    init_args = (str(tokenizer_path), eod_token, json_field)
    documents = tokens = empty = read = 0
    # The workers start before any output exists (see _Workers on SIGINT).
    pool = _Workers(workers, init_args) if workers > 1 else None
    try:
        # Inputs' OSErrors are PrepareErrors naming the input by now (_records): any left is
        # the output's.
        with (
            output_errors(output),
            IndexedWriter(output, token_dtype(tokenizer.vocab_size)) as writer,
        ):
            batches = _batches(paths)
            # Per batch sent and not yet written: its input bytes and which of its records end
            # their document (the text itself is not kept).
            sent: collections.deque[tuple[int, list[bool]]] = collections.deque()

            def texts() -> Iterator[list[_Record]]:
                for batch, size in batches:
                    sent.append((size, [record.ends_document for record in batch]))
                    yield batch

            encoded: Iterator[list[npt.NDArray[np.int64] | None]]
            if pool is not None:
                encoded = pool.map(texts())
            else:
                _start_worker(*init_args)
                encoded = map(_encode_batch, texts())
            for batch_ids in encoded:
                size, ends = sent.popleft()
                for ids, ends_document in zip(batch_ids, ends, strict=True):
                    if ids is None:
                        empty += 1
                        continue
                    writer.add_document(ids, ends=ends_document)
                    documents += ends_document
                    tokens += ids.size
                read += size
                if on_progress is not None:
                    on_progress(read)
            if documents == 0:
                raise PrepareError(f"{', '.join(map(str, paths))}: no document has any text")
    except BaseException:
        if pool is not None:
            pool.close(finished=False)
        raise
    if pool is not None:
        pool.close(finished=True)
    bin_path, idx_path = indexed_files(output)
    return PrepareResult(
        bin_path,
        idx_path,
        documents,
        tokens,
        read,
        time.perf_counter() - started,
        empty,
        tokenizer.vocab_size,
        tokenizer.eod_id,
    )
