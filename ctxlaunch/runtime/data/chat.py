"""`ctxlaunch data prepare --chat`: chat conversations in, tokens and a loss mask out.

Input: JSON lines, one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}`.
Each conversation is rendered with the tokenizer's own chat template (the Jinja template of
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, beside the tokenizer.json)
in the environment transformers' `apply_chat_template` uses (a sandbox, trim_blocks and
lstrip_blocks, `tojson`, `raise_exception`, the special tokens as variables), then tokenized
with special tokens parsed and none added: the ids are what
`tokenizer.apply_chat_template(messages, tokenize=True)` gives, conversation for conversation.
Each conversation is one document; the template's own end-of-turn tokens end it (no further
end-of-document id is appended).

The loss mask marks the tokens the loss counts: those of the supervised roles' turns (the
assistant's by default). A turn's text is what rendering the conversation up to and including
it adds to the rendering before it (with the generation prompt for an assistant turn, so the
role header the prompt supplies is not supervised, and the end-of-turn token is); a token is
supervised when its characters overlap such a turn. A template that does not render earlier
turns as a prefix of later ones (one that rewrites history) is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxlaunch.contract.bounded import BoundedReadError, read_bounded_text
from ctxlaunch.contract.spec import indexed_files, loss_mask_file
from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype
from ctxlaunch.runtime.data.prepare import (
    PrepareError,
    PrepareResult,
    check_inputs,
    check_output,
    check_unicode,
    output_errors,
    parse_json_line,
)
from ctxlaunch.runtime.data.tokenizers import (
    MAX_TOKENIZER_CONFIG_BYTES,
    TokenizerError,
    drops_space,
    native_panics,
    text_pieces,
    tokenizer_config,
)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
"""tokenizer_config.json's special tokens the templates read as variables."""


MAX_TEMPLATE_SECONDS = 10.0
"""The longest one rendering of a conversation may take (a template's nested loops could
otherwise run for ever); measured from the main thread only (a timer signal)."""
TEMPLATE_SLACK_CHARS = 1 << 20
"""What a rendering may add to the conversation's own text, beyond four times its length:
role headers, a system prompt, tool descriptions (a `{{ 'a' * 3000000000 }}` would otherwise
exhaust memory)."""


class TemplateLimit(Exception):
    """A chat template went past a limit (its time, or the size of what it made)."""


@dataclass(frozen=True)
class ChatTokenizer:
    """A Hugging Face tokenizer.json with the chat template beside it."""

    path: Path
    render: Callable[[list[dict[str, Any]], bool], str]
    """(messages, add_generation_prompt) -> the template's text."""
    tokenize: Callable[
        [str, Sequence[tuple[int, int]]], tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]
    ]
    """(text, character spans) -> (ids, whether each id's characters overlap a span), special
    tokens parsed, none added; a piece (PIECE_CHARS) at a time, so that neither the native
    tokenizer nor the ids' character offsets ever hold more than a piece's."""
    vocab_size: int


def _text_of_token(value: Any) -> str | None:
    if isinstance(value, dict):  # transformers' AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(directory: Path, config: dict[str, Any]) -> str:
    jinja_file = directory / "chat_template.jinja"
    if os.path.lexists(jinja_file):
        try:
            return read_bounded_text(jinja_file, MAX_TOKENIZER_CONFIG_BYTES, "the chat template")
        except BoundedReadError as exc:
            raise TokenizerError(f"tokenizer {directory}: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise TokenizerError(
            f"tokenizer {directory}: no chat template (neither chat_template.jinja nor a "
            "chat_template in tokenizer_config.json): --chat renders with the tokenizer's own"
        )
    return template


