"""`data prepare` given what it cannot take: a chat template that includes a file, overflows
`range`, recurses, repeats a string past memory or loops past its time; message contents that
are not text; a tokenizer_config.json that is a FIFO, a device or nested without end; an input
that is a FIFO, a directory or a device; `-o .` and `-o ''`; a tokenizer whose pre-tokenizer
regex backtracks without end (the Rust panic). Each is exit 2 with one sentence naming the
input, nothing written. And `--chat` tokenizes a piece at a time, to the whole text's ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ctxlaunch.cli import app
from tests.helpers.chat_data import write_chat_tokenizer
from tests.helpers.cli import CliRunner

CONVERSATION = {
    "messages": [
        {"role": "user", "content": "what is the loss"},
        {"role": "assistant", "content": "the assistant turn only"},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' byte-level BPE tokenizer with its ChatML template."""
    return write_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _prepare(*args: str) -> tuple[int, str]:
    """`data prepare ARGS` in process: its exit code and its output on one line, after checking
    it raised nothing but an exit and printed no traceback."""
    result = CliRunner().invoke(app, ["data", "prepare", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


def _template_dir(tokenizer: Path, tmp_path: Path, template: str) -> Path:
    directory = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, directory)
    (directory / "chat_template.jinja").write_text(template)
    return directory


TEMPLATES = {
    "includes a file": (
        "{% include 'other.jinja' %}",
        "includes or imports 'other.jinja'; a chat template reads no other file",
    ),
    "overflows range": (
        "{% for i in range(10**9) %}x{% endfor %}",
        "a call given the size 1,000,000,000, past the template's limit",
    ),
    "recurses": (
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "the chat template recursed without end",
    ),
    "repeats past memory": (
        "{{ 'a' * 3000000000 }}",
        "a repetition of 3,000,000,000 items is past the template's limit",
    ),
    "pads past memory": ("{{ 'a'.center(3000000000) }}", "a call given the size 3,000,000,000"),
    "writes past its limit": (
        "{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
        "the chat template made more than",
    ),
    "loops past its time": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "the chat template ran for more than 0.5 s",
    ),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_hostile_chat_template_is_one_sentence(
    case: str, tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each template is refused naming the conversation's line and what the template did, in
    bounded time and memory, and nothing is written."""
    from ctxlaunch.runtime.data import chat

    monkeypatch.setattr(chat, "MAX_TEMPLATE_SECONDS", 0.5)
    template, words = TEMPLATES[case]
    directory = _template_dir(tokenizer, tmp_path, template)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    output = tmp_path / "out" / "x"
    code, said = _prepare(str(data), "-t", str(directory), "-o", str(output), "--chat")
    assert code == 2 and said.startswith(f"error: {data}:1: ") and words in said, said
    assert not output.parent.exists()


@pytest.mark.parametrize(("content", "kind"), [(["a", "b"], "a list"), (5, "a number")])
def test_message_content_that_is_not_text_is_one_sentence(
    content: object, kind: str, tokenizer: Path, tmp_path: Path
) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": content}]}) + "\n")
    code, said = _prepare(
        str(data), "-t", str(tokenizer), "-o", str(tmp_path / "out" / "x"), "--chat"
    )
    assert code == 2, said
    assert f'{data}:1: messages[0] "content" is {kind}, not text' in said


@pytest.mark.parametrize("kind", ["fifo", "device", "deep"])
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_a_hostile_tokenizer_config_is_one_sentence(
    kind: str, chat: bool, tokenizer: Path, tmp_path: Path
) -> None:
    """tokenizer_config.json beside the tokenizer.json is read with bounds: a FIFO (which
    blocked for ever), a link to /dev/zero (MemoryError) or 100,000 levels of nesting
    (RecursionError) are named."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, directory)
    config = directory / "tokenizer_config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
        words = "tokenizer_config.json is a FIFO; give a regular file"
    elif kind == "device":
        config.symlink_to("/dev/zero")
        words = "tokenizer_config.json is a device; give a regular file"
    else:
        config.write_text("[" * 100_000 + "]" * 100_000)
        words = "tokenizer_config.json is not valid JSON (nested deeper"
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps(CONVERSATION if chat else {"text": "hello world"}) + "\n")
    args = [str(data), "-t", str(directory / "tokenizer.json"), "-o", str(tmp_path / "o" / "x")]
    code, said = _prepare(*args, *(["--chat"] if chat else []))
    assert code == 2 and said.startswith(f"error: tokenizer {directory / 'tokenizer.json'}: ")
    assert words in said, said


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_an_input_that_is_no_file_is_named_as_what_it_is(
    kind: str, tokenizer: Path, tmp_path: Path
) -> None:
    """A FIFO, a directory or a device given as input was "no such file"; it is named as what
    it is (and a FIFO is never opened: it would block)."""
    if kind == "fifo":
        source = tmp_path / "docs.jsonl"
        os.mkfifo(source)
        words = "is a FIFO; give a regular file"
    elif kind == "directory":
        source, words = tmp_path, "is a directory; give a regular file"
    else:
        source, words = Path("/dev/null"), "is a device; give a regular file"
    code, said = _prepare(str(source), "-t", str(tokenizer), "-o", str(tmp_path / "o" / "x"))
    assert code == 2 and f"error: {source}: {words}" in said, said


@pytest.mark.parametrize("output", [".", "", ".."])
def test_an_output_that_names_a_directory_is_one_sentence(
    output: str, tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o .` or `-o ''` ended in a traceback (`..bin` beside the directory): each is refused
    before anything is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n')
    code, said = _prepare("docs.jsonl", "-t", str(tokenizer), "-o", output)
    assert code == 2 and "names a directory, not a prefix; give DIR/NAME" in said, said
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]


def test_a_pre_tokenizer_regex_that_backtracks_without_end_is_one_sentence(
    tokenizer: Path, tmp_path: Path
) -> None:
    """A tokenizer.json whose Split regex backtracks catastrophically: the regex engine gives
    up inside the Rust code, which panics (a PanicException, not an Exception); it is one
    sentence naming the tokenizer, nothing written."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(\\w+\\s?)*$"},
        "behavior": "Isolated",
        "invert": False,
    }
    (directory / "tokenizer.json").write_text(json.dumps(data))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "a" * 5000 + "!"}) + "\n")
    output = tmp_path / "out" / "x"
    # As a user runs it: the native panic report goes to the process's own stderr.
    done = subprocess.run(
        [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "data", "prepare"]
        + [str(docs), "-t", str(directory / "tokenizer.json"), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said
    assert said.startswith(f"error: tokenizer {directory / 'tokenizer.json'}: ")
    assert "retry-limit-in-match over" in said and "panicked" not in said, said
    assert not output.parent.exists()


def test_chat_tokenizes_a_piece_at_a_time_to_the_whole_texts_ids(
    tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation longer than a piece is tokenized piece by piece (as the plain path
    does: one 20 MB message took 3.3 GB in one call), to the ids and loss mask of the whole
    text at once. Pieces of 64 characters stand in for the real 256 Ki."""
    from ctxlaunch.runtime.data import chat, tokenizers

    words = "the context window grows when the rope base rises and documents stay apart "
    messages = [
        {"role": "user", "content": words * 20},
        {"role": "assistant", "content": (words * 15).strip()},
    ]
    loaded = chat.load_chat_tokenizer(tokenizer)
    whole_ids, whole_mask = chat.encode_conversation(loaded, messages, ["assistant"])
    monkeypatch.setattr(tokenizers, "PIECE_CHARS", 64)
    piece_ids, piece_mask = chat.encode_conversation(loaded, messages, ["assistant"])
    pieces = list(tokenizers.text_pieces(loaded.render(messages, False)))
    assert len(pieces) > 20  # the text was cut in many pieces
    np.testing.assert_array_equal(piece_ids, whole_ids)
    np.testing.assert_array_equal(piece_mask, whole_mask)
    assert 0 < int(whole_mask.sum()) < len(whole_ids)
