"""The user-facing docs (docs/**, README.md, benchmarks/README.md): written for users, and their links work.

A user cannot see the machine the figures were taken on, the work sessions that wrote the docs, the
issue tracker's numbers or the design notes the project started from: none of them may be mentioned.
Product words that look alike stay allowed ("Zenoh session", "client session", "session nonce",
random "seeds", upstream issues written `owner/repo#N`, papers cited by name).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "benchmarks" / "README.md"])

#: (what it is, pattern): case-insensitive, matched line by line.
FORBIDDEN = (
    ("a path of the machine the docs were written on", r"(?<![\w.])/(?:work|root|home|tmp)/"),
    ("a work session", r"\b(?:this|previous|earlier|later|prior) (?:work )?sessions?\b"),
    ("a work session", r"\b(?:first|second|third|fourth|fifth|sixth|seventh) session[,:)]"),
    ("a work session", r"\bsessions? ago\b"),
    ("an agent", r"\bagents?\b"),
    ("who worked on it", r"\bother engineers\b|\bthe issue's\b|\bthis branch\b|\bmain's code\b"),
    ("an issue number", r"(?<![\w/])#\d+\b"),
    ("an issue number", r"\bissues? #?\d+\b"),
    ("a seed file", r"\bseed (?:file|document|spec|issue|0\d\d)\b"),
    ("a seed file", r"\bseed §"),
    ("a seed file", r"§\s?\d+(?:\.\d+)* of the seed\b"),
    ("a seed file", r"\bthe seed(?:'s| says| does| lists| asks| lacks| lists)\b"),
    ("a seed file", r"\| seed \|"),
    ("a seed file", r"\b0\d\d_[a-z][a-z0-9_]*"),
    ("a note file", r"\bFACTS\.md\b|\bSTYLE\.md\b|(?-i:\bFACTS\b)"),
)


def _violations(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            m = re.search(pattern, line, flags=re.I)
            if m:
                found.append(f"line {n}: {what}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_mentions_the_machine_a_session_an_agent_an_issue_or_a_seed_file(path):
    found = _violations(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


def test_the_grep_catches_what_it_is_for_and_spares_product_words():
    bad = ["see /work/main/outputs", "run by other agents' jobs", "the third session, 2026-11-23",
           "no GPU was lent to this session", "the fast path (#20)", "fixed in issue 25", "seed 002 §12.1",
           "listen endpoints (seed §12.1)", "as §12.1 of the seed says", "`001_initial.md`", "| seed |",
           "two sessions ago", "`--out /tmp/lzh`", "(FACTS: 118 ms prefill)", "while other engineers ran tests", "at the issue's budget"]
    good = ["one Zenoh session per process", "the client's session nonce", "a new session opens",
            "3 seeds per point, seed pairs", "upstream eclipse-zenoh/zenoh#2787", "[x](protocol.md#11-engines-14)",
            "each session of a robot", "a second session publishing", "nor advance that session", "the sampling seed of a request", "Kairos, Rosa, OxyGen, ActionFlow",
            "`/dev/shm` files", "the facts of a run", "every session closes when its liveliness token is gone"]
    assert all(_violations(line) for line in bad), [line for line in bad if not _violations(line)]
    assert not any(_violations(line) for line in good), [line for line in good if _violations(line)]


# -- relative links ---------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    anchors.update(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    return anchors


def _links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            yield target


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in _links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no {file}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_generated_block_a_make_target_writes_is_in_the_file_it_names():
    """A study rewrites its block between markers (`write_docs_block`); the make targets must name the
    page that holds them, or the run appends a second copy of the section at the end of another page."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"--write-docs (\S+)", makefile))
    assert targets and "docs/benchmarks.md" not in targets
    for target in targets:
        text = (ROOT / target).read_text()
        assert re.search(r"<!-- [\w-]+:begin", text), f"{target} holds no generated block"
    assert "--write-readme README.md" in makefile


#: A benchmark a doc names: `python -m benchmarks.x.y` or a path `benchmarks/x/y.py`.
BENCHMARK = re.compile(r"python -m (benchmarks(?:\.\w+)+)|(?<![\w/.])(benchmarks/[\w/]+\.py)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_a_doc_names_exists_or_is_named_removed(path):
    """A script removed from the tree is named with the commit that removed it (the paragraph or table row
    or table says "removed at"), so a reader knows to recover it with `git show` instead of running it."""
    found = []
    for block in re.split(r"\n\s*\n", path.read_text()):
        for m in BENCHMARK.finditer(block):
            target = ROOT / (m.group(2) or m.group(1).replace(".", "/") + ".py")
            if not (target.exists() or target.with_suffix("").is_dir()) and "removed at" not in block:
                found.append(m.group(0))
    assert not found
