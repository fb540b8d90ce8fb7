"""Reading a file a user names, with bounds: a regular file only (never a FIFO that blocks or a
device that never ends), at most so many bytes, nested at most so deep; YAML with no alias
expanded beyond a bound and no key given twice.

A spec, a sweep, a config.json and the spec a job carries all come through here, so a hostile
or broken file ends in one sentence naming it, never a hang, a MemoryError or a
RecursionError.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
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


def read_bounded_text(path: str | Path, max_bytes: int, what: str = "the file") -> str:
    """The UTF-8 text of `path`, which must be a regular file of at most `max_bytes` bytes."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BoundedReadError(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file"
            )
            raise BoundedReadError(f"{path}: {what} is {kind}; give a regular file")
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(max_bytes + 1)
    except OSError as exc:
        raise BoundedReadError(f"{path}: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise BoundedReadError(
            f"{path}: {what} is larger than {max_bytes:,} bytes, more than any such file needs"
        )
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


def loads_bounded_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing (ValueError) a document nested deeper than `max_depth`."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than Python reads, far more than {max_depth}") from None
    depth = value_depth(data)
    if depth > max_depth:
        raise ValueError(f"nested {depth} deep, more than the {max_depth} allowed")
    return data


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
