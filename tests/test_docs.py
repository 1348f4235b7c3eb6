"""The documentation stays consistent with the repository (fast; no JAX):

- every `design §X` cited in a .py or .md file of the repository names a heading of
  docs/design.md whose text starts with `X.` (e.g. `### 5b. Block drafters ...`), and so does every
  `§X` inside docs/design.md itself;
- no file of the repository points outside it, at the steering folder beside the checkout;
- README.md has at most 200 lines, and keeps the markers the report generator fills;
- every relative link in README.md and docs/ (markdown `[text](target)`) points to a file or
  folder that exists in the repository, and a link into docs/design.md with `#anchor` names one of
  its headings.

The files are those git knows (tracked, or untracked and not ignored); without git, the
repository's source folders are walked.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
README = REPO / "README.md"
README_MAX_LINES = 200
HEADLINE_MARKERS = ("<!-- headline:start -->", "<!-- headline:end -->")
SOURCE_DIRS = ("specjax", "train", "tools", "tests", "pallas_kernels", "docs", "configs", "models", "bench")
TEXT_SUFFIXES = {".py", ".md", ".json", ".jsonl", ".toml", ".txt", ".sh", ".cfg", ".ini", ".yaml", ".yml",
                 ".ipynb", ".rst"}
TEXT_NAMES = {"Makefile", ".gitignore"}
MAX_TEXT_BYTES = 5 << 20

SECTION = r"\d+[a-z]?"  # 2, 3b, 10
# "design §5b", "design §4, §8", "design §5b and §5c": every § of the run after the word
DESIGN_REF = re.compile(rf"design\s+(§\s*{SECTION}(?:\s*(?:,|and|/|&)\s*§\s*{SECTION})*)")
SECTION_SIGN = re.compile(rf"§\s*({SECTION})\b")
HEADING = re.compile(rf"^(#{{2,4}})\s+({SECTION})\.\s+\S")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def repo_files() -> list[Path]:
    """Files git knows (tracked, or untracked and not ignored); without git, the source folders walked."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout
        files = {REPO / p for p in out.decode("utf-8", "replace").split("\0") if p}
    except (OSError, subprocess.SubprocessError):
        files = {p for d in SOURCE_DIRS for p in (REPO / d).rglob("*") if p.is_file()}
        files |= {REPO / n for n in ("README.md", "Makefile", "pyproject.toml")}
    return sorted(p for p in files if p.is_file())


def text_files(suffixes=None) -> list[Path]:
    out = []
    for p in repo_files():
        if suffixes is not None:
            if p.suffix not in suffixes:
                continue
        elif p.suffix not in TEXT_SUFFIXES and p.name not in TEXT_NAMES:
            continue
        if p.stat().st_size <= MAX_TEXT_BYTES:
            out.append(p)
    return out


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def design_headings() -> dict[str, str]:
    """Section number -> heading line of docs/design.md."""
    heads: dict[str, str] = {}
    for line in read(DESIGN).splitlines():
        m = HEADING.match(line)
        if m:
            assert m.group(2) not in heads, f"docs/design.md: section {m.group(2)} has two headings"
            heads[m.group(2)] = line.strip()
    return heads


def design_refs(text: str) -> list[tuple[int, str]]:
    """(line number, section) of every `design §X` in a text."""
    refs = []
    for m in DESIGN_REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        refs += [(line, s) for s in SECTION_SIGN.findall(m.group(1))]
    return refs


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.lstrip("#").strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def markdown_links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of the links of a markdown text, outside code: fenced blocks, indented
    blocks (4 spaces or a tab after a blank line) and inline code."""
    links, fence, indented, blank = [], False, False, True
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        if fence:
            continue
        indented = line.startswith(("    ", "\t")) and (blank or indented)
        blank = not line.strip()
        if indented:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        links += [(n, t) for t in LINK.findall(line) + IMAGE.findall(line)]
    return links


def doc_pages() -> list[Path]:
    pages = [README] + sorted((REPO / "docs").rglob("*.md"))
    return [p for p in pages if p.is_file()]


# ----------------------------------------------------------------------------- tests

def test_design_has_the_plan_sections():
    heads = design_headings()
    for s in ("1", "2", "3", "3b", "4", "5", "5b", "5c", "5d", "5e", "5f", "6", "7", "8", "9", "10"):
        assert s in heads, f"docs/design.md has no heading '{s}. ...' (## {s}. or ### {s}.)"


def test_every_design_reference_resolves():
    heads = design_headings()
    bad, seen = [], 0
    for p in text_files({".py", ".md"}):
        for line, sec in design_refs(read(p)):
            seen += 1
            if sec not in heads:
                bad.append(f"{p.relative_to(REPO)}:{line}: design §{sec}")
    assert seen > 0, "no `design §X` reference found: is the file list empty?"
    assert not bad, "references to sections docs/design.md does not have:\n" + "\n".join(bad)


def test_design_internal_references_resolve():
    heads = design_headings()
    text = read(DESIGN)
    bad = [f"docs/design.md:{text.count(chr(10), 0, m.start()) + 1}: §{m.group(1)}"
           for m in SECTION_SIGN.finditer(text) if m.group(1) not in heads]
    assert not bad, "docs/design.md cites sections it does not have:\n" + "\n".join(bad)


def test_no_reference_outside_the_repository():
    needle = "../" + "shared"
    me = Path(__file__).resolve()
    bad = []
    for p in text_files():
        if p.resolve() == me:
            continue
        for n, line in enumerate(read(p).splitlines(), start=1):
            if needle in line:
                bad.append(f"{p.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not bad, f"files pointing outside the repository ({needle}):\n" + "\n".join(bad)


def test_readme_is_short():
    n = len(read(README).splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: details go to docs/)"


def test_readme_keeps_the_headline_markers():
    lines = [line.strip() for line in read(README).splitlines()]
    for marker in HEADLINE_MARKERS:
        assert lines.count(marker) == 1, f"README.md must hold the line {marker!r} exactly once"
    assert lines.index(HEADLINE_MARKERS[0]) < lines.index(HEADLINE_MARKERS[1])


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_exist(page):
    repo = REPO.resolve()
    bad = []
    for line, target in markdown_links(read(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ...) or an anchor in the page itself
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:
            continue
        dest = (REPO / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
        dest = dest.resolve()
        if repo not in dest.parents and dest != repo:
            bad.append(f"{page.relative_to(REPO)}:{line}: {target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{page.relative_to(REPO)}:{line}: {target} (no such file)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_links_into_design_name_its_headings():
    anchors = {slug(line) for line in read(DESIGN).splitlines() if line.startswith("#")}
    bad = []
    for page in doc_pages():
        for line, target in markdown_links(read(page)):
            path, _, anchor = target.partition("#")
            if not anchor or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue
            dest = page if not path else (page.parent / path)
            if dest.resolve() == DESIGN.resolve() and anchor not in anchors:
                bad.append(f"{page.relative_to(REPO)}:{line}: {target}")
    assert not bad, "links to headings docs/design.md does not have:\n" + "\n".join(bad)
