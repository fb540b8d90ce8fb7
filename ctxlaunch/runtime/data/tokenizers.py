"""Tokenizers from local files: a Hugging Face `tokenizer.json`, a SentencePiece model, or a
tiktoken BPE file. Nothing is ever downloaded.

Each gives `encode(text) -> ids` (no special tokens added: documents get exactly one
end-of-document id, appended by the caller), `vocab_size` (every id it can produce, special
tokens included: the model's embedding must be at least this large) and `eod_id`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxlaunch.contract.bounded import BoundedReadError, file_kind, read_bounded_object


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded; the message names the path and the reason."""


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The pre-tokenizing split of Llama 3's tiktoken BPE (and of cl100k): a tiktoken file holds
only the merges, so the split and the special tokens come from the convention it was made for."""

LLAMA3_SPECIAL_COUNT = 256
"""Llama 3 reserves 256 special ids after the BPE ranks: <|begin_of_text|> is the first,
<|end_of_text|> (the end of a document) the second."""

EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
"""End-of-document tokens looked for, in order, when a tokenizer.json has no tokenizer_config
naming its eos_token."""


PIECE_CHARS = 1 << 18
"""The longest text handed to a tokenizer at once, in characters. A longer document is cut into
pieces of at most this length and encoded piece by piece: the tokenizers' native code holds
several times its input per token at once (a 50 MB JSON line took 6.8 GiB through the Hugging
Face tokenizer, a 200 MB text file made it ask for 4 GiB in one allocation and abort), so the
memory of `data prepare` follows the piece, not the document."""

CUT_WINDOW_CHARS = 1 << 16
"""How far back from a piece's end a cut looks for a space that follows a word."""

_CUT = re.compile(r"(?<=\S) ")
"""A cut goes before a space that follows a non-space: every pre-tokenizer here (byte-level
BPE's and tiktoken's split patterns, SentencePiece's whitespace split) ends a pre-token there,
so the pieces' ids are the whole document's (tests/unit/test_data.py checks all three kinds)."""

_PROBE = ("hello", " world")
"""Two words whose encodings, apart and together, tell whether a tokenizer adds its own word
boundary (SentencePiece's dummy prefix, a Prepend normalizer) to text that starts a call."""


def cut_point(text: str, limit: int) -> int:
    """Where to end the first piece of `text` (longer than `limit`): before the last space
    following a non-space within the last CUT_WINDOW_CHARS of the limit, else at the limit
    (a run of that many characters without such a space is no prose: the ids at that one cut
    may differ from the whole run's)."""
    last = None
    for match in _CUT.finditer(text, max(1, limit - CUT_WINDOW_CHARS), limit + 1):
        last = match.start()
    return last if last else limit


def text_pieces(text: str, limit: int | None = None) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters (PIECE_CHARS by default), cut as
    `cut_point` says; a text within the limit is one piece."""
    limit = limit or PIECE_CHARS
    while len(text) > limit:
        cut = cut_point(text, limit)
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: what `data prepare` needs and nothing else."""

    path: Path
    kind: str
    """huggingface, sentencepiece or tiktoken."""
    vocab_size: int
    eod_id: int
    encode: Callable[[str], list[int]]
    """Text -> token ids, without any special token added."""
    continuation_drops_space: bool = False
    """The tokenizer adds a word boundary of its own at the start of each call, so a piece that
    continues a document (it starts with the space a cut left) is encoded without that space."""

    def encode_continuation(self, piece: str) -> list[int]:
        """The ids of `piece` as they are inside the document it continues."""
        if self.continuation_drops_space and piece.startswith(" "):
            piece = piece[1:]
        return self.encode(piece)


def drops_space(encode: Callable[[str], list[int]]) -> bool:
    """Whether `encode` adds its own word boundary at the start of a call (see _PROBE)."""
    first, second = _PROBE
    whole = encode(first + second)
    if encode(first) + encode(second) == whole:
        return False
    return encode(first) + encode(second.lstrip(" ")) == whole


def _with_continuation(tokenizer: Tokenizer) -> Tokenizer:
    return dataclasses.replace(tokenizer, continuation_drops_space=drops_space(tokenizer.encode))


