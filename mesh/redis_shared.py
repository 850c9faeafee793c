"""The shared memory pool and the shared state in Redis, for broker replicas: every replica on
the same Redis (or Redis Cluster) reads and writes the same insights and the same entries and
locks. Their rules are those of the in-memory classes (mesh.core.memory, mesh.core.state);
each operation is one Lua script, and every key carries one hash tag, so that on a cluster all
of them live on one node and a script may touch any of them.

Values are kept as the JSON the client sent and are never re-encoded by a script (Lua's cjson
would round numbers); scripts decode only the small records they decide on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from mesh.core.errors import (
    BrokerUnavailableError,
    StateConflictError,
)
from mesh.core.logthrottle import LogThrottle
from mesh.core.memory import (
    DEFAULT_READ_LIMIT,
    Insight,
    MemoryStats,
    SharedMemoryPool,
    as_stored,
    check_insight_delete,
    check_insight_read,
    insight_evicted,
    insight_from_record,
    insight_record,
    pool_full,
)
from mesh.core.model import JSON
from mesh.core.state import (
    INITIAL_BYTES,
    LOCK_TIMEOUT,
    MAX_WATCHES,
    MAX_WRITERS,
    ChangeKind,
    StateChange,
    StateEntry,
    StateLock,
    StatePage,
    StateWatch,
    Watchers,
    check_delete,
    check_key,
    check_prefix,
    check_write,
    entry_evicted,
    full,
    listing_terms,
    lock_not_held,
    lock_terms,
    locked,
    not_found,
    page_keys,
    page_of,
    shutting_down,
    start_watch,
    too_wide,
    version_conflict,
)
from mesh.core.tasks import cancel_and_wait

if TYPE_CHECKING:
    from mesh.redis_store import RedisQueueStore

logger = logging.getLogger("mesh.state")

PREFIX = "mesh:{shared}:"
INSIGHTS = PREFIX + "insights"
"""Hash: insight id -> the insight as JSON (with its seq, for "newest first")."""
INSIGHT_SEQ = PREFIX + "insight-seq"
INSIGHT_EXPIRY = PREFIX + "insight-expiry"
"""Sorted set: the ids of insights with a ttl, by when they leave (ms since the epoch)."""
TAG_COUNTS = PREFIX + "tag-counts"
SEGMENT_COUNTS = PREFIX + "segment-counts"
WRITER_COUNTS = PREFIX + "writer-counts"
STATE_VALUES = PREFIX + "state-values"
"""Hash: key -> the entry's value, as the writer's JSON."""
STATE_META = PREFIX + "state-meta"
"""Hash: key -> {"version", "updated_by", "updated_at"} and, for an entry with a ttl,
"expires" (ms since the epoch)."""
STATE_EXPIRY = PREFIX + "state-expiry"
"""Sorted set: the keys of entries with a ttl, by when they lapse (ms since the epoch)."""
STATE_SEQ = PREFIX + "state-seq"
"""Counter: the changes made to the shared state, each numbered by it (for watches)."""
STATE_CHANGES = PREFIX + "state-changes"
"""Channel: each change, as [number, kind, key, meta, value], for the watches of every
replica."""
LAPSE_SWEEP_SECONDS = 0.25
"""While a replica has watches, how often it takes out the entries whose ttl ran out (so
that their lapse is told when it happens, not at the next write)."""
LOCKS = PREFIX + "locks"
"""Hash: key -> {"holder", "token", "expires"} (expires in ms since the epoch)."""
UNLOCKED = PREFIX + "unlocked"
"""Channel: a lock was released (its key); lock requests waiting on any replica look again."""
RECHECK_SECONDS = 0.1
"""How long a waiting lock request waits for a release before it looks again anyway (a lock
whose lease lapsed is released by nobody; a release may be missed while a replica
resubscribes)."""

# Every insight script: KEYS = insights, tag counts, segment counts, writer counts, expiry;
# insights whose ttl ended leave first (ARGV now, in ms).
_INSIGHTS_COMMON = """
local function remove_insight(id)
  local raw = redis.call('HGET', KEYS[1], id)
  redis.call('ZREM', KEYS[5], id)
  if not raw then return 0 end
  local it = cjson.decode(raw)
  redis.call('HDEL', KEYS[1], id)
  for _, tag in ipairs(it.tags) do
    redis.call('SREM', 'mesh:{shared}:tag:' .. tag, id)
    if redis.call('HINCRBY', KEYS[2], tag, -1) <= 0 then redis.call('HDEL', KEYS[2], tag) end
  end
  redis.call('SREM', 'mesh:{shared}:segment:' .. it.segment, id)
  if redis.call('HINCRBY', KEYS[3], it.segment, -1) <= 0 then
    redis.call('HDEL', KEYS[3], it.segment)
  end
  if redis.call('HINCRBY', KEYS[4], it.agent_id, -1) <= 0 then
    redis.call('HDEL', KEYS[4], it.agent_id)
  end
  return 1
