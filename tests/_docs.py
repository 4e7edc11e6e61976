"""The fenced code blocks of README.md and docs/, with what their page says about running them.

A block of code (``python``, ``bash``, ``yaml``) runs in a test unless the line right above its fence says why it
cannot run here or which test runs it::

    <!-- not run: needs two nodes of 8 GPUs -->
    <!-- tested by: tests/distributed/test_demo.py::test_demo_report_shows_... -->

``text`` blocks are output (shown, not run); a fence without a language is refused, so none hides code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = ("python", "bash", "yaml")
OUTPUT = ("text",)
_MARKER = re.compile(r"<!-- (not run|tested by): (.+?) -->")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and text, and the marker above it (None: it runs)."""

    page: Path
    line: int
    lang: str
    body: str
    marker: str | None = None
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in CODE and self.marker is None


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        marker = _MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        out.append(
            Block(
                page,
                i + 1,
                opening.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                marker.group(1) if marker else None,
                marker.group(2) if marker else "",
            )
        )
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]
