"""Reading a file a user names, with bounds: a regular file only (never a FIFO that blocks or a
device that never ends), at most so many bytes, nested at most so deep; YAML with no alias
expanded beyond a bound and no key given twice.

A spec, a sweep, a config.json and the spec a job carries all come through here, so a hostile
or broken file ends in one sentence naming it, never a hang, a MemoryError or a
RecursionError.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_SPEC_BYTES = 1 << 20
"""The largest spec or sweep file read (1 MiB; the largest example spec is under 2 KiB)."""
MAX_CONFIG_BYTES = 4 << 20
"""The largest config.json read (4 MiB; Llama's are under 2 KiB, a classifier's label maps
can run to hundreds of KiB)."""
MAX_DEPTH = 64
"""The deepest nesting of mappings and lists read (a spec nests 5 deep)."""
MAX_YAML_NODES = 100_000
"""The most values a YAML document may hold with every alias expanded: a few aliases of a
few anchors can otherwise stand for 10^9 values ("billion laughs")."""


class BoundedReadError(ValueError):
    """A file that cannot be read within the bounds; the message names it and the reason."""


MAX_STATE_BYTES = 16 << 20
"""The largest record ctxlaunch reads back from its own state (a job or sweep record, a run's
summary, a saved calibration): 16 MiB, where a sweep of the most points a sweep may hold,
each with its resolved spec, stays under 8 MiB."""
MAX_PROFILE_BYTES = 4 << 20
"""The largest machine profile or saved CPU calibration read (4 MiB; one is a few KiB)."""
MAX_EVENTS_BYTES = 64 << 20
"""How much of an events or evaluation log is read: its last 64 MiB (a year of a step event
each minute is about 50 MiB)."""


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_bounded_bytes(
    path: str | Path, max_bytes: int, what: str = "the file", *, tail: bool = False
) -> bytes:
    """The bytes of `path`, which must be a regular file (never a FIFO that blocks or a device
    that never ends) of at most `max_bytes` bytes; with `tail`, a longer file gives its last
    `max_bytes` instead (a log whose newest lines matter)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BoundedReadError(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise BoundedReadError(
                f"{path}: {what} is {file_kind(status.st_mode)}; give a regular file"
            )
        if tail and status.st_size > max_bytes:
            os.lseek(fd, status.st_size - max_bytes, os.SEEK_SET)
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(max_bytes + (0 if tail else 1))
    except OSError as exc:
        raise BoundedReadError(f"{path}: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise BoundedReadError(
            f"{path}: {what} is larger than {max_bytes:,} bytes, more than any such file needs"
        )
    return data


def read_bounded_text(path: str | Path, max_bytes: int, what: str = "the file") -> str:
    """The UTF-8 text of `path`, which must be a regular file of at most `max_bytes` bytes."""
    data = read_bounded_bytes(path, max_bytes, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BoundedReadError(
            f"{path}: {what} is not UTF-8 text (byte {exc.start} is not)"
        ) from None


def read_bounded_json(path: str | Path, max_bytes: int, what: str = "the file") -> Any:
    """`path` parsed as JSON, within `read_bounded_text`'s bounds and MAX_DEPTH."""
    text = read_bounded_text(path, max_bytes, what)
    try:
        return loads_bounded_json(text)
    except ValueError as exc:
        raise BoundedReadError(f"{path}: {what} is not valid JSON ({exc})") from None


def read_bounded_object(path: str | Path, max_bytes: int, what: str = "the file") -> dict[str, Any]:
    """`path` parsed as a JSON object (a record), within `read_bounded_json`'s bounds."""
    data = read_bounded_json(path, max_bytes, what)
    if not isinstance(data, dict):
        raise BoundedReadError(
            f"{path}: {what} is a JSON {type(data).__name__}, not the object it should be"
        )
    return data


def read_bounded_lines(path: str | Path, max_bytes: int, what: str = "the file") -> list[Any]:
    """The JSON values of a JSON-lines log's last `max_bytes` bytes, oldest first: a line that
    is not JSON, nests past MAX_DEPTH or is cut short (the first of a tail, the last of a log
    whose writer was killed) is skipped. A missing file has no lines."""
    try:
        data = read_bounded_bytes(path, max_bytes, what, tail=True)
    except BoundedReadError:
        if not os.path.lexists(path):
            return []
        raise
    lines = data.split(b"\n")
    with contextlib.suppress(OSError):
        if os.stat(path).st_size > max_bytes:
            lines = lines[1:]  # the tail starts inside a line
    values = []
    for line in lines:
        if not line.strip():
            continue
        try:
            values.append(loads_bounded_json(line.decode("utf-8")))
        except ValueError:  # not UTF-8 or not JSON: a line no writer of ours made
            continue
    return values


def loads_bounded_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing (ValueError) a document nested deeper than `max_depth` or holding
    text that is not Unicode (a lone surrogate escape such as \\ud800, which no file or
    terminal can take)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than Python reads, far more than {max_depth}") from None
    depth = value_depth(data)
    if depth > max_depth:
        raise ValueError(f"nested {depth} deep, more than the {max_depth} allowed")
    if _SURROGATE_ESCAPE.search(text) and _holds_surrogate(data):
        raise ValueError(
            "it holds a lone surrogate escape (\\ud800 to \\udfff), which is not Unicode"
        )
    return data


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a surrogate: only a document holding one can hold a lone surrogate."""


def _holds_surrogate(value: Any) -> bool:
    """Whether any key or string in `value` cannot be encoded as UTF-8 (a lone surrogate)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def value_depth(value: Any) -> int:
    """How deep lists and mappings nest in `value` (0 for a scalar), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


class BoundedYamlError(yaml.YAMLError):
    """A YAML document beyond the bounds (too deep, too many values, a key given twice, a key
    that is not text)."""

    def __init__(self, problem: str, mark: Any = None):
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class BoundedComposer(Composer):
    """PyYAML's composer, counting depth and the values an alias stands for."""

    def compose_document(self) -> Any:
        self._depth = 0
        self._expanded = 0
        self._sizes: dict[int, int] = {}
        self._open_anchors: list[str] = []
        return super().compose_document()

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open_anchors:
                # `&a [*a]` is a value that holds itself: no spec field can be one, and every
                # later step (overrides, validation, rendering) would walk it forever.
                raise BoundedYamlError(
                    f"the alias *{event.anchor} stands for a value that holds it (a recursive "
                    "alias)",
                    event.start_mark,
                )
            node = super().compose_node(parent, index)
            self._count(_tree_size(node, self._sizes), event.start_mark)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise BoundedYamlError(
                f"nested more than {MAX_DEPTH} deep (a spec nests a few levels)", mark
            )
        self._count(1, self.peek_event().start_mark)
        anchor = getattr(self.peek_event(), "anchor", None)
        if anchor is not None:
            self._open_anchors.append(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.pop()

    def _count(self, values: int, mark: Any) -> None:
        self._expanded += values
        if self._expanded > MAX_YAML_NODES:
            raise BoundedYamlError(
                f"more than {MAX_YAML_NODES:,} values with its aliases expanded (an alias "
                "bomb, or far more than a spec holds)",
                mark,
            )


def _tree_size(node: Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for, expanded (memoised per node: aliases share nodes)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1  # a recursive alias counts once, not forever
    total = 1
    if isinstance(node, SequenceNode):
        total += sum(_tree_size(child, sizes) for child in node.value)
    elif isinstance(node, MappingNode):
        total += sum(_tree_size(k, sizes) + _tree_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = min(total, MAX_YAML_NODES + 1)
    return sizes[id(node)]


STR_TAG = "tag:yaml.org,2002:str"
MERGE_TAG = "tag:yaml.org,2002:merge"


def check_mapping_keys(node: MappingNode) -> None:
    """Every key of a mapping is text and appears once (a `<<` merge key aside)."""
    seen: dict[str, Any] = {}
    for key_node, _ in node.value:
        if isinstance(key_node, ScalarNode) and key_node.tag == MERGE_TAG:
            continue
        if not isinstance(key_node, ScalarNode) or key_node.tag != STR_TAG:
            shown = _shown(key_node.value) if isinstance(key_node, ScalarNode) else "a collection"
            raise BoundedYamlError(
                f"the key {shown} is not text (YAML reads it as "
                f"{key_node.tag.rsplit(':', 1)[-1]}); quote it",
                key_node.start_mark,
            )
        key = key_node.value
        if key in seen:
            raise BoundedYamlError(
                f"the key {_shown(key)} appears twice in one mapping (line "
                f"{seen[key].line + 1} and here): the second would silently replace the first",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark


def _shown(key: str, limit: int = 60) -> str:
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TAG_WORDS = {
    "int": "an integer",
    "float": "a number",
    "timestamp": "a date",
    "bool": "true or false",
    "binary": "base64 data",
}


class SentencedConstructor(SafeConstructor):
    """A YAML constructor mixin: a value its tag's constructor rejects outside PyYAML's own
    error type (a 5,000-digit integer, `!!int abc`, an impossible date such as February 30th)
    becomes a BoundedYamlError naming the value and its line, never a ValueError traceback."""

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, OverflowError, TypeError, ArithmeticError) as exc:
            tag = str(node.tag).rsplit(":", 1)[-1]
            shown = _shown(node.value) if isinstance(node, ScalarNode) else "the value"
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "digits" in reason and isinstance(node, ScalarNode):
                # Python's own limit on reading long integers, in its words, names a function.
                reason = f"{len(node.value):,} characters, beyond any field's range"
            raise BoundedYamlError(
                f"{shown} cannot be read as {_TAG_WORDS.get(tag, tag)} ({_clipped(reason)})",
                node.start_mark,
            ) from None


def _clipped(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
