"""Every link between the README and docs/*.md leads somewhere: a file or folder of the repository
that exists, and, for a ``#fragment``, a heading of the Markdown file it names, spelled as GitHub
spells a heading's anchor. Links to other sites are not followed."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt  # rich's Markdown parser, installed with it

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _tokens(path: Path) -> list:
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


def _inline_text(children: list) -> str:
    """A heading's text as rendered: its words and code spans, without the Markdown around them."""
    return "".join(child.content for child in children if child.type in ("text", "code_inline"))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces made '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    tokens = _tokens(path)
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            anchor = github_anchor(_inline_text(tokens[i + 1].children))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The targets of ``path``'s Markdown links, outside code blocks and code spans."""
    targets = []
    for token in _tokens(path):
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(child.attrs["href"])
    return targets


def broken(path: Path) -> list[str]:
    """``path``'s links to a missing file or a missing heading, each with what is wrong."""
    wrong = []
    for href in links(path):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:  # another site (https:, mailto:): not checked here
            continue
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        shown = target.relative_to(REPO) if target.is_relative_to(REPO) else target
        if not target.exists():
            wrong.append(f"{href}: {shown} does not exist")
        elif parts.fragment and target.suffix == ".md" and unquote(parts.fragment) not in anchors(target):
            wrong.append(f"{href}: {shown} has no heading with the anchor #{parts.fragment}")
    return wrong


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_to_a_file_and_heading_that_exist(path):
    assert broken(path) == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    """The anchors are GitHub's, and a missing file, a missing heading and a link in code are told apart."""
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## `--backend auto`: specdec's kernel, 1.5× faster\n\n## Set up\n\n## Set up\n\n"
                    "[ok](#a-title) [ok](#--backend-auto-specdecs-kernel-15-faster) [ok](#set-up-1) "
                    "[site](https://example.com/x#y) [self](page.md#set-up)\n\n"
                    "[no heading](#nowhere) [no file](other.md) [no heading there](page.md#set-up-2)\n\n"
                    "`[in code](#code)`\n\n```\n[in a block](#block)\n```\n", encoding="utf-8")
    assert anchors(page) == {"a-title", "--backend-auto-specdecs-kernel-15-faster", "set-up", "set-up-1"}
    assert [w.split(":")[0] for w in broken(page)] == ["#nowhere", "other.md", "page.md#set-up-2"]
