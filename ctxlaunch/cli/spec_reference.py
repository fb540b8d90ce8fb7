"""The job spec's reference page (Markdown), written from the spec's own JSON Schema.

`ctxlaunch schema --markdown` prints it; docs/reference/spec.md is its output, committed, and a
test fails when the two differ. Every field of every section gets a row: its type with the
schema's constraints (enum values, bounds, lengths, patterns), its default and its description,
the docstring under the field. Nested sections (training.data, cluster.kubernetes, ...) get a
table of their own, depth first in the order the fields appear."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

REGENERATE = "ctxlaunch schema --markdown > docs/reference/spec.md"
"""The command that writes the committed page."""

SHORT_DEFAULT = 40
"""A section's default longer than this (as JSON) is left to the section's own table."""


@dataclass(frozen=True)
class _Section:
    """One table of the page: the fields of one object of the spec."""

    ref: str
    """Its $defs entry ('' for the top level)."""
    path: str
    """Where it sits: a dotted path (`training.data`; `[]` marks a list's entries)."""
    label: str
    """What links to it say: the path, or for one variant of a field the value that picks it."""
    title: str
    """The heading's text."""
    schema: dict[str, Any]


def spec_reference(schema: dict[str, Any]) -> str:
    """The reference page of the spec whose JSON Schema is `schema` (as
    `ctxlaunch.contract.spec.json_schema()` returns it)."""
    sections = _sections(schema)
    anchors = {s.ref: heading_anchor(s.title) for s in sections}
    labels = {s.ref: s.label for s in sections}
    lines = [
        "# Job spec reference",
        "",
        f"<!-- Generated from the spec's JSON Schema: do not edit; run `{REGENERATE}`. -->",
        "",
        cell_text(schema.get("description", "")),
        "",
        "A job is one YAML file (`jobs/` holds examples). `ctxlaunch validate SPEC` checks it "
        "and names every problem with its field path, the value, the rule and a fix; unknown "
        "fields are errors. Any field can be overridden on the command line with "
        "`--set path.to.field=value` (a YAML value), e.g. `--set parallel.cp=16`. "
        "`ctxlaunch schema` prints the JSON Schema this page is written from, for editors.",
        "",
        "| section | what it holds |",
        "|---|---|",
    ]
    for section in sections[1:]:
        if "." not in section.path and "[" not in section.path:
            summary = cell_text(_first_sentence(section.schema.get("description", "")))
            lines.append(f"| [`{section.path}`](#{anchors[section.ref]}) | {summary} |")
    links = _Links(anchors, labels, schema.get("$defs", {}))
    for section in sections:
        lines += ["", *_section_lines(section, links)]
    return "\n".join(lines).rstrip() + "\n"


@dataclass(frozen=True)
class _Links:
    """Where each $defs entry's table is, and what a link to it says."""

    anchors: dict[str, str]
    labels: dict[str, str]
    defs: dict[str, Any]

    def to(self, ref: str) -> str:
        return f"[`{self.labels[ref]}`](#{self.anchors[ref]})"


def _sections(schema: dict[str, Any]) -> list[_Section]:
    """Every object of the spec, depth first in field order, each $defs entry once."""
    defs = schema.get("$defs", {})
    found: list[_Section] = []
    seen: set[str] = set()

    def visit(section: _Section) -> None:
        found.append(section)
        for field, prop in section.schema.get("properties", {}).items():
            path = f"{section.path}.{field}" if section.path else field
            visit_refs(prop, path, "")
            if "items" in prop:
                visit_refs(prop["items"], f"{path}[]", "each entry")
            if isinstance(prop.get("additionalProperties"), dict):
                visit_refs(prop["additionalProperties"], f"{path}.<name>", "each value")

    def visit_refs(prop: dict[str, Any], path: str, note: str) -> None:
        key = _discriminator(prop, defs)
        refs = list(_refs(prop))
        for ref in refs:
            if ref in seen:
                continue
            seen.add(ref)
            target = defs[ref]
            value = target.get("properties", {}).get(key, {}).get("const") if key else None
            required = target.get("required", [])
            if value is not None:
                title = f"{path} ({key}: {value})"
                visit(_Section(ref, path, str(value), title, target))
            elif len(refs) > 1 and len(required) == 1:
                # One of several shapes told apart by the one field each requires.
                label = f"{{{required[0]}: ...}}"
                visit(_Section(ref, path, label, f"{path} ({label})", target))
            else:
                visit(_Section(ref, path, path, f"{path} ({note})" if note else path, target))

    visit(_Section("", "", "top level", "Top level", schema))
    return found


def _section_lines(section: _Section, links: _Links) -> list[str]:
    if not section.path:
        lines = ["## Top level", ""]
    else:
        heading = "##" if "." not in section.path and "[" not in section.path else "###"
        path, _, rest = section.title.partition(" (")
        lines = [f"{heading} `{path}`" + (f" ({rest}" if rest else ""), ""]
        if section.schema.get("description"):
            lines += [cell_text(section.schema["description"]), ""]
    choice = _required_choice(section.schema)
    if choice:
        lines += [choice, ""]
    required = set(section.schema.get("required", []))
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for field, prop in section.schema.get("properties", {}).items():
        if field in required:
            default = "required"
        elif "default" in prop:
            default = _default(prop["default"], prop)
        else:
            default = "none"
        description = prop.get("description", "")
        refs = _refs(prop)
        if not description and refs:  # a section: what its own table says it is
            description = _first_sentence(links.defs[refs[0]].get("description", "")) + "."
        description = cell_text(description)
        lines.append(f"| `{field}` | {_type(prop, links)} | {default} | {description} |")
    return lines


def _required_choice(schema: dict[str, Any]) -> str:
    """The sentence for an object that needs one of several sets of fields (the model)."""
    options = [
        option["required"]
        for option in schema.get("anyOf", [])
        if set(option) == {"required"} and option["required"]
    ]
    if not options:
        return ""
    said = [", ".join(f"`{name}`" for name in option) for option in options]
    if len(said) == 1:
        return f"Give {said[0]}."
    return "Give " + "; or ".join(["; ".join(said[:-1]), said[-1]]) + " (all of a set)."


def _type(prop: dict[str, Any], links: _Links) -> str:
    """The field's type with its constraints: a cell of the table."""
    if "$ref" in prop:
        return "section " + links.to(_ref_name(prop["$ref"]))
    if "const" in prop:
        return f"`{_value(prop['const'])}`"
    if "enum" in prop:
        return _either([f"`{_value(v)}`" for v in prop["enum"]])
    alternatives = prop.get("anyOf") or prop.get("oneOf")
    if alternatives:
        discriminator = _discriminator(prop, links.defs)
        if discriminator:
            variants = _either([links.to(ref) for ref in _refs(prop)])
            return f"one of {variants}, chosen by `{discriminator}`"
        null = {"type": "null"}
        parts = [_type(alt, links) for alt in alternatives if alt != null]
        if null in alternatives:
            parts.append("`null`")
        if any(" or " in part for part in parts):
            return "; or ".join(parts)
        return _either(parts)
    kind = prop.get("type")
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(_type(item, links) for item in prop["prefixItems"]) + "]"
        items = prop.get("items", {})
        refs = _refs(items)
        if len(refs) == 1:
            return _constrained("list of entries, see " + links.to(refs[0]), prop)
        if refs:
            return _constrained("list of entries, each " + _type(items, links), prop)
        return _constrained("list of " + (_type(items, links) if items else "any"), prop)
    if kind == "object":
        values = prop.get("additionalProperties")
        if isinstance(values, dict):
            return f"map of string to {_type(values, links)}"
        return "map"
    if kind in ("integer", "number", "string", "boolean"):
        return _constrained(kind, prop)
    return "any"


def _constrained(text: str, prop: dict[str, Any]) -> str:
    """`text` followed by the bounds, lengths and pattern of `prop`."""
    said = []
    low, high = prop.get("minimum"), prop.get("maximum")
    if low is not None and high is not None:
        said.append(f"{_number(low)} to {_number(high)}")
    elif low is not None:
        said.append(f"≥ {_number(low)}")
    elif high is not None:
        said.append(f"≤ {_number(high)}")
    if "exclusiveMinimum" in prop:
        said.append(f"> {_number(prop['exclusiveMinimum'])}")
    if "exclusiveMaximum" in prop:
        said.append(f"< {_number(prop['exclusiveMaximum'])}")
    for key, words in (
        ("minLength", "at least {} characters"),
        ("maxLength", "at most {} characters"),
        ("minItems", "at least {} entries"),
        ("maxItems", "at most {} entries"),
    ):
        if key in prop:
            said.append(words.format(prop[key]))
    if "pattern" in prop:
        said.append(f"matching `{prop['pattern']}`")
    return f"{text} {', '.join(said)}" if said else text


def _default(value: Any, prop: dict[str, Any]) -> str:
    """The default as the table shows it: JSON (which YAML reads the same), or for a section
    with a long default, a pointer to its own table."""
    text = json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict) and value and ("$ref" in prop or len(text) > SHORT_DEFAULT):
        return "its fields' defaults"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{text}`"


def _refs(prop: dict[str, Any]) -> list[str]:
    """The $defs entries a property holds: itself, or its alternatives."""
    if "$ref" in prop:
        return [_ref_name(prop["$ref"])]
    alternatives = prop.get("anyOf", []) + prop.get("oneOf", [])
    return [_ref_name(alt["$ref"]) for alt in alternatives if "$ref" in alt]


def _discriminator(prop: dict[str, Any], defs: dict[str, Any]) -> str | None:
    """The field whose value picks one of a property's alternatives: the schema's
    discriminator, or a field that every alternative fixes to a constant of its own."""
    named = prop.get("discriminator", {}).get("propertyName")
    refs = _refs(prop)
    if named or len(refs) < 2:
        return named
    fields = [defs[ref].get("properties", {}) for ref in refs]
    for name in fields[0]:
        values = [f.get(name, {}).get("const") for f in fields]
        if None not in values and len(set(map(str, values))) == len(values):
            return name
    return None


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _either(parts: list[str]) -> str:
    """a, b or c."""
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " or " + parts[-1]


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _first_sentence(description: str) -> str:
    """The description's first sentence (to its first full stop, colon or semicolon)."""
    text = " ".join(description.split())
    match = re.match(r"(.+?)[.:;](\s|$)", text)
    return match.group(1) if match else text


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def cell_text(description: str) -> str:
    """A docstring as one table cell: its lines joined, its paragraphs kept apart by line
    breaks, and outside code spans what Markdown would read as markup escaped (a pipe would end
    the cell, an asterisk start emphasis, `<name>` an HTML tag)."""
    paragraphs = [" ".join(p.split()) for p in description.strip().split("\n\n")]
    return "<br><br>".join(_escape(p) for p in paragraphs if p)


def _escape(text: str) -> str:
    pieces = _CODE_SPAN.split(text)  # odd pieces are code spans, left as they are
    for index in range(0, len(pieces), 2):
        piece = pieces[index].replace("|", "\\|").replace("*", "\\*")
        pieces[index] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", piece)
    return "".join(pieces)


def heading_anchor(title: str) -> str:
    """The anchor MkDocs' table of contents gives a heading with this text (Python-Markdown's
    `toc.slugify` on ASCII: punctuation dropped, spaces to hyphens, lower case)."""
    text = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", text)
