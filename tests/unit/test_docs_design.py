"""docs/DESIGN.md is the one design reference, and every citation of it names a real section.

Code and docs cite the design as `docs/DESIGN.md` (a file a clone has), a section as
`docs/DESIGN.md §<section heading>`, and docs/DESIGN.md cites its own sections as `§<heading>`.
This test reads every text file of the repository and fails on a `DESIGN.md` that is not
`docs/DESIGN.md`, and on a `§` citation whose text does not start with a `##` heading of
docs/DESIGN.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "DESIGN.md"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".flywheel", "build", "dist", "mlruns"}
SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".txt", ".sh", ".html"}
NAMES = {"Makefile", "Dockerfile"}
THIS = Path(__file__).resolve()

NAME = "DESIGN" + ".md"  # spelled apart so this file's own text is not a citation
CITED_AS = "docs/" + NAME


def headings(markdown: str) -> list[str]:
    """The `##` section headings of a markdown text, outside fenced blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            out.append(line[3:].strip())
    return out


def stray_names(text: str) -> list[int]:
    """Offsets of each mention of the design file that is not `docs/<the file>`."""
    bad = []
    for m in re.finditer(re.escape(NAME), text):
        start = m.start()
        if text[max(0, start - 5) : start] != "docs/":
            bad.append(start)
    return bad


def bad_sections(text: str, known: list[str]) -> list[str]:
    """The cited section texts (after each `§`, whitespace collapsed) that do not start with a
    known heading followed by a character that cannot continue the heading's last word."""
    bad = []
    for m in re.finditer("§", text):
        rest = re.sub(r"\s+", " ", text[m.end() : m.end() + 200])  # a citation may wrap
        if not any(rest.startswith(h) and not rest[len(h) : len(h) + 1].isalnum() for h in known):
            bad.append(rest[:40].splitlines()[0] if rest else "")
    return bad


def citing_files() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS for part in rel.parts) or not path.is_file():
            continue
        if path.resolve() == THIS or (path.suffix not in SUFFIXES and path.name not in NAMES):
            continue
        out.append(path)
    return out


def test_the_design_has_sections():
    known = headings(DESIGN.read_text(encoding="utf-8"))
    assert len(known) >= 10, known
    for section in (
        "Topics",
        "Editor events",
        "Reward spec",
        "Rollout record",
        "Deployment events",
        "Deployment state",
        "Replica status",
        "HTTP APIs",
        "Invariants",
        "Layering",
    ):
        assert section in known, f"docs/{NAME} has no section {section!r}; it has {known}"


def test_every_file_cites_docs_design_and_its_real_sections():
    known = headings(DESIGN.read_text(encoding="utf-8"))
    problems = []
    files = citing_files()
    assert any(p.suffix == ".py" for p in files) and DESIGN in files  # the walk found the tree
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(REPO)
        for offset in stray_names(text):
            line = text.count("\n", 0, offset) + 1
            problems.append(f"{rel}:{line}: cites {NAME} without docs/ (write {CITED_AS})")
        for cited in bad_sections(text, known):
            problems.append(f"{rel}: §{cited!r} names no section of {CITED_AS} (sections: {known})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "stray"),
    [
        (f"see {CITED_AS} for the topics", 0),
        (f"see {NAME} for the topics", 1),
        (f"(../shared/{NAME}) and {CITED_AS}", 1),
        (f'the {NAME} "HTTP API" table, {CITED_AS}', 1),
    ],
)
def test_a_design_name_without_docs_is_found(text, stray):
    assert len(stray_names(text)) == stray


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        (f"{CITED_AS} §Topics", []),
        (f"{CITED_AS} §Rollout record.", []),
        (f"({CITED_AS} §Deployment state)", []),
        (f"{CITED_AS} §Training loop", ["Training loop"]),
        (f"{CITED_AS} §Topicsx", ["Topicsx"]),
        (f'{CITED_AS} §"Topics"', ['"Topics"']),
        (f"{CITED_AS} §", [""]),
        (f"{CITED_AS} §Rollout\n    record", []),
    ],
)
def test_a_section_citation_must_start_with_a_heading(text, bad):
    known = ["Topics", "Rollout record", "Deployment state", "Deployment events"]
    assert bad_sections(text, known) == bad


def test_headings_ignore_fenced_blocks():
    text = "# Title\n## One\n```text\n## not a heading\n```\n## Two words\n### Sub\n"
    assert headings(text) == ["One", "Two words"]
