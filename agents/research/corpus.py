"""The research tools, over local data by default: web search and fetch over a snapshot corpus
(behind a provider interface a real search API can implement), document read and grep over a
folder with a SQLite FTS5 index, and a report writer confined to one output folder."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
from collections.abc import Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from mesh.core.errors import shown
from mesh.core.model import JSON
from mesh.core.tools import Tool, ToolFailedError, ToolHost

DATA = Path(__file__).resolve().parents[1] / "data" / "research"
RESEARCH_POLICY: dict[str, list[str]] = {
    "web-search-agent": ["web_search", "web_fetch"],
    "document-analysis-agent": ["read", "grep"],
    "synthesis-agent": [],
    "report-agent": ["write"],
}


class SearchProvider(Protocol):
    """What web search needs; a real search API can implement it."""

    async def search(self, query: str, limit: int) -> list[dict[str, Any]]: ...

    async def fetch(self, url: str) -> dict[str, Any]: ...


def _query_words(text: str) -> list[str]:
    """The words of a query that are searched for: letters and digits, three or more."""
    return [w for w in re.findall(r"[a-zA-Z0-9]+", text.lower()) if len(w) > 2]


def _fts_query(text: str) -> str:
    return " OR ".join(f'"{w}"' for w in _query_words(text)) or '""'


_TOKEN = re.compile(r"[^\W_]+")
_SENTENCE_END = re.compile(r"[.!?]\s|\n")
SNIPPET_TOKENS = 24


def snippet(text: str, words: Collection[str], size: int = SNIPPET_TOKENS) -> str:
    """The run of ``size`` words of ``text`` that holds the most different ``words`` (the
    first such run), with "..." where the text goes on, as FTS5's snippet() shows a hit.
    In time linear in the text: FTS5's own scores every hit against every other near it, and
    took some 40 ms a page of a log that says the searched words on every line."""
    tokens = list(_TOKEN.finditer(text))
    if not tokens:
        return ""
    wanted = set(words)
    hits = [(i, word) for i, token in enumerate(tokens) if (word := token[0].lower()) in wanted]
    best, most = 0, 0
    within: dict[str, int] = {}  # the hits in the run from `first`: word -> count
    end = 0
    for first, first_word in hits:
        while end < len(hits) and hits[end][0] < first + size:
            word = hits[end][1]
            within[word] = within.get(word, 0) + 1
            end += 1
        if len(within) > most:
            best, most = first, len(within)
        within[first_word] -= 1
        if not within[first_word]:
            del within[first_word]
    # The run starts at the beginning of the sentence its first hit is in, when its last
    # hit still falls in it; otherwise a little before its first hit.
    last = max((i for i, _ in hits if best <= i < best + size), default=best)
    start = max(0, best - (size - 1 - (last - best)) // 2)
    for i in range(best, max(0, last - size + 1) - 1, -1):
        if i == 0 or _SENTENCE_END.search(text, tokens[i - 1].end(), tokens[i].start()):
            start = i
            break
    start = max(0, min(start, len(tokens) - size))
    stop = min(len(tokens), start + size)
    if stop == len(tokens):
        return ("... " if start else "") + text[tokens[start].start() :].rstrip()
    return ("... " if start else "") + text[tokens[start].start() : tokens[stop - 1].end()] + " ..."


class _FtsIndex:
    """An in-memory SQLite FTS5 index of (key, title, body) rows."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.execute("CREATE VIRTUAL TABLE docs USING fts5(key UNINDEXED, title, body)")

    def add(self, key: str, title: str, body: str) -> None:
        self.db.execute("INSERT INTO docs VALUES (?, ?, ?)", (key, title, body))

    def search(self, query: str, limit: int) -> list[tuple[str, str, str]]:
        """The ``limit`` best rows for ``query``: their key, title and a snippet."""
        rows = self.db.execute(
            "SELECT key, title, body FROM docs WHERE docs MATCH ? ORDER BY rank LIMIT ?",
            (_fts_query(query), limit),
        ).fetchall()
        words = _query_words(query)
        return [(str(k), str(t), snippet(str(body), words)) for k, t, body in rows]


