"""The generated blocks of a docs page: a benchmark rewrites only the text between its markers.

A block is ``<!-- name:begin ... -->``, the generated text, ``<!-- name:end -->``; the prose around it
is the author's. Every benchmark that writes into a page (`--write-docs FILE`, the README's results
table) goes through :func:`write_docs_block`.
"""

from __future__ import annotations

from pathlib import Path


def write_docs_block(path: Path, begin: str, end: str, content: str, *, heading: str | None = None) -> None:
    """Replace what lies between the `begin` and `end` markers of the markdown file `path` with
    `content` (written as ``begin\\ncontent\\nend``). Where the markers are missing, the block is
    appended under a new ``## heading``, or, without a `heading`, nothing is written and
    `SystemExit` names the markers."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{content}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif heading is not None:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    else:
        raise SystemExit(f"{path}: no generated block (the lines {begin!r} and {end!r})")
    path.write_text(text)