end
local function purge(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do
    remove_insight(id)
  end
end
"""

# ARGV: now, capacity, id, record JSON, expiry ('' for none). Returns 0 (full: refused), 1
# (written) or the id of the insight a full pool took out to make room: the one with a ttl
# nearest its end.
_WRITE_INSIGHT = (
    _INSIGHTS_COMMON
    + """
purge(tonumber(ARGV[1]))
local made_room = 1
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then
  local nearest = redis.call('ZRANGE', KEYS[5], 0, 0)
  if #nearest == 0 then return 0 end
  remove_insight(nearest[1])
  made_room = nearest[1]
end
local record = cjson.decode(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
for _, tag in ipairs(record.tags) do
  redis.call('SADD', 'mesh:{shared}:tag:' .. tag, ARGV[3])
  redis.call('HINCRBY', KEYS[2], tag, 1)
end
redis.call('SADD', 'mesh:{shared}:segment:' .. record.segment, ARGV[3])
redis.call('HINCRBY', KEYS[3], record.segment, 1)
redis.call('HINCRBY', KEYS[4], record.agent_id, 1)
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[5], ARGV[5], ARGV[3]) end
return made_room
"""
)

# ARGV: now, min importance, agent ('' for any), limit, segment ('' for any), tags...
_READ_INSIGHTS = (
    _INSIGHTS_COMMON
    + """
purge(tonumber(ARGV[1]))
local sets = {}
for i = 6, #ARGV do sets[#sets + 1] = 'mesh:{shared}:tag:' .. ARGV[i] end
if ARGV[5] ~= '' then sets[#sets + 1] = 'mesh:{shared}:segment:' .. ARGV[5] end
local ids
if #sets > 0 then
  ids = redis.call('SINTER', unpack(sets))
else
  ids = redis.call('HKEYS', KEYS[1])
end
local found = {}
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[1], id)
  if raw then
    local it = cjson.decode(raw)
    if it.importance >= tonumber(ARGV[2]) and (ARGV[3] == '' or it.agent_id == ARGV[3]) then
      found[#found + 1] = {it.importance, it.seq, raw}
    end
  end
end
table.sort(found, function(a, b)
  if a[1] ~= b[1] then return a[1] > b[1] end
  return a[2] > b[2]
end)
local out = {}
for i = 1, math.min(#found, tonumber(ARGV[4])) do out[i] = found[i][3] end
return out
"""
)

# ARGV: now, segment ('' for any), agent ('' for any), number of ids n, n ids, tags...
_DELETE_INSIGHTS = (
    _INSIGHTS_COMMON
    + """
purge(tonumber(ARGV[1]))
local n = tonumber(ARGV[4])
local wanted = {}
for i = 5 + n, #ARGV do wanted[#wanted + 1] = ARGV[i] end
local ids = {}
if n > 0 then
  for i = 5, 4 + n do ids[#ids + 1] = ARGV[i] end
else
  local sets = {}
  for _, tag in ipairs(wanted) do sets[#sets + 1] = 'mesh:{shared}:tag:' .. tag end
  if ARGV[2] ~= '' then sets[#sets + 1] = 'mesh:{shared}:segment:' .. ARGV[2] end
  if #sets > 0 then
    ids = redis.call('SINTER', unpack(sets))
  else
    ids = redis.call('HKEYS', KEYS[1])
  end
end
local deleted = 0
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[1], id)
  if raw then
    local it = cjson.decode(raw)
    local has = {}
    for _, tag in ipairs(it.tags) do has[tag] = true end
    local match = (ARGV[2] == '' or it.segment == ARGV[2])
      and (ARGV[3] == '' or it.agent_id == ARGV[3])
    for _, tag in ipairs(wanted) do match = match and has[tag] == true end
    if match then deleted = deleted + remove_insight(id) end
  end
end
return deleted
"""
)

# ARGV: now.
_INSIGHT_STATS = (
    _INSIGHTS_COMMON
    + """
purge(tonumber(ARGV[1]))
return {redis.call('HLEN', KEYS[1]), redis.call('HLEN', KEYS[4]),
  redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3])}
"""
)
_INSIGHT_KEYS = [INSIGHTS, TAG_COUNTS, SEGMENT_COUNTS, WRITER_COUNTS, INSIGHT_EXPIRY]

# What the state's scripts share: each change numbered (KEYS[5]) and told on the channel
# (ARGV[11]); the entries whose ttl ran out taken out (and told).
_TELL_AND_PURGE = """
local function tell(kind, key, meta, value)
  local seq = redis.call('INCR', KEYS[5])
  redis.call('PUBLISH', ARGV[11], cjson.encode({seq, kind, key, meta, value}))
end
local function purge(now)
  local lapsing = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 1000)
  for _, lapsed in ipairs(lapsing) do
    local meta, value = redis.call('HGET', KEYS[2], lapsed), redis.call('HGET', KEYS[1], lapsed)
    redis.call('HDEL', KEYS[1], lapsed)
    redis.call('HDEL', KEYS[2], lapsed)
    redis.call('ZREM', KEYS[4], lapsed)
    if meta and value then tell('lapse', lapsed, meta, value) end
  end
  return #lapsing
end
"""

# KEYS: values, meta, locks, expiry, change counter. ARGV: key, now (ms), agent, token,
# expected version ('' for none), capacity, value JSON, updated_at, 'put' or 'delete', ttl (ms,
# '' for none), the changes' channel.
_WRITE_STATE = (
    _TELL_AND_PURGE
    + """
local key, now, token = ARGV[1], tonumber(ARGV[2]), ARGV[4]
purge(now)
local lock = redis.call('HGET', KEYS[3], key)
local held = nil
if lock then
  held = cjson.decode(lock)
  if held.expires <= now then redis.call('HDEL', KEYS[3], key); held = nil end
end
if token ~= '' then
  if not held or held.token ~= token then return {'LOCK_NOT_HELD'} end
elseif held then
  return {'STATE_LOCKED', held.holder, tostring(held.expires)}
end
local meta = redis.call('HGET', KEYS[2], key)
local version = 0
if meta then version = cjson.decode(meta).version end
if ARGV[5] ~= '' and tonumber(ARGV[5]) ~= version then
  return {'VERSION_CONFLICT', tostring(version)}
end
if ARGV[9] == 'delete' then
  if not meta then return {'STATE_NOT_FOUND'} end
  local old = redis.call('HGET', KEYS[1], key)
  redis.call('HDEL', KEYS[1], key)
  redis.call('HDEL', KEYS[2], key)
  redis.call('ZREM', KEYS[4], key)
  tell('delete', key, meta, old)
  return {'OK', meta, old}
end
local made_room = ''
if not meta and redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[6]) then
  -- Full: the entry with a ttl nearest its end that nobody holds a lock on goes, told as
  -- its lapse (early); with none of those among the nearest 100, the write is refused.
  for _, nearest in ipairs(redis.call('ZRANGE', KEYS[4], 0, 99)) do
    local its = redis.call('HGET', KEYS[3], nearest)
    if not its or cjson.decode(its).expires <= now then
      local gone_meta = redis.call('HGET', KEYS[2], nearest)
      local gone = redis.call('HGET', KEYS[1], nearest)
      redis.call('HDEL', KEYS[1], nearest)
      redis.call('HDEL', KEYS[2], nearest)
      redis.call('ZREM', KEYS[4], nearest)
      if gone_meta and gone then tell('lapse', nearest, gone_meta, gone) end
      made_room = nearest
      break
    end
  end
  if made_room == '' then return {'FULL'} end
end
local record = {version = version + 1, updated_by = ARGV[3], updated_at = ARGV[8]}
if ARGV[10] ~= '' then
  record.expires = now + tonumber(ARGV[10])
  redis.call('ZADD', KEYS[4], record.expires, key)
else
  redis.call('ZREM', KEYS[4], key)
end
local fresh = cjson.encode(record)
redis.call('HSET', KEYS[1], key, ARGV[7])
redis.call('HSET', KEYS[2], key, fresh)
tell('put', key, fresh, ARGV[7])
return {'OK', fresh, ARGV[7], made_room}
"""
)

# KEYS: as for _WRITE_STATE. ARGV[2]: now (ms); ARGV[11]: the changes' channel.
_SWEEP_STATE = (
    _TELL_AND_PURGE
    + """
return purge(tonumber(ARGV[2]))
"""
)

# KEYS: meta, values, change counter. ARGV: prefix, '1' for the entries too, the most JSON
# their values may come to. The number of the last change, then (with the entries) their keys,
# metas and values; {'TOO_WIDE'} past the most.
_WATCH_FROM = """
local seq = tonumber(redis.call('GET', KEYS[3]) or '0')
if ARGV[2] ~= '1' then return {seq} end
local prefix, most, size = ARGV[1], tonumber(ARGV[3]), 0
local keys, metas, values = {}, {}, {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local key = all[i]
  if string.sub(key, 1, #prefix) == prefix then
    local value = redis.call('HGET', KEYS[2], key)
    if value then
      size = size + #value
      if size > most then return {'TOO_WIDE'} end
      keys[#keys + 1], metas[#metas + 1], values[#values + 1] = key, all[i + 1], value
    end
  end
end
return {seq, keys, metas, values}
"""

# KEYS: locks, the key's waiting line. ARGV: key, agent, ticket ("<deadline ms>:<random>"),
# now (ms), lease (ms), max writers, a new token, arrival (the ticket's place in line).
_LOCK = """
local key, agent, ticket, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local all = redis.call('HGETALL', KEYS[1])
local writers, count, held = {}, 0, nil
for i = 1, #all, 2 do
  local l = cjson.decode(all[i + 1])
  if l.expires <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    if not writers[l.holder] then writers[l.holder] = true; count = count + 1 end
    if all[i] == key then held = l end
  end
end
if held and held.holder == agent then
  held.expires = now + tonumber(ARGV[5])
  redis.call('HSET', KEYS[1], key, cjson.encode(held))
  redis.call('ZREM', KEYS[2], ticket)
  return {'GRANTED', held.token, tostring(held.expires)}
end
redis.call('ZADD', KEYS[2], 'NX', ARGV[8], ticket)
redis.call('PEXPIRE', KEYS[2], 60000)
while true do
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not head or head == ticket then break end
  local deadline = tonumber(string.match(head, '^(%d+):'))
  if deadline and deadline < now then redis.call('ZREM', KEYS[2], head) else break end
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if not held and head == ticket and (writers[agent] or count < tonumber(ARGV[6])) then
  local l = {holder = agent, token = ARGV[7], expires = now + tonumber(ARGV[5])}
  redis.call('HSET', KEYS[1], key, cjson.encode(l))
  redis.call('ZREM', KEYS[2], ticket)
  return {'GRANTED', l.token, tostring(l.expires)}
end
if held then return {'WAIT', 'held by ' .. held.holder} end
if head ~= ticket then return {'WAIT', 'other agents were waiting for it first'} end
return {'WAIT', ARGV[6] .. ' agents hold locks already'}
"""

_UNLOCK = """
local lock = redis.call('HGET', KEYS[1], ARGV[1])
if not lock then return 0 end
local held = cjson.decode(lock)
if held.token ~= ARGV[2] or held.expires <= tonumber(ARGV[3]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[4], ARGV[1])
return 1
"""


_STATE_KEYS = [STATE_VALUES, STATE_META, LOCKS, STATE_EXPIRY, STATE_SEQ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class RedisMemoryPool:
    """The shared memory pool of mesh.core.memory, kept in Redis."""

    def __init__(self, store: RedisQueueStore, *, capacity: int = 10_000) -> None:
        self.store = store
        self.rules = SharedMemoryPool(capacity=capacity)  # the validation and the limits
        self.capacity = capacity
        self._evictions = LogThrottle(60.0)

    def _now_ms(self) -> int:
        return int(self.store.now() * 1000)

    async def _eval(self, script: str, *args: Any) -> Any:
        return await self.store._call("eval", script, len(_INSIGHT_KEYS), *_INSIGHT_KEYS, *args)

    async def write(self, insight: Insight) -> Insight:
        self.rules.check(insight)
        seq = int(await self.store._call("incr", INSIGHT_SEQ))
        now = self._now_ms()
        stored = as_stored(insight, seq, _at(now))
        expires = stored.expires_at
        record = {"seq": seq, **insight_record(stored)}
        written = await self._eval(
            _WRITE_INSIGHT, now, self.capacity, stored.insight_id,
            json.dumps(record, default=str),
            int(expires.timestamp() * 1000) if expires else "",
        )  # fmt: skip
        if written == 0:
            raise pool_full(self.capacity)
        if written != 1:
            insight_evicted(self._evictions, _text(written), stored.agent_id, self.capacity)
        return stored

    async def read(
        self,
        *,
        tags: Iterable[str] = (),
        segment: str = "",
        min_importance: float = 0.0,
        limit: int = 0,
        agent_id: str = "",
    ) -> list[Insight]:
        check_insight_read(min_importance, limit)
        found = await self._eval(
            _READ_INSIGHTS, self._now_ms(), repr(float(min_importance)), agent_id,
            limit if limit > 0 else DEFAULT_READ_LIMIT, segment, *dict.fromkeys(tags),
        )  # fmt: skip
        return [insight_from_record(json.loads(_text(raw))) for raw in found]

    async def delete(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> int:
        ids, wanted = list(dict.fromkeys(insight_ids)), list(dict.fromkeys(tags))
        check_insight_delete(ids, wanted, segment, agent_id)
        deleted = await self._eval(
            _DELETE_INSIGHTS, self._now_ms(), segment, agent_id, len(ids), *ids, *wanted
        )
        return int(deleted)

    async def stats(self) -> MemoryStats:
        total, writers, tags, segments = await self._eval(_INSIGHT_STATS, self._now_ms())
        return MemoryStats(
            total_insights=int(total),
            agents_involved=int(writers),
            tag_distribution={_text(k): int(v) for k, v in zip(tags[::2], tags[1::2], strict=True)},
            segment_distribution={
                _text(k): int(v) for k, v in zip(segments[::2], segments[1::2], strict=True)
            },
            capacity=self.capacity,
        )


class RedisSharedState:
    """The shared state of mesh.core.state, kept in Redis: the same versions, compare-and-set,
    locks waited for in order of arrival (at most ``lock_timeout``), and at most
    ``max_writers`` agents holding locks at once, across every replica."""

    def __init__(
        self,
        store: RedisQueueStore,
        *,
        lock_timeout: float = LOCK_TIMEOUT,
        max_writers: int = MAX_WRITERS,
        capacity: int = 10_000,
        max_value_bytes: int = 64 * 1024,
        max_watches: int = MAX_WATCHES,
    ) -> None:
        self.store = store
        self.lock_timeout = lock_timeout
        self.max_writers = max_writers
        self.capacity = capacity
        self.max_value_bytes = max_value_bytes
        self._waiting: set[asyncio.Future[None]] = set()
        """Lock requests of this replica waiting for a release."""
        store.follow(UNLOCKED, self._released)
        self.watchers = Watchers(max_watches)
        self._starting: dict[StateWatch, list[tuple[int, ChangeKind, StateEntry]]] = {}
        """Watches being started: the changes heard meanwhile, told once they are in place."""
        self._cut_off = 0
        """How often this replica lost the changes' channel (a watch begun before one ends)."""
        self._sweeper: asyncio.Task[None] | None = None
        store.follow(STATE_CHANGES, self._changed)
        store.on_gap(self._missed_changes)
        self._evictions = LogThrottle(60.0)

    def _now_ms(self) -> int:
        """Milliseconds since the epoch by the clock the replicas agree on (lock leases are
        set by one replica and judged by another)."""
        return int(self.store.now() * 1000)

    def _released(self, _key: bytes) -> None:
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def get(self, key: str) -> StateEntry:
        check_key(key)
        meta, value = await self.store._call(
            "eval", "return {redis.call('HGET', KEYS[1], ARGV[1]), "
            "redis.call('HGET', KEYS[2], ARGV[1])}", 2, STATE_META, STATE_VALUES, key,
        )  # fmt: skip
        if meta is None:
            raise not_found(key)
        entry = _entry(key, meta, value)
        if entry.expires_at is not None and entry.expires_at.timestamp() <= self.store.now():
            raise not_found(key)  # lapsed: the next write removes it
        return entry

    async def entries(
        self, prefix: str = "", *, page_size: int = 0, page_token: str = ""
    ) -> StatePage:
        """The page's keys are chosen here from all the keys (the shared state holds at most
        ``capacity``); then their entries are read in one script, skipping any deleted or
        lapsed in between."""
        after, limit = listing_terms(prefix, page_size, page_token)
        names = (_text(k) for k in await self.store._call("hkeys", STATE_META))
        keys, last = page_keys(names, prefix, after, limit)
        if not keys:
            return StatePage((), "")
        metas, values = await self.store._call(
            "eval", "return {redis.call('HMGET', KEYS[1], unpack(ARGV)), "
            "redis.call('HMGET', KEYS[2], unpack(ARGV))}", 2, STATE_META, STATE_VALUES, *keys,
        )  # fmt: skip
        now = self.store.now()
        sized = (
            (entry, len(value))
            for key, meta, value in zip(keys, metas, values, strict=True)
            if meta is not None and value is not None
            for entry in (_entry(key, meta, value),)
            if entry.expires_at is None or entry.expires_at.timestamp() > now
        )
        return page_of(prefix, sized, last)

    # -- watches -----------------------------------------------------------------------------

    async def watch(self, prefix: str = "", *, send_initial: bool = False) -> StateWatch:
        """Every replica hears every change, numbered in the order the scripts made them; a
        watch starts after the change numbered when its entries were read (one script), those
        heard meanwhile told after its entries. Refused while this replica is cut off from
        the others' changes (it would be ended as soon as it follows them again)."""
        check_prefix(prefix)
        if self.store.cut_off:
            raise BrokerUnavailableError(
                "this broker is cut off from Redis for a moment and hears no changes to the "
                "shared state: watch again shortly, or through another broker"
            )
        self.watchers.check_room(len(self._starting))
        watch = StateWatch(prefix)
        heard: list[tuple[int, ChangeKind, StateEntry]] = []
        self._starting[watch] = heard
        cut_off = self._cut_off
        try:
            answer = await self.store._call(
                "eval", _WATCH_FROM, 3, STATE_META, STATE_VALUES, STATE_SEQ, prefix,
                "1" if send_initial else "", INITIAL_BYTES,
            )  # fmt: skip
        finally:
            del self._starting[watch]
        if _text(answer[0]) == "TOO_WIDE":
            raise too_wide(prefix)
        if self._cut_off != cut_off:
            raise _missed()
        seq, initial = int(answer[0]), None
        if send_initial:
            now = self.store.now()
            found = sorted(
                (_text(k), meta, value) for k, meta, value in zip(*answer[1:], strict=True)
            )
            initial = [
                (entry, len(value))
                for key, meta, value in found
                for entry in (_entry(key, meta, value),)
                if entry.expires_at is None or entry.expires_at.timestamp() > now
            ]
        start_watch(watch, initial)
        watch.after = seq
        for number, kind, entry in heard:
            if number > seq and entry.key.startswith(prefix):
                watch.offer(StateChange(kind, entry))
        self.watchers.adopt(watch)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_lapses())
        return watch

    def _changed(self, data: bytes) -> None:
        if not self.watchers and not self._starting:
            return
        number, kind_name, key, meta, value = json.loads(data)
        kind, entry = ChangeKind(kind_name), _entry(key, meta, value)
        for heard in self._starting.values():
            heard.append((number, kind, entry))
        self.watchers.publish(kind, entry, number)

    def _missed_changes(self) -> None:
        """The changes' channel was lost (or is back after a loss): what was said in between
        is not heard, and every watch of this replica ends (its watcher watches again)."""
        self._cut_off += 1
        self.watchers.end_all(_missed())

    async def _sweep_lapses(self) -> None:
        """While this replica has watches: takes out the entries whose ttl ran out, so that
        their lapse is told on time (any replica's sweep tells every replica)."""
        while self.watchers or self._starting:
            await asyncio.sleep(LAPSE_SWEEP_SECONDS)
            try:
                await self.store._call(
                    "eval", _SWEEP_STATE, len(_STATE_KEYS), *_STATE_KEYS, "", self._now_ms(),
                    *([""] * 8), STATE_CHANGES,
                )  # fmt: skip
            except BrokerUnavailableError as error:
                logger.debug("could not take out lapsed shared state entries: %s", error)

    async def close(self) -> None:
        self.watchers.close(shutting_down())
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
            self._sweeper = None

    async def put(
        self,
        key: str,
        value: JSON,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
        ttl: float | None = None,
    ) -> StateEntry:
        encoded = check_write(key, value, agent_id, expected_version, self.max_value_bytes, ttl)
        return await self._write("put", key, agent_id, expected_version, lock_token, encoded, ttl)

    async def delete(
        self,
        key: str,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
    ) -> StateEntry:
        check_delete(key, agent_id)
        return await self._write("delete", key, agent_id, expected_version, lock_token, "")

    async def _write(
        self,
        what: str,
        key: str,
        agent_id: str,
        expected_version: int | None,
        lock_token: str,
        encoded: str,
        ttl: float | None = None,
    ) -> StateEntry:
        answer = await self.store._call(
            "eval", _WRITE_STATE, len(_STATE_KEYS), *_STATE_KEYS, key, self._now_ms(), agent_id,
            lock_token, "" if expected_version is None else expected_version, self.capacity,
            encoded, datetime.fromtimestamp(self.store.now(), UTC).isoformat(), what,
            "" if ttl is None else max(1, round(ttl * 1000)), STATE_CHANGES,
        )  # fmt: skip
        outcome = _text(answer[0])
        if outcome == "OK":
            if len(answer) > 3 and answer[3]:  # (a full state took an entry out for it)
                entry_evicted(self._evictions, _text(answer[3]), key, agent_id, self.capacity)
            return _entry(key, answer[1], answer[2])
        if outcome == "LOCK_NOT_HELD":
            raise lock_not_held(key)
        if outcome == "STATE_LOCKED":
            raise locked(key, _text(answer[1]), _at(int(_text(answer[2]))))
        if outcome == "VERSION_CONFLICT":
            raise version_conflict(key, int(_text(answer[1])), expected_version)
        if outcome == "STATE_NOT_FOUND":
            raise not_found(key)
        raise full(self.capacity)

    async def lock(
        self, key: str, agent_id: str, *, wait: float | None = None, lease: float | None = None
    ) -> StateLock:
        wait, lease = lock_terms(key, agent_id, wait, lease, self.lock_timeout)
        deadline = time.monotonic() + wait
        line = f"{PREFIX}waiting:{key}"
        ticket = f"{self._now_ms() + int(wait * 1000) + 1000}:{secrets.token_hex(8)}"
        arrival = int(self.store.now() * 1_000_000)
        token = secrets.token_urlsafe(18)
        loop = asyncio.get_running_loop()
        try:
            while True:
                # Waiting for a release from before the attempt: one published while it runs
                # sends it round again at once.
                released: asyncio.Future[None] = loop.create_future()
                self._waiting.add(released)
                try:
                    answer = await self.store._call(
                        "eval", _LOCK, 2, LOCKS, line, key, agent_id, ticket, self._now_ms(),
                        int(lease * 1000), self.max_writers, token, arrival,
                    )  # fmt: skip
                    if _text(answer[0]) == "GRANTED":
                        expires = _at(int(_text(answer[2])))
                        return StateLock(key, agent_id, _text(answer[1]), expires)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StateConflictError(
                            f"could not lock {key!r} within {wait:g} s: {_text(answer[1])}",
                            reason="LOCK_TIMEOUT",
                        )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(left, RECHECK_SECONDS)):
                            await released
                finally:
                    self._waiting.discard(released)
        finally:
            # Out of the line, granted or not (a ticket left behind would lapse by itself).
            await asyncio.shield(self._leave(line, ticket))

    async def _leave(self, line: str, ticket: str) -> None:
        with contextlib.suppress(BrokerUnavailableError):  # (it lapses at its deadline anyway)
            await self.store._call("zrem", line, ticket)

    async def unlock(self, key: str, token: str) -> None:
        check_key(key)
        released = await self.store._call(
            "eval", _UNLOCK, 1, LOCKS, key, token, self._now_ms(), UNLOCKED
        )
        if not int(released):
            raise lock_not_held(key)


def _missed() -> BrokerUnavailableError:
    return BrokerUnavailableError(
        "this broker missed changes to the shared state (cut off from Redis for a moment): "
        "watch again, with the initial entries, to catch up"
    )


def _entry(key: str, meta: Any, value: Any) -> StateEntry:
    fields = json.loads(_text(meta))
    return StateEntry(
        key=key,
        value=json.loads(_text(value)) if value is not None else None,
        version=int(fields["version"]),
        updated_by=str(fields["updated_by"]),
        updated_at=datetime.fromisoformat(str(fields["updated_at"])),
        expires_at=_at(int(fields["expires"])) if "expires" in fields else None,
    )
