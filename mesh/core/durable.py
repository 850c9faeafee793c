"""The durable queue store: the in-memory store, journalled to SQLite so it survives a crash.

The working set stays in memory (the same heaps, the same order and limits); every change is
recorded in a journal that one writer thread applies to an SQLite database in WAL mode. The
broker calls :meth:`SqliteQueueStore.sync` before it tells a sender that a message was
accepted, so an accepted message is on disk before anyone knows it exists. Changes that can
be lost without losing a message (a lease, an acknowledgement) are written in the next batch
rather than waited for: after a crash such a message is delivered again, with the same id,
which at-least-once delivery allows.

Commits are grouped: whatever was recorded while the previous commit ran goes into the next
one, so a burst of senders shares commits instead of queueing behind one commit each.
On start, the store is rebuilt from the database: waiting and leased messages come back
queued, in their places, with their delivery attempts and what remains of their TTL; one
nacked with a delay first waits out what remains of it.

The same database keeps the broker's shared state and shared memory pool
(:meth:`SqliteQueueStore.shared_memory`): each write is committed before it is answered, and
a restarted broker starts from what they held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Collection
from datetime import datetime
from pathlib import Path
from typing import Any

from mesh.core.errors import BrokerUnavailableError
from mesh.core.memory import (
    Insight,
    MemoryPool,
    SharedMemoryPool,
    insight_from_record,
    insight_number,
    insight_record,
)
from mesh.core.model import AgentInfo, DeadLetter, Message
from mesh.core.queue import InMemoryQueueStore, QueueStore, StoredEntry
from mesh.core.state import SharedState, StateEntry, StateStore, entry_from_record, entry_record

logger = logging.getLogger("mesh.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    agent_id TEXT NOT NULL,
    message_id TEXT NOT NULL,
    accepted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    body TEXT NOT NULL,
    not_before REAL,
    PRIMARY KEY (agent_id, message_id)
);
CREATE TABLE IF NOT EXISTS agents (
    agent_id TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS state (
    key TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS insights (
    insight_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    dead_lettered_at TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


def _unavailable(error: BaseException) -> BrokerUnavailableError:
    """The durable store could not write: the message was not accepted."""
    return BrokerUnavailableError(
        f"the queue store cannot write: {error}", reason="STORE_UNAVAILABLE"
    )


Op = tuple[Any, ...]


class SqliteJournal:
    """Applies store changes to SQLite from one writer thread, in order, in grouped commits."""

    def __init__(self, path: str | Path, *, max_dead_letters: int, flush_interval: float = 0.05):
        self.path = str(path)
        self.max_dead_letters = max_dead_letters
        self.flush_interval = flush_interval
        self.commits = 0
        self._ops: list[Op] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._writing = False
        """The writer holds changes it has not committed yet."""
        self._failure: BaseException | None = None
        self._db = self._open()
        self._thread = threading.Thread(target=self._run, name="mesh-store-writer", daemon=True)

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a commit survives the process being killed (it is in the
            # WAL file once written); only a power cut can lose the last commits.
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
            if "not_before" not in columns:  # (a database of an earlier version)
                db.execute("ALTER TABLE messages ADD COLUMN not_before REAL")
        except sqlite3.DatabaseError as error:  # (not a database, or not one of ours)
            raise BrokerUnavailableError(
                f"the SQLite queue store {self.path} cannot be used: {error}",
                reason="STORE_UNAVAILABLE",
            ) from None
        return db

    # -- reading back --------------------------------------------------------------------

    def load_agents(self) -> list[AgentInfo]:
        return [
            AgentInfo.from_dict(json.loads(body))
            for (body,) in self._db.execute("SELECT body FROM agents ORDER BY agent_id")
        ]

    def load_state(self) -> list[StateEntry]:
        return [entry_from_record(body) for (body,) in self._db.execute("SELECT body FROM state")]

    def load_insights(self) -> list[Insight]:
        """The insights kept, oldest first."""
        return [
            insight_from_record(json.loads(body))
            for (body,) in self._db.execute("SELECT body FROM insights ORDER BY seq")
        ]

    def load(self) -> tuple[list[StoredEntry], list[tuple[str, DeadLetter]]]:
        """What the database holds: messages in acceptance order, and the dead letters."""
        entries = [
            StoredEntry(_message(body), agent_id, accepted, expires, attempts, not_before)
            for agent_id, accepted, expires, attempts, body, not_before in self._db.execute(
                "SELECT agent_id, accepted_at, expires_at, attempts, body, not_before"
                " FROM messages ORDER BY accepted_at"
            )
        ]
        dead = [
            (
                agent_id,
                DeadLetter(
                    message=_message(body),
                    reason=reason,
                    attempts=attempts,
                    dead_lettered_at=datetime.fromisoformat(when),
                ),
            )
            for agent_id, reason, attempts, when, body in self._db.execute(
                "SELECT agent_id, reason, attempts, dead_lettered_at, body FROM dead_letters "
                "ORDER BY id"
            )
        ]
        return entries, dead

    # -- recording (event-loop thread) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def put(self, entry: StoredEntry) -> None:
        self._record(("put", entry))

    def attempted(self, entry: StoredEntry) -> None:
        self._record(("attempts", entry.agent_id, entry.message.message_id, entry.attempts))

    def deferred(self, agent_id: str, message_id: str, until: float) -> None:
        self._record(("deferred", agent_id, message_id, until))

    def removed(self, agent_id: str, message_id: str) -> None:
        self._record(("delete", agent_id, message_id))

    def dead(self, agent_id: str, dead: DeadLetter) -> None:
        self._record(("dead", agent_id, dead))

    def undead(self, agent_id: str, message_ids: Collection[str]) -> None:
        self._record(("undead", agent_id, list(message_ids)))

    def agent(self, info: AgentInfo) -> None:
        self._record(("agent", info))

    def agent_gone(self, agent_id: str) -> None:
        self._record(("agent_gone", agent_id))

    def state_written(self, entry: StateEntry) -> None:
        self._record(("state", entry.key, entry_record(entry)))

    def state_gone(self, key: str) -> None:
        self._record(("state_gone", key))

    def insight_written(self, insight: Insight) -> None:
        body = json.dumps(insight_record(insight), default=str, separators=(",", ":"))
        self._record(("insight", insight.insight_id, insight_number(insight.insight_id), body))

    def insights_gone(self, insight_ids: list[str]) -> None:
        self._record(("insights_gone", insight_ids))

    def _record(self, op: Op) -> None:
        with self._lock:
            self._ops.append(op)

    async def sync(self) -> None:
        """Returns once everything recorded so far is committed."""
        if self._failure is not None:
            raise _unavailable(self._failure)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if not self._ops and not self._writing:
                return
            self._waiters.append(future)
        self._wake.set()
        await future

    def close(self) -> None:
        """Commits what is pending, then stops the writer and closes the database."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._commit(self._take()[0])
        self._db.close()

    # -- writing (writer thread) ---------------------------------------------------------

    def _take(self) -> tuple[list[Op], list[asyncio.Future[None]]]:
        with self._lock:
            ops, self._ops = self._ops, []
            waiters, self._waiters = self._waiters, []
            self._writing = bool(ops)
        return ops, waiters

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            closing = self._closing
            ops, waiters = self._take()
            error: BaseException | None = None
            if ops:
                try:
                    self._commit(ops)
                except Exception as exc:  # reported to every waiter, and to later syncs
                    logger.exception("the queue store failed to commit %d changes", len(ops))
                    error = self._failure = exc
            del ops  # what was written is not kept until the next batch
            with self._lock:
                self._writing = False
            for future in waiters:
                loop = future.get_loop()
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_settle, future, error)
            if closing:
                return

    def _commit(self, ops: list[Op]) -> None:
        if not ops:
            return
        db = self._db
        db.execute("BEGIN")
        try:
            for op in ops:
                kind = op[0]
                if kind == "put":
                    entry: StoredEntry = op[1]
                    db.execute(
                        "INSERT OR REPLACE INTO messages (agent_id, message_id, accepted_at,"
                        " expires_at, attempts, body, not_before) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            entry.agent_id,
                            entry.message.message_id,
                            entry.accepted_at,
                            entry.expires_at,
                            entry.attempts,
                            json.dumps(entry.message.to_dict(), separators=(",", ":")),
                            entry.not_before,
                        ),
                    )
                elif kind == "attempts":  # (leased, or back in its place: not deferred)
                    db.execute(
                        "UPDATE messages SET attempts = ?, not_before = NULL"
                        " WHERE agent_id = ? AND message_id = ?",
                        (op[3], op[1], op[2]),
                    )
                elif kind == "deferred":
                    db.execute(
                        "UPDATE messages SET not_before = ? WHERE agent_id = ? AND message_id = ?",
                        (op[3], op[1], op[2]),
                    )
                elif kind == "delete":
                    db.execute(
                        "DELETE FROM messages WHERE agent_id = ? AND message_id = ?",
                        (op[1], op[2]),
                    )
                elif kind == "agent":
                    info: AgentInfo = op[1]
                    db.execute(
                        "INSERT OR REPLACE INTO agents VALUES (?, ?)",
                        (info.agent_id, json.dumps(info.to_dict())),
                    )
                elif kind == "agent_gone":
                    db.execute("DELETE FROM agents WHERE agent_id = ?", (op[1],))
                elif kind == "dead":
                    dead: DeadLetter = op[2]
                    db.execute(
                        "INSERT INTO dead_letters "
                        "(agent_id, reason, attempts, dead_lettered_at, body) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (
                            op[1],
                            dead.reason,
                            dead.attempts,
                            dead.dead_lettered_at.isoformat(),
                            json.dumps(dead.message.to_dict(), separators=(",", ":")),
                        ),
                    )
                    db.execute(
                        "DELETE FROM dead_letters WHERE id <= "
                        "(SELECT MAX(id) FROM dead_letters) - ?",
                        (self.max_dead_letters,),
                    )
                elif kind == "state":
                    db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (op[1], op[2]))
                elif kind == "state_gone":
                    db.execute("DELETE FROM state WHERE key = ?", (op[1],))
                elif kind == "insight":
                    db.execute("INSERT OR REPLACE INTO insights VALUES (?, ?, ?)", op[1:])
                elif kind == "insights_gone":
                    db.executemany(
                        "DELETE FROM insights WHERE insight_id = ?", [(i,) for i in op[1]]
                    )
                elif kind == "undead":
                    db.executemany(
                        "DELETE FROM dead_letters WHERE agent_id = ? "
                        "AND json_extract(body, '$.message_id') = ?",
                        [(op[1], message_id) for message_id in op[2]],
                    )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.commits += 1


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(_unavailable(error))


