"""MkDocs hooks for the docs site (mkdocs.yml names this file under `hooks:`).

The site includes top-level Markdown files verbatim (BENCHMARKS.md and RELIABILITY.md, through
pymdownx.snippets), and they link the way GitHub reads them: relative to the repository root.
In the site those links must go to the pages that include the files, and a link to any other
file of the repository (a benchmark script, a test) has no page to go to. So on the pages that
include them, after the snippets are expanded and before MkDocs checks the links, each such
link is rewritten:

- to an included file: the page that includes it (`RELIABILITY.md#x` -> `reliability.md#x`);
- into the docs folder: the same file there (`docs/img/a.png` -> `img/a.png`);
- to another file that exists in the repository: its text, the path in code, unlinked.

A link to a file that exists nowhere is left alone, so `mkdocs build --strict` still fails on it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

ROOT = Path(__file__).resolve().parents[2]
DOCS = "docs/"
INCLUDED = {"BENCHMARKS.md": "benchmarks.md", "RELIABILITY.md": "reliability.md"}
"""Top-level file -> the page that includes it (at the top of the docs folder)."""

_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)"
)
_AFTER_SNIPPETS = 31
"""The preprocessor's priority: below pymdownx.snippets' (32), so it sees the included text."""


_page = {"src_uri": ""}
"""The page being converted (MkDocs converts one page at a time, after on_page_markdown)."""


class _RepositoryLinks(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        if _page["src_uri"] not in INCLUDED.values():
            return lines
        return [_LINK.sub(_rewrite, line) for line in lines]


def _rewrite(match: re.Match[str]) -> str:
    target, anchor = match["target"], match["anchor"] or ""
    if "://" in target or target.startswith(("/", "mailto:")) or not (ROOT / target).exists():
        return match[0]
    if target in INCLUDED:
        return f"{match['bang']}[{match['text']}]({INCLUDED[target]}{anchor})"
    if target.startswith(DOCS):
        return f"{match['bang']}[{match['text']}]({target[len(DOCS) :]}{anchor})"
    text = match["text"]
    return text if text.strip("`") != target else f"`{target}`"


class RepositoryLinksExtension(Extension):
    """Registers the rewriting preprocessor."""

    def extendMarkdown(self, md: Markdown) -> None:
        md.preprocessors.register(
            _RepositoryLinks(md), "ctxlaunch_repository_links", _AFTER_SNIPPETS
        )


def on_config(config: Any) -> Any:
    """Add the extension to every page's Markdown."""
    config.markdown_extensions.append(RepositoryLinksExtension())
    return config


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Note which page is about to be converted."""
    _page["src_uri"] = page.file.src_uri
    return markdown