class SnapshotSearch:
    """Web search and fetch over a JSON snapshot of pages (url, title, published, tier, text).
    A page may carry "latency_ms" to stand for a slow site."""

    def __init__(self, snapshot: Path = DATA / "web_snapshot.json") -> None:
        data = json.loads(snapshot.read_text(encoding="utf-8"))
        self.pages = {p["url"]: p for p in data["pages"]}
        self.index = _FtsIndex()
        for page in self.pages.values():
            self.index.add(page["url"], page["title"], page["text"])

    async def search(self, query: str, limit: int) -> list[dict[str, Any]]:
        hits = await asyncio.to_thread(self.index.search, query, limit)
        return [{"url": url, "title": title, "snippet": snippet} for url, title, snippet in hits]

    async def fetch(self, url: str) -> dict[str, Any]:
        page = self.pages.get(url)
        if page is None:
            raise ToolFailedError(f"{url} is not in the snapshot (HTTP 404)")
        if page.get("latency_ms"):
            await asyncio.sleep(float(page["latency_ms"]) / 1000)
        return {key: page[key] for key in ("url", "title", "published", "tier", "text")}


MAX_PAGE_CHARS = 16_000
"""A page longer than this (a document without form feeds: a log, a book) is split further,
at a line break (else a space) before the bound: every page is one row of the index and one
tool answer, each found, read and cited in bounded time and size."""


