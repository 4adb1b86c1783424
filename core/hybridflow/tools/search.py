"""The built-in ``search`` tool: ranked passages from a local corpus file (no network), by term overlap (BM25).

Corpus formats: JSON lines with a ``text`` field (and optional ``title``), or plain text with one passage per
non-empty line. Stability: public. Building a corpus is the user's business.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.tools.base import ToolResult, tool_schema

__all__ = ["SearchTool", "load_corpus"]

_WORD = re.compile(r"\w+")


def _terms(text: str) -> list[str]:
    return [word.lower() for word in _WORD.findall(text)]


def load_corpus(path: str | Path) -> list[str]:
    """Passages of a corpus file (``.jsonl``: ``title``/``text`` fields; anything else: one per line)."""
    corpus_path = Path(path)
    if not corpus_path.is_file():
        raise ConfigError(f"search tool corpus {str(corpus_path)!r} is not a file; set rollout.multi_turn "
                          "tool_options.search.corpus to a .jsonl (title/text) or .txt (one passage a line) file")
    passages: list[str] = []
    for number, line in enumerate(corpus_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if corpus_path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                text = f"{record.get('title', '')}: {record['text']}" if record.get("title") else str(record["text"])
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{corpus_path}:{number}: expected a JSON object with a 'text' field ({exc})") \
                    from exc
            passages.append(text)
        else:
            passages.append(line.strip())
    return passages


class SearchTool:
    """BM25 over the corpus passages; returns the ``top_k`` best, numbered."""

    name = "search"

    def __init__(self, *, corpus: str | Path, top_k: int = 3, **_: Any) -> None:
        self.passages = load_corpus(corpus)
        self.top_k = top_k
        self._docs = [Counter(_terms(passage)) for passage in self.passages]
        self._lengths = [sum(doc.values()) for doc in self._docs]
        self._average = sum(self._lengths) / max(len(self._docs), 1)
        frequency: Counter[str] = Counter()
        for doc in self._docs:
            frequency.update(doc.keys())
        total = len(self._docs)
        self._idf = {term: math.log(1 + (total - n + 0.5) / (n + 0.5)) for term, n in frequency.items()}
        self.description = tool_schema(self.name, "Search a local document collection.",
                                       {"query": {"type": "string", "description": "keywords"}}, ["query"])

    def rank(self, query: str) -> list[int]:
        """Passage indices, best first, that share a term with ``query`` (at most ``top_k``)."""
        terms = _terms(query)
        scores: list[tuple[float, int]] = []
        for index, (doc, length) in enumerate(zip(self._docs, self._lengths)):
            score = 0.0
            for term in terms:
                count = doc.get(term, 0)
                if count:
                    score += self._idf[term] * count * 2.2 / (count + 1.2 * (0.25 + 0.75 * length / self._average))
            if score > 0:
                scores.append((-score, index))
        return [index for _, index in sorted(scores)[: self.top_k]]

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResult(text='Error: search needs {"query": "<keywords>"}.', status="bad_call")
        hits = self.rank(query)
        if not hits:
            return ToolResult(text="No results.")
        return ToolResult(text="\n".join(f"[{rank}] {self.passages[index]}" for rank, index in enumerate(hits, 1)))