def load_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """The tokenizer.json at `path` (or in the directory `path`) and its chat template."""
    import jinja2
    import jinja2.ext

    _BoundedSandbox = _bounded_sandbox_class()
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file() or file.suffix != ".json":
        raise TokenizerError(
            f"tokenizer {path}: --chat needs a Hugging Face tokenizer.json (its directory "
            "holds the chat template)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(
            "--chat needs the tokenizers package: pip install 'ctxlaunch[data]'"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises a bare Exception for every malformed file
        raise TokenizerError(
            f"tokenizer {file}: not a Hugging Face tokenizer.json ({exc})"
        ) from None
    config = tokenizer_config(file)
    source = _template_source(file.parent, config)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        loader=_BoundedSandbox.no_files,
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = environment.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(
            f"tokenizer {file}: the chat template does not parse ({exc})"
        ) from None
    specials = {name: _text_of_token(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    specials = {k: v for k, v in specials.items() if v is not None}

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        own = sum(len(str(message.get("content") or "")) for message in messages)
        limit = 4 * own + TEMPLATE_SLACK_CHARS
        environment.output_limit = limit
        made: list[str] = []
        size = 0
        with _time_limit(MAX_TEMPLATE_SECONDS):
            for chunk in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials
            ):
                size += len(chunk)
                if size > limit:
                    raise TemplateLimit(
                        f"the chat template made more than {limit:,} characters of a "
                        f"conversation of {own:,}"
                    )
                made.append(chunk)
        return "".join(made)

    def encode(piece: str) -> Any:
        with native_panics(file):
            return tokenizer.encode(piece, add_special_tokens=False)

    continuation_drops_space = drops_space(lambda text: list(encode(text).ids))

    def tokenize(
        text: str, spans: Sequence[tuple[int, int]]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        # A piece at a time, as the plain path does: the native tokenizer holds several times
        # its input per token at once (a 20 MB message peaked at 3.3 GB in one call).
        ids: list[npt.NDArray[np.int64]] = [np.zeros(0, dtype=np.int64)]
        marked: list[npt.NDArray[np.bool_]] = [np.zeros(0, dtype=np.bool_)]
        start = 0
        for number, piece in enumerate(text_pieces(text)):
            skip = 1 if number and continuation_drops_space and piece.startswith(" ") else 0
            encoding = encode(piece[skip:])
            ids.append(np.asarray(encoding.ids, dtype=np.int64))
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + start + skip
            mask = np.zeros(len(offsets), dtype=np.bool_)
            for first, stop in spans:
                mask |= (offsets[:, 0] < stop) & (offsets[:, 1] > first)
            marked.append(mask)
            start += len(piece)
        return np.concatenate(ids), np.concatenate(marked)

    return ChatTokenizer(file, render, tokenize, tokenizer.get_vocab_size(with_added_tokens=True))


def _bounded_sandbox_class() -> Any:
    """jinja2's immutable sandbox with the sizes a template makes bounded: `*` and `**` on
    what they would make, and a call given a size (a width, a count) past the output limit."""
    from jinja2 import BaseLoader
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class NoFiles(BaseLoader):
        """A chat template reads no file: `include`, `import` and `extends` are refused."""

        def get_source(self, environment: Any, template: str) -> Any:
            raise TemplateError(
                f"it includes or imports {template[:80]!r}; a chat template reads no other file"
            )

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])
        output_limit = TEMPLATE_SLACK_CHARS
        no_files = NoFiles()

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for sized, count in ((left, right), (right, left)):
                    if isinstance(sized, (str, list, tuple)) and isinstance(count, int):
                        if len(sized) * count > self.output_limit:
                            raise SecurityError(
                                f"a repetition of {len(sized) * count:,} items is past the "
                                f"template's limit of {self.output_limit:,}"
                            )
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise SecurityError(f"a power of {right:,} is past what a template computes")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            sizes = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
            if any(abs(size) > __self.output_limit for size in sizes):
                raise SecurityError(
                    f"a call given the size {max(sizes, key=abs):,}, past the template's limit "
                    f"of {__self.output_limit:,}"
                )
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """TemplateLimit when the block runs longer than `seconds` (from the main thread, where a
    timer signal can interrupt it; elsewhere the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise TemplateLimit(f"the chat template ran for more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _messages_of(line: str, where: str) -> list[dict[str, Any]]:
    data = parse_json_line(line, where)
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not messages:
        raise PrepareError(f'{where}: no "messages" list (a chat line is {{"messages": [...]}})')
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PrepareError(f'{where}: messages[{number}] has no "role"')
        content = message.get("content")
        if not isinstance(content, str):
            kind = "missing" if "content" not in message else f"a {_json_kind(content)}"
            raise PrepareError(
                f'{where}: messages[{number}] "content" is {kind}, not text (a chat line\'s '
                "messages each hold their text as a string)"
            )
    return messages


def _json_kind(value: Any) -> str:
    """A JSON value's kind, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "list"
    return "object" if isinstance(value, dict) else type(value).__name__


def encode_conversation(
    chat: ChatTokenizer, messages: list[dict[str, Any]], roles: Sequence[str], where: str = ""
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The conversation's token ids (apply_chat_template's) and, per token, whether the loss
    counts it (it overlaps a turn of one of `roles`; see the module docstring)."""
    import jinja2

    try:
        text = chat.render(messages, False)
        spans = []
        for index, message in enumerate(messages):
            if message["role"] not in roles:
                continue
            before = chat.render(messages[:index], message["role"] == "assistant")
            through = chat.render(messages[: index + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise PrepareError(
                    f"{where}: the chat template does not render turn {index} "
                    f"({message['role']}) as a continuation of the turns before it, so its "
                    "tokens cannot be told apart for the loss mask"
                )
            spans.append((len(before), len(through)))
    except jinja2.exceptions.TemplateError as exc:
        raise PrepareError(f"{where}: the chat template refused the conversation: {exc}") from None
    except TemplateLimit as exc:
        raise PrepareError(f"{where}: {exc}") from None
    except PrepareError:
        raise
    except (RecursionError, MemoryError) as exc:
        what = "recursed without end" if isinstance(exc, RecursionError) else "ran out of memory"
        raise PrepareError(f"{where}: the chat template {what}") from None
    except Exception as exc:  # the template's own code failed: an include, a type, a range
        reason = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise PrepareError(
            f"{where}: the chat template failed on the conversation "
            f"({type(exc).__name__}{': ' + reason if reason else ''})"
        ) from None
    check_unicode(text, where)
    return chat.tokenize(text, spans)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The numbered lines of a chat file, read a line at a time; PrepareError naming the file
    when it cannot be read or is not UTF-8."""
    try:
        with open(path, encoding="utf-8") as stream:
            yield from enumerate(stream, start=1)
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise PrepareError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def prepare_chat(
    inputs: Sequence[str | Path],
    tokenizer_path: str | Path,
    output: str | Path,
    *,
    roles: Sequence[str] = ("assistant",),
    model_vocab: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Chat JSON lines into OUTPUT.bin / OUTPUT.idx and the loss mask OUTPUT.lossmask (one
    conversation per document; see the module docstring). Bad input raises PrepareError (or
    TokenizerError), leaving nothing at OUTPUT."""
    started = time.perf_counter()
    check_output(output)
    paths = check_inputs(inputs)
    chat = load_chat_tokenizer(tokenizer_path)
    if model_vocab is not None and chat.vocab_size > model_vocab:
        raise PrepareError(
            f"tokenizer {chat.path}: vocabulary of {chat.vocab_size} ids is larger than the "
            f"model's {model_vocab} (model.vocab)"
        )
    documents = tokens = supervised = read = 0
    with (
        output_errors(output),
        IndexedWriter(output, token_dtype(chat.vocab_size), loss_mask=True) as writer,
    ):
        for path in paths:
            for number, line in _lines(path):
                read += len(line.encode("utf-8"))
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                ids, mask = encode_conversation(chat, _messages_of(line, where), roles, where)
                writer.add_document(ids, mask)
                documents += 1
                tokens += len(ids)
                supervised += int(mask.sum())
                if on_progress is not None:
                    on_progress(read)
        if documents == 0:
            raise PrepareError(f"{', '.join(map(str, paths))}: no conversation")
        if supervised == 0:
            raise PrepareError(
                f"{', '.join(map(str, paths))}: no token of the roles {', '.join(roles)} "
                "to train on"
            )
    bin_path, idx_path = indexed_files(output)
    return PrepareResult(
        bin_path,
        idx_path,
        documents,
        tokens,
        read,
        time.perf_counter() - started,
        0,
        chat.vocab_size,
        None,
        supervised_tokens=supervised,
        loss_mask_path=loss_mask_file(output),
    )