def split_pages(text: str, most: int = MAX_PAGE_CHARS) -> list[str]:
    """A document's pages: split by form feeds, then each into pieces of at most ``most``
    characters, ending at a line break where there is one, else at a space."""
    pages: list[str] = []
    for page in text.split("\f"):
        start = 0
        while len(page) - start > most:
            end = start + most
            cut = page.rfind("\n", start + most // 2, end)
            if cut < 0:
                cut = page.rfind(" ", start + most // 2, end)
            cut = end if cut < 0 else cut + 1
            pages.append(page[start:cut])
            start = cut
        pages.append(page[start:])
    return pages


class DocumentFolder:
    """Plain-text documents, pages split by form feeds (and a page past MAX_PAGE_CHARS
    further); optional header lines "Title:", "Date:" and "Tier:" describe a document.
    Indexed with SQLite FTS5."""

    def __init__(self, folder: Path = DATA / "docs") -> None:
        if not folder.is_dir():  # (searched, it would find nothing, and say nothing of why)
            raise ValueError(f"{folder} is not a folder of documents")
        self.folder = folder
        self.documents: dict[str, dict[str, Any]] = {}
        self.index = _FtsIndex()
        for path in sorted(folder.glob("*")):
            if not path.is_file() or path.suffix.lower() not in {".txt", ".md"}:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            meta = dict(re.findall(r"^(Title|Date|Tier):\s*(.+)$", text, flags=re.MULTILINE))
            pages = [
                re.sub(r"^(Title|Date|Tier):.*$", "", p, flags=re.MULTILINE).strip()
                for p in split_pages(text)
            ]
            doc_id = path.stem
            self.documents[doc_id] = {
                "document_id": doc_id,
                "title": meta.get("Title", doc_id),
                "date": meta.get("Date", ""),
                "tier": meta.get("Tier", "unknown").lower(),
                "pages": pages,
            }
            for number, page in enumerate(pages, start=1):
                self.index.add(f"{doc_id}:{number}", meta.get("Title", doc_id), page)

    async def grep(self, pattern: str, limit: int = 20) -> list[dict[str, Any]]:
        hits = await asyncio.to_thread(self.index.search, pattern, limit)
        out = []
        for key, title, snippet in hits:
            doc_id, _, page = key.rpartition(":")
            out.append(
                {"document_id": doc_id, "page": int(page), "title": title, "snippet": snippet}
            )
        return out

    async def read(self, document_id: str, page: int) -> dict[str, Any]:
        doc = self.documents.get(document_id)
        if doc is None or not 1 <= page <= len(doc["pages"]):
            raise ToolFailedError(f"no page {page} in document {document_id!r}")
        return {
            "document_id": document_id,
            "page": page,
            "title": doc["title"],
            "date": doc["date"],
            "tier": doc["tier"],
            "text": doc["pages"][page - 1],
        }


class ReportFolder:
    """Writes files into one folder, never outside it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    async def write(self, filename: str, content: str) -> dict[str, Any]:
        name = Path(filename).name
        if not name or name != filename or name.startswith("."):
            raise ToolFailedError(f"invalid file name {filename!r}: a plain name is required")
        path = self.folder / name
        await asyncio.to_thread(self.folder.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(path.write_text, content, encoding="utf-8")
        # The full path: whoever reads it (a CLI in another folder, a dashboard) finds the file.
        return {"path": str(path.resolve()), "bytes": len(content.encode())}


MAX_HITS = 100
"""Hits a search returns at most, whatever limit its caller asks for."""


def _text(args: dict[str, JSON], name: str, *, empty: bool = False) -> str:
    """A tool's string argument, or a refusal naming it (a business error: asking again
    the same way will not help)."""
    value = args.get(name)
    if not isinstance(value, str) or not (value or empty):
        what = "a string" if empty else "a non-empty string"
        raise ToolFailedError(f"{name} must be {what}, got {shown(value)}")
    return value


def _count(args: dict[str, JSON], name: str, default: int, *, most: int | None = MAX_HITS) -> int:
    """A tool's whole-number argument from 1 (``default`` when absent), at most ``most``."""
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ToolFailedError(f"{name} must be a whole number, got {shown(value)}")
    if value < 1:
        raise ToolFailedError(f"{name} must be at least 1, got {shown(value)}")
    return int(value) if most is None else min(int(value), most)


def research_tools(
    *,
    web: SearchProvider | None = None,
    docs: DocumentFolder | None = None,
    output: Path = Path("research-reports"),
) -> list[Tool]:
    web = web or SnapshotSearch()
    docs = docs if docs is not None else DocumentFolder()
    reports = ReportFolder(output)

    async def web_search(args: dict[str, JSON]) -> JSON:
        return await web.search(_text(args, "query"), _count(args, "limit", 5))

    async def web_fetch(args: dict[str, JSON]) -> JSON:
        page = await web.fetch(_text(args, "url"))
        return {**page, "date_accessed": datetime.now(UTC).date().isoformat()}

    async def grep(args: dict[str, JSON]) -> JSON:
        return await docs.grep(_text(args, "pattern"), _count(args, "limit", 20))

    async def read(args: dict[str, JSON]) -> JSON:
        return await docs.read(_text(args, "document_id"), _count(args, "page", 1, most=None))

    async def write(args: dict[str, JSON]) -> JSON:
        return await reports.write(_text(args, "filename"), _text(args, "content", empty=True))

    return [
        Tool("web_search", "Searches the web (a local snapshot by default)", web_search),
        Tool("web_fetch", "Fetches a web page", web_fetch),
        Tool("grep", "Full-text search over the local documents", grep),
        Tool("read", "Reads one page of a local document", read),
        Tool("write", "Writes a report file to the output folder", write),
    ]


def research_tool_host(
    docs_dir: str | Path | None = None, reports_dir: str | Path = "research-reports"
) -> ToolHost:
    """The research tools as a broker hosts them, each subagent held to its role's tools:
    documents from ``docs_dir`` (default: the shipped sample documents), reports written to
    ``reports_dir``."""
    docs = DocumentFolder(Path(docs_dir)) if docs_dir else DocumentFolder()
    return ToolHost(research_tools(docs=docs, output=Path(reports_dir)), RESEARCH_POLICY)


def tool_host() -> ToolHost:
    """For ``agentmesh broker --tools agents.research:tool_host``, a broker in its own
    process: the research tools over AGENTMESH_DOCS_DIR (default: the shipped documents),
    writing reports to AGENTMESH_REPORTS_DIR (default: ./research-reports)."""
    return research_tool_host(
        os.environ.get("AGENTMESH_DOCS_DIR") or None,
        os.environ.get("AGENTMESH_REPORTS_DIR") or "research-reports",
    )