def _message(body: str) -> Message:
    return Message.from_dict(json.loads(body))


class SqliteQueueStore(InMemoryQueueStore):
    """The in-memory store with an SQLite journal: accepted messages survive a crash."""

    durable = True
    group_commit = True

    def __init__(self, path: str | Path, **options: Any) -> None:
        flush_interval = options.pop("flush_interval", 0.05)
        max_dead_letters = options.get("max_dead_letters", 10_000)
        journal = SqliteJournal(
            path, max_dead_letters=max_dead_letters, flush_interval=flush_interval
        )
        super().__init__(**options)
        entries, dead = journal.load()
        for entry in entries:
            self.restore(entry)
        for agent_id, letter in dead:
            self.restore_dead_letter(agent_id, letter)
        self.restored = len(entries)
        self._agents = journal.load_agents()
        self.journal = journal
        self._journal = journal
        journal.start()
        if entries:
            logger.info("queue store %s: %d messages restored", path, len(entries))

    async def sync(self) -> None:
        await self.journal.sync()

    def shared_memory(
        self, *, max_insights: int = 10_000, max_state_entries: int = 10_000
    ) -> tuple[MemoryPool, StateStore]:
        """The shared memory pool and shared state, kept in the same database: what was
        written survives a restart, as the queues do (a lock, a lease, does not)."""
        return (
            SharedMemoryPool(
                capacity=max_insights,
                journal=self.journal,
                restored=self.journal.load_insights(),
            ),
            SharedState(
                capacity=max_state_entries,
                journal=self.journal,
                restored=self.journal.load_state(),
            ),
        )

    async def saved_agents(self) -> list[AgentInfo]:
        return list(self._agents)

    async def close(self) -> None:
        await asyncio.to_thread(self.journal.close)


