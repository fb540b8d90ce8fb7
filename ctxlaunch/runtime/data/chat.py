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

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxlaunch.contract.spec import indexed_files, loss_mask_file
from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype
from ctxlaunch.runtime.data.prepare import (
    PrepareError,
    PrepareResult,
    check_inputs,
    check_unicode,
    output_errors,
    parse_json_line,
)
from ctxlaunch.runtime.data.tokenizers import TokenizerError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
"""tokenizer_config.json's special tokens the templates read as variables."""


@dataclass(frozen=True)
class ChatTokenizer:
    """A Hugging Face tokenizer.json with the chat template beside it."""

    path: Path
    render: Callable[[list[dict[str, Any]], bool], str]
    """(messages, add_generation_prompt) -> the template's text."""
    tokenize: Callable[[str], tuple[list[int], list[tuple[int, int]]]]
    """Text -> (ids, each id's character span), special tokens parsed, none added."""
    vocab_size: int


def _text_of_token(value: Any) -> str | None:
    if isinstance(value, dict):  # transformers' AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(directory: Path, config: dict[str, Any]) -> str:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
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
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    config_file = file.with_name("tokenizer_config.json")
    try:
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
    except ValueError as exc:
        raise TokenizerError(f"{config_file}: not JSON ({exc})") from None
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

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
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
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **specials
        )

    def tokenize(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    return ChatTokenizer(file, render, tokenize, tokenizer.get_vocab_size(with_added_tokens=True))


def _messages_of(line: str, where: str) -> list[dict[str, Any]]:
    data = parse_json_line(line, where)
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not messages:
        raise PrepareError(f'{where}: no "messages" list (a chat line is {{"messages": [...]}})')
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PrepareError(f'{where}: messages[{number}] has no "role"')
    return messages


def encode_conversation(
    chat: ChatTokenizer, messages: list[dict[str, Any]], roles: Sequence[str], where: str = ""
) -> tuple[list[int], npt.NDArray[np.bool_]]:
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
    check_unicode(text, where)
    ids, offsets = chat.tokenize(text)
    mask = np.zeros(len(ids), dtype=np.bool_)
    for start, stop in spans:
        mask |= np.array([s < stop and e > start for s, e in offsets], dtype=np.bool_)
    return ids, mask


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
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{path}: not UTF-8 text ({exc.reason})") from None
            except OSError as exc:
                raise PrepareError(f"{path}: cannot be read ({exc.strerror or exc})") from None
            for number, line in enumerate(lines, start=1):
                read += len(line.encode("utf-8")) + 1
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