def load_tokenizer(path: str | Path, eod_token: str | None = None) -> Tokenizer:
    """Load the tokenizer at `path`, its kind told by the file: JSON is a Hugging Face
    tokenizer.json (or a directory holding one), a SentencePiece model is a protobuf starting
    with its piece list, and anything else is tried as a tiktoken BPE file (base64 token, rank
    per line). `eod_token` names the end-of-document token when the file's own is not wanted."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    problem = not_a_regular_file(path)
    if problem is not None:
        raise TokenizerError(f"tokenizer {path}: {problem}")
    head = _head(path)
    if head.lstrip().startswith(b"{"):
        return _with_continuation(_huggingface(path, eod_token))
    if head[:1] == b"\x0a":  # protobuf field 1 (pieces), length-delimited: a SentencePiece model
        return _with_continuation(_sentencepiece(path, eod_token))
    return _with_continuation(_tiktoken(path, eod_token))


def not_a_regular_file(path: Path) -> str | None:
    """Why `path` is no file to read ("no such file", "is a FIFO; give a regular file"...), or
    None for a regular file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(mode):
        return f"is {file_kind(mode)}; give a regular file"
    return None


def _head(path: Path) -> bytes:
    """The first bytes of a file, which tell its kind."""
    with open(path, "rb") as stream:
        return stream.read(64)


def _library(module: str, path: Path) -> Any:
    """Import a tokenizer library (imported only when its kind of file is loaded)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0]:
            raise  # not installed: the command names the extra that installs it
        raise TokenizerError(
            f"tokenizer {path}: needs the `{module.split('.')[0]}` package ({exc})"
        ) from None


def _huggingface(path: Path, eod_token: str | None) -> Tokenizer:
    library = _library("tokenizers", path)
    try:
        tokenizer = library.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for every malformed file
        raise TokenizerError(
            f"tokenizer {path}: not a Hugging Face tokenizer.json ({exc})"
        ) from None
    name = (
        eod_token
        or _configured_eos(path)
        or next((n for n in EOD_NAMES if tokenizer.token_to_id(n) is not None), None)
    )
    eod = tokenizer.token_to_id(name) if name else None
    if eod is None:
        raise TokenizerError(
            f"tokenizer {path}: no end-of-document token "
            f"({name or ' / '.join(EOD_NAMES)} not in its vocabulary); "
            "name one with --eod-token"
        )

    # Special tokens written in the text are encoded as text, as tiktoken's encode_ordinary
    # and SentencePiece do: a document cannot end itself early by containing "</s>".
    tokenizer.encode_special_tokens = True

    def encode(text: str) -> list[int]:
        with native_panics(path):
            return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return Tokenizer(
        path, "huggingface", tokenizer.get_vocab_size(with_added_tokens=True), eod, encode
    )


def _configured_eos(path: Path) -> str | None:
    """The eos_token of a tokenizer_config.json beside a tokenizer.json, where there is one."""
    eos: Any = tokenizer_config(path).get("eos_token")
    if isinstance(eos, dict):  # transformers' AddedToken form
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


MAX_TOKENIZER_CONFIG_BYTES = 16 << 20
"""The largest tokenizer_config.json read (16 MiB; one with a few hundred added tokens and a
chat template is under 100 KiB)."""


def tokenizer_config(path: Path) -> dict[str, Any]:
    """The tokenizer_config.json beside the tokenizer.json at `path` ({} where there is none),
    read with bounds: TokenizerError naming it when it is there but is no JSON object (a FIFO,
    a device, nested past any config, not UTF-8)."""
    config = path.with_name("tokenizer_config.json")
    if not os.path.lexists(config):
        return {}
    try:
        return read_bounded_object(config, MAX_TOKENIZER_CONFIG_BYTES, "tokenizer_config.json")
    except BoundedReadError as exc:
        raise TokenizerError(f"tokenizer {path}: {exc}") from None


_held_stderr: Any = None
"""A temporary file that takes this process's stderr while native code runs (made once)."""