def _redis(url: str, options: dict[str, Any]) -> QueueStore:
    from mesh.redis_store import RedisQueueStore  # the Redis client is needed only here

    return RedisQueueStore(url, **options)


def open_store(url: str, **options: Any) -> QueueStore:
    """The queue store a URL names: ``memory://``, ``sqlite:///path/to/queues.db``, or
    ``redis://host:6379/0`` (``rediss://`` for TLS), shared by broker replicas."""
    factories: dict[str, Callable[[str], QueueStore]] = {
        "memory": lambda _: InMemoryQueueStore(**options),
        "sqlite": lambda rest: SqliteQueueStore(rest, **options),
        "redis": lambda _: _redis(url, options),
        "rediss": lambda _: _redis(url, options),
    }
    if "://" not in url and url.endswith((".db", ".sqlite", ".sqlite3")):
        url = f"sqlite://{url}"  # a bare file path names the durable store
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in factories:
        raise ValueError(
            f"unknown queue store {url!r}: use memory://, sqlite:///path/to/queues.db "
            "or redis://host:6379/0"
        )
    # sqlite:///var/lib/q.db is the absolute /var/lib/q.db; sqlite://q.db is relative.
    if scheme == "sqlite" and not rest:
        raise ValueError("sqlite:// needs a file path, e.g. sqlite:///var/lib/agentmesh/q.db")
    return factories[scheme](rest)
