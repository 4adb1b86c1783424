"""Every relative link in README.md and docs/ resolves: the file (or folder) exists, and a ``#fragment`` names a
heading of the target page (GitHub's anchors). Links inside code blocks and inline code are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str, *, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked (``blank_code``)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "``", line) if blank_code else line))
    return lines


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-', repeats
    numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8"), blank_code=False):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"<[^>]+>", "", heading.group(1)).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    text = page.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{number}: ({target})"
            if not resolved.exists():
                problems.append(f"{where}: {path_part} does not exist (relative to {page.parent.relative_to(ROOT)}/)")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{where}: no heading of {resolved.relative_to(ROOT)} has the anchor #{fragment}")
    return problems


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert not problems, "broken links (fix the path, or the anchor to a heading's):\n" + "\n".join(problems)


def test_the_checker_finds_a_missing_page_and_a_missing_anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "a.md").write_text("# Title\n\n## Reward functions (`reward.function`)\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](guide/a.md) [ok](guide/a.md#reward-functions-rewardfunction) [ok](guide/)\n"
                    "[gone](guide/b.md) [bad anchor](guide/a.md#nope) `[code](not/a/link.md)`\n"
                    "```\n[fenced](not/a/link.md)\n```\n[web](https://example.com/x.md)\n")
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "guide/b.md does not exist" in problems[0]
    assert "#nope" in problems[1]