@contextlib.contextmanager
def native_panics(path: Path, where: str = "") -> Iterator[None]:
    """A panic in a tokenizer's native code inside the block (its regex engine giving up on an
    expression that backtracks without end, "retry-limit-in-match over") becomes one
    TokenizerError naming the file (and `where`, the text's place). The process's stderr is
    held in a temporary file meanwhile: after the block it is passed on (a progress display's
    frames arrive a little late, none is lost), after a panic the native report in it is
    dropped, so the command says one sentence."""
    global _held_stderr
    if _held_stderr is None:
        _held_stderr = tempfile.TemporaryFile()  # noqa: SIM115 - held for the process's life
    held_fd = _held_stderr.fileno()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(held_fd, 2)
    panicked = False
    try:
        yield
    except BaseException as exc:
        # pyo3's PanicException derives from BaseException, not Exception, and its module
        # cannot always be imported: it is known by its name.
        if type(exc).__name__ != "PanicException":
            raise
        panicked = True
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        at = f" on the text at {where}" if where else ""
        raise TokenizerError(
            f"tokenizer {path}: its native code failed{at} ({reason}): a regular expression of "
            "its pre-tokenizer backtracks without bound on such text"
        ) from None
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held = os.lseek(held_fd, 0, os.SEEK_END)
        if held and not panicked:
            os.lseek(held_fd, 0, os.SEEK_SET)
            while chunk := os.read(held_fd, 1 << 16):
                os.write(2, chunk)
        if held:
            os.ftruncate(held_fd, 0)
            os.lseek(held_fd, 0, os.SEEK_SET)


def _sentencepiece(path: Path, eod_token: str | None) -> Tokenizer:
    sentencepiece = _library("sentencepiece", path)
    try:
        model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise TokenizerError(f"tokenizer {path}: not a SentencePiece model ({exc})") from None
    eod = model.piece_to_id(eod_token) if eod_token else model.eos_id()
    if eod < 0 or (eod_token and model.id_to_piece(eod) != eod_token):
        raise TokenizerError(
            f"tokenizer {path}: no end-of-document token "
            f"({eod_token or 'the model defines no eos'}); "
            "name one with --eod-token"
        )

    def encode(text: str) -> list[int]:
        return list(model.encode(text))

    return Tokenizer(path, "sentencepiece", model.get_piece_size(), eod, encode)


MAX_TIKTOKEN_RANK = (1 << 31) - 1 - LLAMA3_SPECIAL_COUNT
"""The largest rank a tiktoken file may give: every id, the special ones after the ranks
included, must fit the int32 the indexed dataset stores large vocabularies in."""


def _check_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    """A TokenizerError naming `path` unless its ranks are a vocabulary: some tokens, each rank
    a distinct id from 0 up to MAX_TIKTOKEN_RANK."""
    if not ranks:
        raise TokenizerError(
            f"tokenizer {path}: holds no tokens (empty, or not a tokenizer.json, a SentencePiece "
            "model or a tiktoken BPE file)"
        )
    values = list(ranks.values())
    if min(values) < 0 or max(values) > MAX_TIKTOKEN_RANK:
        raise TokenizerError(
            f"tokenizer {path}: a rank outside 0 .. {MAX_TIKTOKEN_RANK:,} "
            f"({min(values) if min(values) < 0 else max(values):,})"
        )
    if len(set(values)) != len(values):
        raise TokenizerError(f"tokenizer {path}: two tokens share a rank; each needs its own")


def _tiktoken(path: Path, eod_token: str | None) -> Tokenizer:
    tiktoken = _library("tiktoken", path)
    try:
        ranks = _library("tiktoken.load", path).load_tiktoken_bpe(str(path))
    except Exception as exc:  # a binary or malformed file fails in base64 or int parsing
        raise TokenizerError(
            f"tokenizer {path}: not a tiktoken BPE file (base64 token, rank "
            f"per line), a tokenizer.json or a SentencePiece model ({exc})"
        ) from None
    _check_ranks(path, ranks)
    base = len(ranks)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_SPECIAL_COUNT - 2)
    ]
    special_ids = {name: base + i for i, name in enumerate(specials)}
    name = eod_token or "<|end_of_text|>"
    if name not in special_ids:
        raise TokenizerError(
            f"tokenizer {path}: no end-of-document token {name!r} among the Llama 3 special tokens"
        )
    try:
        encoding = tiktoken.Encoding(
            name=path.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special_ids,
        )
    except (ValueError, OverflowError) as exc:  # tiktoken's native checks, in its own words
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerError(
            f"tokenizer {path}: not a usable tiktoken BPE file ({reason})"
        ) from None

    def encode(text: str) -> list[int]:
        # Text that looks like a special token is encoded as text: a document cannot end
        # itself early by containing "<|end_of_text|>".
        return list(encoding.encode_ordinary(text))

    return Tokenizer(path, "tiktoken", base + LLAMA3_SPECIAL_COUNT, special_ids[name], encode)
