"""The Redis queue store: queues shared by several broker replicas.

Every queue operation is one Lua script over one agent's keys, so it is atomic, and the keys
carry the agent id as a hash tag (``mesh:{PaymentAgent}:ready``): each script touches one hash
slot, so the store runs on a single Redis, a primary with replicas, Sentinel, or Redis Cluster
sharding the agents over its nodes (found out on connecting). Per agent:

- ``ready``: sorted set of queued messages, scored by priority then timestamp (microseconds
  since 2020, exact in a double), members ``<arrival seq>:<id>`` so equal scores keep arrival
  order (a fifo store scores every message 0: arrival order alone);
- ``leased``: sorted set of leased ids, scored by the end of their lease;
- ``msg`` (id -> message JSON), ``meta`` (id -> expiry, attempts, acceptance, member, score,
  subscriber), ``expiry`` (ids by TTL end), ``dead`` (capped list), ``seq``.

Across agents, each key on its own and never inside a script: ``mesh:total`` counts the
messages held for the broker-wide limit (a put reserves its place there before its script
runs and gives it back when refused; whatever a script removes is given back after it; the
sweeping replica corrects the count should a crashed replica have left it off), ``mesh:queues``
(the agents with queues; an agent that leaves with an empty queue is taken out, and named
again by the put that finds its ``seq`` gone), ``mesh:{mesh:replicas}:busy`` ("mesh:busy":
the queues that may hold messages, which sweeps go through, kept beside the heartbeats; a
sweep that finds a queue empty deletes its ``seq`` and takes it out, and the put that finds
``seq`` gone names it again before its sender hears back; every ``FULL_SWEEP_SECONDS`` a
sweep goes through every queue), ``mesh:agents``
(registrations), ``mesh:route:...`` (which replica waits for an answer), ``mesh:replicas``
(heartbeats).
Pub/sub tells the replicas what happened elsewhere: ``mesh:wake`` (``<replica>\n<agent>``: a
message was queued, or handed back for another delivery, for an agent through that replica:
the others wake their subscribers of the agent now, no polling),
``mesh:registry`` (an agent registered or left), ``mesh:answer:<replica>`` (an answer for a
request waiting on that replica), ``mesh:released:<replica>`` (a lease held through that
replica ended elsewhere, e.g. by another replica's sweep: its subscription has the credit
back; or it was withdrawn, its requester waiting on another replica: its subscriber is told).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import NoScriptError, RedisError

from mesh.core.errors import BrokerUnavailableError, MessageQueueFullError, message_id_taken
from mesh.core.model import AgentInfo, DeadLetter, Message, Priority, QueuedState
from mesh.core.queue import (
    GIVEN_UP_ROUTE,
    GIVEN_UP_SECONDS,
    MAX_FORWARDS,
    Held,
    Lease,
    Popped,
    QueueStats,
    Released,
    RouteClaim,
    capacity_limits,
)
from mesh.core.tasks import cancel_and_wait, stop_if_cancelled

logger = logging.getLogger("mesh.store.redis")

BASE_US = 1_577_836_800_000_000  # 2020-01-01T00:00:00Z in microseconds
RANK_SPAN = 10**15  # ~31 years of microseconds per priority band, exact in a double
WAKE = "mesh:wake"
RELEASED = "mesh:released:"
REGISTRY = "mesh:registry"
DEFERRED = "~"
"""The subscriber a message nacked with a delay is held by (nobody) until it comes back."""
_LISTED = {"w": QueuedState.WAITING, "f": QueuedState.IN_FLIGHT, "d": QueuedState.DEFERRED}
"""The states the listing script names."""
REGISTRATION_TRIES = 64
"""How often a change to one registration is tried while other replicas' changes come
first (each round, one of the changes racing goes through)."""
TOTAL = "mesh:total"
QUEUES = "mesh:queues"
BUSY = "mesh:{mesh:replicas}:busy"
"""The queues that may hold messages (``mesh:busy`` in the text), in the hash slot of
mesh:replicas: on a cluster, a sweep reads it from the node the heartbeats go to. A command
that meets a dead node makes the cluster client rediscover the cluster before its next
command, the heartbeats' included: read from another node five times a second, it held the
heartbeats up through a failover until the replica looked dead to the others."""
FULL_SWEEP_SECONDS = 10.0
"""Seconds between two sweeps through every queue of mesh:queues (the others go through
mesh:busy alone): what a lost write to mesh:busy (a failover) could leave unswept is swept
then."""
AGENTS = "mesh:agents"
MARK = "mesh:{mesh:agents}:mark"
"""String: a random mark the first replica to find none sets, in the slot of the
registrations (:data:`AGENTS`): a replica that finds another than it saw before knows that
the registrations were lost with it (a Redis, or the cluster node of that slot, restarted
without persistence, or flushed)."""
SUBSCRIBE_CHECK_SECONDS = 2.0
"""How long a new subscription of the replica watcher has to answer its PING."""
REPLICAS = "mesh:replicas"
REPLICA_TIMEOUT_MS = 3000
"""A replica that has not swept (and so beaten) for this long is gone."""
FOLLOW_AGAIN_SECONDS = 0.5
"""How soon a replica that lost its subscription to the others' news subscribes again."""
HANDED_OVER = "mesh:handed-over:"
"""Answers forwarded to a replica (``mesh:handed-over:<replica>``, message id to message),
kept until it has taken them: pub/sub delivers at most once, and a subscription that dies
after Redis counted a PUBLISH loses what it carried. The replica reads what is left here each
time it follows the others again."""
MAX_HANDED_OVER = 10_000
"""Answers kept for one replica at most (more would be for requests it does not hold)."""
HANDED_OVER_KEEP_MS = int(GIVEN_UP_SECONDS * 1000)
"""How long answers kept for a replica outlive the last one forwarded to it: a replica that
is gone (or long cut off) leaves nothing behind for good."""
_HAND_OVER = """
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('PUBLISH', ARGV[5], ARGV[2])
"""
"""Keeps an answer for its replica and publishes it there, in one step: how many heard it, or
-1 when that replica already has MAX_HANDED_OVER answers it has not taken."""
RECONCILE_EVERY = 1.0
"""Seconds between two comparisons of ``mesh:total`` with what the queues hold."""
CLOCK_RTT_SECONDS = 0.25
"""A TIME call that took longer than this says too little about the server's clock."""
FAST_SHARE = 0.9
"""Below this share of the broker-wide limit (by the count last seen), a put reserves its
place in the same round trip as it runs; above it, it reserves first."""

_COMMON = """
local ready, leased, msgs, meta, expiry, dead, seqkey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local gone = 0 -- messages that left the store: their places in mesh:total are given back
-- The subscriber of a message nacked with a delay: held by nobody until its lease ends.
local DEFERRED = '~'
local function drop(id)
  if redis.call('HDEL', msgs, id) == 1 then gone = gone + 1 end
  redis.call('HDEL', meta, id)
  redis.call('ZREM', expiry, id)
end
-- Queued messages past their TTL leave; leased ones wait for their lease to end.
local function expire_due(now, out)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now)) do
    local m = redis.call('HGET', meta, id)
    if not m then
      redis.call('ZREM', expiry, id)
    else
      local info = cjson.decode(m)
      if info.s == '' then
        redis.call('ZREM', ready, info.m)
        table.insert(out, {'expired', id, '', redis.call('HGET', msgs, id)})
        drop(id)
      end
    end
  end
end
-- A lease ends without an ack: back in place, expired, or dead-lettered.
-- unseen: the delivery never reached the application, and does not count as an attempt.
local function give_back(id, now, max_attempts, why, at, max_dead, out, final, unseen)
  local m = redis.call('HGET', meta, id)
  redis.call('ZREM', leased, id)
  if not m then return end
  local info = cjson.decode(m)
  if unseen then info.a = math.max(info.a - 1, 0) end
  local sub = info.s
  if sub == DEFERRED then sub = '' end
  local body = redis.call('HGET', msgs, id)
  if info.e <= now then
    table.insert(out, {'expired', id, sub, body})
    drop(id)
  elseif (final and final ~= '') or info.a >= max_attempts then
    local reason = final
    if not reason or reason == '' then
      reason = why .. ' after ' .. info.a .. ' delivery attempts'
    end
    redis.call('RPUSH', dead, cjson.encode({b = body, r = reason, a = info.a, t = at}))
    redis.call('LTRIM', dead, -max_dead, -1)
    table.insert(out, {'dead', id, sub, body, reason, info.a})
    drop(id)
  else
    -- (a scheduled message, never delivered, is due rather than redelivered)
    local kind = (info.s == DEFERRED and info.a == 0) and 'due' or 'requeued'
    info.s = ''
    redis.call('HSET', meta, id, cjson.encode(info))
    redis.call('ZADD', ready, info.p, info.m)
    table.insert(out, {kind, id, sub, body, '', info.a})
  end
end
-- The first queued message still within its TTL (id, info), taking it off the ready set;
-- the expired ones met on the way leave. nil when none is waiting.
local function next_ready(now, out)
  while true do
    local first = redis.call('ZRANGE', ready, 0, 0)
    if #first == 0 then return nil end
    local id = string.sub(first[1], 22)
    redis.call('ZREM', ready, first[1])
    local m = redis.call('HGET', meta, id)
    if m then
      local info = cjson.decode(m)
      if info.e > now then return id, info end
      table.insert(out, {'expired', id, '', redis.call('HGET', msgs, id)})
      drop(id)
    end
  end
end
local function main()
"""

_END = """
end
local result = main()
return {gone, result}
"""

_PUT = """
local id, body, score, expires, now, limit = ARGV[1], ARGV[2], ARGV[3],
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local held = redis.call('HGET', msgs, id)
if held then
  -- A retried send of the message held (the same sender): taken once. Another sender's
  -- message with this id: refused, with who sent the one held.
  local holder = cjson.decode(held).from_agent
  if holder ~= ARGV[10] then return {-3, {}, holder} end
  return {0, {}}
end
local out = {}
if redis.call('HLEN', msgs) >= limit then
  expire_due(now, out)
  if redis.call('HLEN', msgs) >= limit then return {-1, out, redis.call('HLEN', msgs)} end
end
local seq = redis.call('INCR', seqkey)
local member = string.format('%020d', seq) .. ':' .. id
local due = tonumber(ARGV[11])
local holder = ''
if due > now then
  -- Scheduled: held by nobody until due, as a message nacked with a delay; the sweep puts
  -- it in its place then (and wakes its subscribers).
  holder = DEFERRED
  redis.call('ZADD', leased, due, id)
else
  redis.call('ZADD', ready, score, member)
end
redis.call('HSET', msgs, id, body)
redis.call('HSET', meta, id, cjson.encode(
  {e = expires, a = 0, c = now, m = member, p = score, s = holder, r = tonumber(ARGV[9])}))
redis.call('ZADD', expiry, expires, id)
if holder == '' then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
-- the third answer: the queue's first message (ever, or since it was forgotten)
return {1, out, seq == 1 and 1 or 0}
"""

_FORGET = """
if redis.call('ZCARD', ready) + redis.call('ZCARD', leased) + redis.call('HLEN', msgs)
    + redis.call('LLEN', dead) > 0 then
  return 0
end
redis.call('DEL', seqkey, meta, expiry)
return 1
"""

_LEASE = """
local now, lease_end, subscriber, most = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3],
  tonumber(ARGV[4])
local out, leases = {}, {}
while #leases < most do
  local id, info = next_ready(now, out)
  if not id then break end
  info.a = info.a + 1
  info.s = subscriber
  redis.call('HSET', meta, id, cjson.encode(info))
  redis.call('ZADD', leased, lease_end, id)
  table.insert(leases, {redis.call('HGET', msgs, id), info.a, tostring(info.c)})
end
return {leases, out}
"""

_POP = """
local now, most, room = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out, popped = {}, {}
while most <= 0 or #popped < most do
  local id, info = next_ready(now, out)
  if not id then break end
  local body = redis.call('HGET', msgs, id)
  if room > 0 and #popped > 0 and #body > room then
    redis.call('ZADD', ready, info.p, info.m)  -- does not fit: back in its place
    break
  end
  if room > 0 then room = math.max(1, room - #body) end
  table.insert(popped, {body, tostring(info.c), info.a})
  drop(id)
end
return {popped, out}
"""

_LISTING = """
local out, listed = {}, {}
expire_due(tonumber(ARGV[1]), out)
for _, member in ipairs(redis.call('ZRANGE', ready, 0, -1)) do
  local id = string.sub(member, 22)
  local m = redis.call('HGET', meta, id)
  if m then
    local info = cjson.decode(m)
    table.insert(listed,
      {redis.call('HGET', msgs, id), tostring(info.c), tostring(info.e), info.a, 'w', ''})
  end
end
-- (by the end of the lease or delay, then by id: the sorted set's own order)
local held = redis.call('ZRANGE', leased, 0, -1, 'WITHSCORES')
for i = 1, #held, 2 do
  local id = held[i]
  local m = redis.call('HGET', meta, id)
  if m then
    local info = cjson.decode(m)
    local state = info.s == DEFERRED and 'd' or 'f'
    table.insert(listed, {redis.call('HGET', msgs, id), tostring(info.c), tostring(info.e),
      info.a, state, held[i + 1]})
  end
end
return {listed, out}
"""

_TAKE_BACK = """
local out = {}
for i = 1, #ARGV do
  local m = redis.call('HGET', meta, ARGV[i])
  if m then
    local info = cjson.decode(m)
    if info.s == '' then
      redis.call('ZREM', ready, info.m)
      drop(ARGV[i])
      table.insert(out, ARGV[i])
    end
  end
end
return out
"""

_ACK = """
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  local m = redis.call('ZSCORE', leased, id) and redis.call('HGET', meta, id)
  local info = m and cjson.decode(m)
  if info and info.s == DEFERRED and info.a == 0 then
    -- scheduled, never delivered: nothing to acknowledge
  elseif redis.call('ZREM', leased, id) == 1 then
    table.insert(out, {id, info and info.s or ''})
    drop(id)
  end
end
return out
"""

_WITHDRAW = """
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  local m = redis.call('HGET', meta, id)
  if m then
    local info = cjson.decode(m)
    if info.s == '' then
      redis.call('ZREM', ready, info.m)
    else
      redis.call('ZREM', leased, id)
    end
    table.insert(out, {id, info.s})
    drop(id)
  end
end
return out
"""

_CANCEL = """
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local m = redis.call('HGET', meta, id)
  local body = m and redis.call('HGET', msgs, id)
  if body and cjson.decode(body).from_agent == ARGV[1] then
    local info = cjson.decode(m)
    local taken = false
    if info.s == '' then
      taken = redis.call('ZREM', ready, info.m) == 1
    elseif info.s == DEFERRED then
      taken = redis.call('ZREM', leased, id) == 1
    end -- (in flight: its handler has it)
    if taken then
      table.insert(out, id)
      drop(id)
    end
  end
end
return out
"""

_EXTEND = """
local now, lease_end, count = tonumber(ARGV[1]), tonumber(ARGV[2]), 0
for i = 3, #ARGV do
  local ends = redis.call('ZSCORE', leased, ARGV[i])
  local m = ends and tonumber(ends) > now and redis.call('HGET', meta, ARGV[i])
  -- (one that ended waits for the sweep; a deferred one comes back when its delay ends)
  if m and cjson.decode(m).s ~= DEFERRED then
    redis.call('ZADD', leased, lease_end, ARGV[i])
    count = count + 1
  end
end
return count
"""

_UNDEAD = """
local wanted = {}
for i = 1, #ARGV do wanted[ARGV[i]] = true end
local kept, removed = {}, 0
for _, raw in ipairs(redis.call('LRANGE', dead, 0, -1)) do
  if wanted[cjson.decode(cjson.decode(raw).b).message_id] then
    removed = removed + 1
  else
    table.insert(kept, raw)
  end
end
if removed > 0 then
  redis.call('DEL', dead)
  for i = 1, #kept, 1000 do
    redis.call('RPUSH', dead, unpack(kept, i, math.min(i + 999, #kept)))
  end
end
return removed
"""

_NACK = """
local now, max_attempts, at, max_dead = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3],
  tonumber(ARGV[4])
local final, back_at = ARGV[5], tonumber(ARGV[6])
local out = {}
for i = 7, #ARGV do
  local id = ARGV[i]
  local m = redis.call('ZSCORE', leased, id) and redis.call('HGET', meta, id)
  local info = m and cjson.decode(m)
  if not m then
    redis.call('ZREM', leased, id)  -- (nothing, or a stale entry the sweep would take out)
  elseif info.s == DEFERRED then
    -- nacked with a delay already: it comes back when that ends
  elseif back_at > 0 and final == '' and info.e > now and info.a < max_attempts then
    -- Back in the queue at back_at, held by nobody meanwhile: its subscriber's place in
    -- flight is free now (the 'deferred' event), and the sweep puts it back then.
    table.insert(out, {'deferred', id, info.s, ''})
    info.s = DEFERRED
    redis.call('HSET', meta, id, cjson.encode(info))
    redis.call('ZADD', leased, back_at, id)
  else
    give_back(id, now, max_attempts, 'nacked', at, max_dead, out, final)
  end
end
return out
"""

_RELEASE = """
local now, max_attempts, at, max_dead, subscriber = tonumber(ARGV[1]), tonumber(ARGV[2]),
  ARGV[3], tonumber(ARGV[4]), ARGV[5]
local release_unseen = ARGV[6] == '1'
local seen = {}
for i = 7, #ARGV do seen[ARGV[i]] = true end
local out = {}
for _, id in ipairs(redis.call('ZRANGE', leased, 0, -1)) do
  local m = redis.call('HGET', meta, id)
  if m and cjson.decode(m).s == subscriber then
    local unseen = release_unseen and not seen[id]
    give_back(id, now, max_attempts, 'subscriber left', at, max_dead, out, nil, unseen)
  end
end
return out
"""

_SWEEP = """
local now, max_attempts, at, max_dead = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3],
  tonumber(ARGV[4])
local out = {}
expire_due(now, out)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', leased, '-inf', now)) do
  give_back(id, now, max_attempts, 'lease expired', at, max_dead, out)
end
-- Leases held through a replica that stopped beating come back now, not at their end.
if #ARGV > 4 then
  local gone_replicas = {}
  for i = 5, #ARGV do gone_replicas[ARGV[i]] = true end
  for _, id in ipairs(redis.call('ZRANGE', leased, 0, -1)) do
    local m = redis.call('HGET', meta, id)
    if m then
      local replica = string.match(cjson.decode(m).s, '#([^-#]+)%-%d+$')
      if replica and gone_replicas[replica] then
        give_back(id, now, max_attempts, 'broker replica gone', at, max_dead, out)
      end
    end
  end
end
-- Nothing held: the queue needs no sweeping until its next put, which finds seq gone (its
-- first message again) and has its replica name the queue in mesh:busy.
if redis.call('HLEN', msgs) + redis.call('ZCARD', ready) + redis.call('ZCARD', leased) == 0 then
  redis.call('DEL', seqkey, expiry)
  return {out, 1}
end
return {out, 0}
"""

_STATS = """
local out = {}
expire_due(tonumber(ARGV[1]), out)
local span = tonumber(ARGV[2])
local counts
if ARGV[3] == '1' then
  -- In arrival order every score is 0: the priorities are counted from each message's meta.
  counts = {0, 0, 0}
  for _, member in ipairs(redis.call('ZRANGE', ready, 0, -1)) do
    local m = redis.call('HGET', meta, string.sub(member, 22))
    if m then
      local rank = cjson.decode(m).r or 1
      counts[rank + 1] = counts[rank + 1] + 1
    end
  end
else
  counts = {
    redis.call('ZCOUNT', ready, 0, '(' .. span),
    redis.call('ZCOUNT', ready, span, '(' .. (2 * span)),
    redis.call('ZCOUNT', ready, 2 * span, '+inf'),
  }
end
-- (deferred: held until a time by nobody, counted apart from those in flight)
local deferred = 0
for _, id in ipairs(redis.call('ZRANGE', leased, 0, -1)) do
  local m = redis.call('HGET', meta, id)
  if m and cjson.decode(m).s == DEFERRED then deferred = deferred + 1 end
end
return {
  counts[1],
  counts[2],
  counts[3],
  redis.call('ZCARD', leased) - deferred,
  redis.call('LLEN', dead),
  redis.call('HLEN', msgs),
  out,
  deferred
}
"""

SCRIPTS = {
    name: _COMMON + body + _END
    for name, body in (
        ("put", _PUT),
        ("lease", _LEASE),
        ("pop", _POP),
        ("listing", _LISTING),
        ("take_back", _TAKE_BACK),
        ("ack", _ACK),
        ("extend", _EXTEND),
        ("withdraw", _WITHDRAW),
        ("cancel", _CANCEL),
        ("undead", _UNDEAD),
        ("nack", _NACK),
        ("release", _RELEASE),
        ("sweep", _SWEEP),
        ("stats", _STATS),
        ("forget", _FORGET),
    )
}
"""Each script answers ``{gone, result}``: how many messages left the store, and its result."""
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}


CLIENT_FAULTS = (AttributeError, KeyError, IndexError, TypeError)
"""What redis-py's cluster client has raised from its own code while its map of the cluster
was out of date (a node restarting, replaced or its slots moving: redis/redis-py#3835,
#3815, #2437): the store failing for a moment, as a lost connection is, when raised there."""

OUTAGES: tuple[type[Exception], ...] = tuple(
    getattr(redis.exceptions, name)
    for name in ("SlotNotCoveredError", "RedisClusterUnreachableError")
    if hasattr(redis.exceptions, name)
)
"""What the cluster client raises, outside RedisError, when no node serves a key's slot or
none can be reached at all (RedisClusterUnreachableError, from redis-py 8.2 on, where 8.1
raised a ConnectionError): the store failing, as a lost connection is."""

FAILURES: tuple[type[Exception], ...] = (RedisError, OSError, *OUTAGES, *CLIENT_FAULTS)
"""What a call to Redis may raise when the store fails (see :func:`_failed`)."""

FAILED: tuple[type[Exception], ...] = (*FAILURES, BrokerUnavailableError)
"""FAILURES, or the refusal already made of one."""


def _failed(error: BaseException) -> bool:
    """Whether ``error``, one of FAILURES (or a refusal already made of one), is the store
    failing: a Redis error, a connection's, or a fault raised inside redis-py itself. One
    of CLIENT_FAULTS raised by the mesh's own code is a bug, and no store failure."""
    if isinstance(error, (RedisError, OSError, *OUTAGES, BrokerUnavailableError)):
        return True
    last = error.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    module = last.tb_frame.f_globals.get("__name__", "") if last is not None else ""
    return isinstance(module, str) and module.startswith("redis.")


def _unavailable(error: BaseException) -> BaseException:
    """The refusal a store failure makes (UNAVAILABLE, which clients retry); a bug (see
    :func:`_failed`) stays what it is."""
    if not _failed(error):
        return error
    return BrokerUnavailableError(
        f"the Redis queue store is unavailable: {error}", reason="STORE_UNAVAILABLE"
    )


def _keys(agent_id: str) -> list[str]:
    """One agent's keys, all in one hash slot: the agent id is the hash tag."""
    tag = "{" + agent_id + "}"
    return [
        f"mesh:{tag}:{part}" for part in ("ready", "leased", "msg", "meta", "expiry", "dead", "seq")
    ]


# KEYS: the registrations. ARGV: agent id, its registration as read ('' for none), the one to
# keep ('' for none). 1 when written; 0 when another replica changed it since the read.
_SWAP_AGENT = """
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1])
else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _message(body: Any) -> Message:
    return Message.from_dict(json.loads(body))


def _added(result: Any) -> bool:
    """Whether a put script's result says it added its message (1; 0 is a duplicate, a
    negative number a refusal; an exception, a put that did not run)."""
    return not isinstance(result, BaseException) and int(result[0]) == 1


def _score(message: Message) -> str:
    micros = int(message.timestamp.timestamp() * 1_000_000) - BASE_US
    return str(message.priority.rank * RANK_SPAN + min(max(micros, 0), RANK_SPAN - 1))


def _with_address(url: str, host: str, port: int) -> str:
    """The URL of one node of a cluster: ``url`` (scheme, credentials, options) with its host
    and port replaced, database 0."""
    scheme, _, rest = url.partition("://")
    address, _, query = rest.partition("?")
    credentials = address.rpartition("@")[0]
    at = f"{credentials}@" if credentials else ""
    return f"{scheme}://{at}{host}:{port}/0" + (f"?{query}" if query else "")


def _retry() -> Retry:
    """How a call on a connection Redis has closed (a restart, a failover, a client timeout)
    is made again on a new one: up to 3 times, a few ms apart, so that what a caller sees of
    an outage is its length, not a failure on each pooled connection after it. (redis-py's
    constructor retries by default, ``from_url`` does not.)

    The cluster client is given it too, rather than its default of 10 attempts: from
    redis-py 8.2 on it waits out that default's backoff between them (10 ms doubling to 1 s),
    and a call to a node that is down took 3.4-5.1 s to fail, where with 8.1 it took about
    0.35 s. Meanwhile its caller waited: a client's send, past its deadline, and the watcher
    of the other replicas, whose news (registrations, answers, wake-ups) queued behind one
    look at the registry. With this such a call fails in under 0.2 s (0.25 s more for each
    attempt a cluster missing the node's slots refuses), ``UNAVAILABLE`` to a client, whose
    SDK retries, and the watcher follows again from another node."""
    return Retry(ExponentialWithJitterBackoff(cap=0.1, base=0.01), 3)


async def connect(url: str) -> Any:
    """A client for the Redis the URL names: a cluster client when that Redis is a node of a
    Redis Cluster (asked with ``INFO cluster``), the plain client otherwise."""
    plain = aioredis.from_url(url, decode_responses=False, retry=_retry())
    try:
        info = await plain.info("cluster")
    except BaseException:
        await plain.aclose()
        raise
    if not int(info.get("cluster_enabled", 0)):
        return plain
    await plain.aclose()
    scheme, _, rest = url.partition("://")
    address, _, query = rest.partition("?")
    address = address.split("/", 1)[0]  # a cluster has only database 0
    cluster = RedisCluster.from_url(
        f"{scheme}://{address}" + (f"?{query}" if query else ""),
        decode_responses=False,
        retry=_retry(),
    )
    await cluster.initialize()
    return cluster


@dataclass(slots=True)
class _Put:
    agent_id: str
    args: list[Any]
    total_limit: int
    future: asyncio.Future[Any]
    route: tuple[Any, ...] | None = None
    """The SET that records the route of the request this put queues, sent before it."""


class RedisQueueStore:
    """Queues in Redis, shared by every broker replica that points at the same server or
    cluster."""

    durable = True
    group_commit = False  # (each put has run in Redis when it returns)
    shared = True

    def __init__(
        self,
        url: str,
        *,
        max_messages_per_agent: int = 1000,
        max_total_messages: int = 10_000,
        max_delivery_attempts: int = 4,
        max_dead_letters: int = 10_000,
        retry_after_seconds: float = 0.1,
        low_priority_share: float = 0.8,
        fifo: bool = False,
        wall_clock: Callable[[], datetime] | None = None,
        local_clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.fifo = fifo
        """Queues in arrival order (every score 0: members sort by their arrival number)."""
        self._given_clock = wall_clock
        """A clock that replaces the Redis server's (tests drive time with it)."""
        self._local_clock = local_clock
        self._offset = 0.0
        """The Redis server's clock minus this host's, in seconds (see :meth:`_sync_clock`)."""
        self.max_messages_per_agent = max_messages_per_agent
        self.max_total_messages = max_total_messages
        self.max_delivery_attempts = max_delivery_attempts
        self.max_dead_letters = max_dead_letters
        self.retry_after_seconds = retry_after_seconds
        self._limits, self._low_limits = capacity_limits(
            max_messages_per_agent, max_total_messages, low_priority_share
        )
        self.replica_id = secrets.token_hex(6)
        self.listener: Any = None
        self.cluster = False
        """Whether the Redis is a cluster (known once connected)."""
        self._redis: Any = None
        self._connecting = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        """Beats for this replica on its own, so that a sweep slowed by a failing node does
        not make it look dead to the others."""
        self._pubsub: Any = None
        self._pubsub_client: Any = None
        """On a cluster, the watcher's own connection to one node (see _subscribe)."""
        self._pubsub_turn = 0
        """Which node of a cluster the next subscription goes to (they take turns)."""
        self._early: list[dict[str, Any]] = []
        """Messages read while a new subscription was being checked, not yet handled."""
        self._puts: list[_Put] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._queues_known: set[str] = set()
        self._sampled = -RECONCILE_EVERY
        self._swept_all_at = -FULL_SWEEP_SECONDS
        """When (monotonic) a sweep last went through every queue."""
        self._unreleased = 0
        self._releasing: asyncio.Task[None] | None = None
        self._notices: list[tuple[str, str]] = []
        """(channel, payload) to publish for the other replicas, off the caller's path."""
        self._notifying: asyncio.Task[None] | None = None
        self._drift: list[int] = []
        self._seen_total = max_total_messages  # unknown: the first puts reserve first
        self._beating_since: int | None = None
        """Since when this replica's beats have reached the store without a break (ms)."""
        self._last_beat = 0
        """When this replica last beat (ms)."""
        self._followed: dict[str, Callable[[bytes], None]] = {}
        """Channels of other parts of the mesh kept in this Redis, and their handlers."""
        self._refollowed: list[Callable[[], None]] = []
        self.cut_off = False
        """Whether this replica has lost the others' channels (and not followed them again
        yet): what is published meanwhile is not heard here."""
        self._taking_over: asyncio.Task[None] | None = None
        """Reading the answers kept for this replica after it followed the others again."""
        self._taken: list[str] = []
        """Ids of answers forwarded to this replica and heard: to be no longer kept for it."""
        self._forgetting: asyncio.Task[None] | None = None
        self._mark: str | None = None
        """The store's :data:`MARK` as this replica last saw it."""

    def follow(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Calls ``handler`` with what is published on ``channel`` once this replica watches
        the others (:meth:`watch`; a channel followed later is heard after a resubscription)."""
        self._followed[channel] = handler

    def on_gap(self, hook: Callable[[], None]) -> None:
        """Calls ``hook`` when this replica loses the others, and again when it follows them
        once more: what was published on the channels it follows in between was not heard."""
        self._refollowed.append(hook)

    def shared_memory(
        self, *, max_insights: int = 10_000, max_state_entries: int = 10_000
    ) -> tuple[Any, Any]:
        """The shared memory pool and shared state, in this Redis: every replica sees the
        same insights, entries and locks."""
        from mesh.redis_shared import RedisMemoryPool, RedisSharedState

        return (
            RedisMemoryPool(self, capacity=max_insights),
            RedisSharedState(self, capacity=max_state_entries),
        )

    # -- plumbing --------------------------------------------------------------------------

    async def _client(self) -> Any:
        if self._redis is not None:
            return self._redis
        async with self._connecting:
            if self._redis is None:
                try:
                    client = await connect(self.url)
                except FAILURES as error:
                    raise _unavailable(error) from None
                for _ in range(3):  # (a busy moment can slow one call down)
                    if await self._sync_clock(client):
                        break
                self._redis = client
                self.cluster = isinstance(client, RedisCluster)
        return self._redis

    async def _load_scripts(self, client: Any) -> None:
        for source in SCRIPTS.values():
            await client.script_load(source)  # on a cluster: on every primary

    async def _run(self, name: str, agent_id: str, args: Iterable[Any]) -> Any:
        """Runs one script over one agent's keys; reports what it removed; its result."""
        keys = _keys(agent_id)
        args = list(args)
        client = await self._client()
        try:
            try:
                gone, result = await client.evalsha(SHAS[name], len(keys), *keys, *args)
            except NoScriptError:  # a restarted or new node: load the scripts, once
                await self._load_scripts(client)
                gone, result = await client.evalsha(SHAS[name], len(keys), *keys, *args)
        except FAILURES as error:
            raise _unavailable(error) from None
        self._release(int(gone))
        return result

    async def _run_many(
        self,
        name: str,
        calls: list[tuple[str, list[Any]]],
        before: list[tuple[Any, ...]] | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Runs a script for many agents in one pipeline (on a cluster, one per node, side by
        side), after the plain commands ``before``; returns their answers, and for each
        script its result or the exception it raised."""
        client = await self._client()
        answers: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        first: list[Any] = []
        for attempt in range(2):
            try:
                pipe = client.pipeline(transaction=False)
                for command in before if attempt == 0 and before else ():
                    pipe.execute_command(*command)
                for i in todo:
                    keys = _keys(calls[i][0])
                    # (the cluster pipeline refuses evalsha by name, not the command itself:
                    # every key of a call is in one slot, so it goes to that slot's node)
                    pipe.execute_command("EVALSHA", SHAS[name], len(keys), *keys, *calls[i][1])
                results = await pipe.execute(raise_on_error=False)
            except FAILURES as error:
                raise _unavailable(error) from None
            if attempt == 0 and before:
                first, results = results[: len(before)], results[len(before) :]
                for result in first:
                    if isinstance(result, BaseException):
                        raise _unavailable(result)
            missing = []
            for i, result in zip(todo, results, strict=True):
                if isinstance(result, NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(result, BaseException):
                    answers[i] = _unavailable(result)
                else:
                    gone, answers[i] = result
                    self._release(int(gone))
            if not missing:
                break
            await self._load_scripts(client)
            todo = missing
        return first, answers

    async def _call(self, method: str, *args: Any, **options: Any) -> Any:
        client = await self._client()
        try:
            return await getattr(client, method)(*args, **options)
        except FAILURES as error:
            raise _unavailable(error) from None

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def now(self) -> float:
        """The time every replica agrees on, in seconds since the epoch: the Redis server's
        clock, as this host's clock corrected by their difference (measured on connecting
        and after each heartbeat of its own, once a second). Lease ends, TTLs, heartbeats
        and lock leases are all set by one replica and judged by another: by each host's
        own clock, a host running 5 s behind would hand its leases back to the others as
        soon as it took them, and look dead to them."""
        if self._given_clock is not None:
            return self._given_clock().timestamp()
        return self._local_clock() + self._offset

    def _wall(self) -> datetime:
        return datetime.fromtimestamp(self.now(), UTC)

    def _now_ms(self) -> int:
        return int(self.now() * 1000)

    async def _sync_clock(self, client: Any) -> bool:
        """Measures the Redis server's clock against this host's, halfway through a TIME
        call. On a cluster, the clock of the node that keeps the heartbeats (every replica
        asks the same one, which has just answered this replica's beat: TIME sent to any
        node could meet one that just died, and hold up the beats behind it). Best effort:
        when the call fails or takes over CLOCK_RTT_SECONDS (which would blur it), the
        difference measured before stays. Returns whether it measured."""
        if self._given_clock is not None:
            return True
        where = (
            {"target_nodes": client.get_node_from_key(REPLICAS)}
            if isinstance(client, RedisCluster)
            else {}
        )
        try:
            before = self._local_clock()
            seconds, micros = await client.time(**where)
            after = self._local_clock()
        except FAILURES as error:
            if not _failed(error):
                raise
            return False
        if after - before > CLOCK_RTT_SECONDS:
            return False
        self._offset = seconds + micros / 1e6 - (before + after) / 2
        return True

    def _report(self, agent_id: str, events: Iterable[Any]) -> None:
        """Tells the listener what a script did, and the other replicas what concerns them: a
        lease held through another replica ended (its subscription gets the credit back), a
        message handed back for another delivery (their subscribers of the agent look)."""
        for event in events:
            kind = _text(event[0])
            message_id, subscriber, body = _text(event[1]), _text(event[2]), event[3]
            if subscriber:
                self._released(Released(message_id, agent_id, subscriber))
            if kind in ("requeued", "due"):
                self._notify(WAKE, self._wake_for(agent_id))
            if not self.listener:
                continue
            if kind == "expired":
                self.listener.on_expired(_message(body))
            elif kind == "dead":
                self.listener.on_dead_letter(
                    DeadLetter(
                        message=_message(body),
                        reason=_text(event[4]),
                        attempts=int(event[5]),
                        dead_lettered_at=self._wall(),
                    )
                )
            elif kind == "requeued":
                self.listener.on_redelivery(_message(body), int(event[5]) + 1)
            elif kind == "due":
                self.listener.on_due(_message(body))

    # -- the broker-wide count -------------------------------------------------------------

    def _release(self, count: int) -> None:
        """Gives back places in ``mesh:total`` (messages that left, reservations unused): one
        DECRBY for everything released in this loop iteration, off the caller's path."""
        if count <= 0:
            return
        self._unreleased += count
        if self._releasing is None or self._releasing.done():
            self._releasing = asyncio.get_running_loop().create_task(self._flush_releases())

    async def _flush_releases(self) -> None:
        await asyncio.sleep(0)
        while self._unreleased:
            count, self._unreleased = self._unreleased, 0
            try:
                await (await self._client()).decrby(TOTAL, count)
            except FAILED as error:
                if not _failed(error):
                    raise
                self._unreleased += count  # given back by the next sweep
                logger.warning("could not give back %d places in %s: %s", count, TOTAL, error)
                return

    def _released(self, released: Released) -> None:
        """A lease ended: its subscription gets the credit back, here or on the replica it is
        held through (an ack may come through another replica than the subscription's)."""
        if released.subscriber == DEFERRED:
            return  # (nacked with a delay: its subscriber had its place back then)
        owner = _replica_of(released.subscriber)
        if owner and owner != self.replica_id:
            notice = {
                "agent_id": released.agent_id,
                "message_id": released.message_id,
                "subscriber": released.subscriber,
                "withdrawn": released.withdrawn,
            }
            self._notify(_released_channel(owner), json.dumps(notice))
        elif self.listener:
            self.listener.on_released(released)

    def _notify(self, channel: str, payload: str) -> None:
        self._notices.append((channel, payload))
        if self._notifying is None or self._notifying.done():
            self._notifying = asyncio.get_running_loop().create_task(self._flush_notices())

    async def _flush_notices(self) -> None:
        await asyncio.sleep(0)
        while self._notices:
            # (a sweep that hands back many messages of one agent wakes it once)
            notices, self._notices = list(dict.fromkeys(self._notices)), []
            # (one at a time: a cluster client pipelines no PUBLISH; there are few of them)
            for sent, (channel, payload) in enumerate(notices):
                try:
                    await self._call("publish", channel, payload)
                except BrokerUnavailableError as error:
                    # A replica that misses a wake-up finds the message at its next one; a
                    # subscription that misses a release has the credit back once it closes.
                    logger.warning(
                        "could not tell the other replicas of %d events: %s",
                        len(notices) - sent,
                        error,
                    )
                    return

    async def _settle(self) -> None:
        """Waits until every place released so far has been given back."""
        if self._releasing is not None and not self._releasing.done():
            await asyncio.shield(self._releasing)
        if self._unreleased:
            await self._flush_releases()

    async def _reconcile(self, agents: list[str]) -> None:
        """Corrects ``mesh:total`` to the messages the queues really hold (``agents``: those
        a sweep went through, every queue that holds messages) when the two have differed by
        the same amount in three samples a second apart (a replica killed between a script
        and giving back its places leaves the count too high). Differences that come and go
        are puts and acks in flight, and are left alone."""
        now = time.monotonic()
        if now - self._sampled < RECONCILE_EVERY:
            return
        self._sampled = now
        await self._settle()
        client = await self._client()
        try:
            pipe = client.pipeline(transaction=False)
            pipe.get(TOTAL)
            for agent_id in agents:
                pipe.hlen(_keys(agent_id)[2])
            counted, *held = await pipe.execute()
        except FAILURES as error:
            raise _unavailable(error) from None
        difference = int(counted or 0) - sum(int(h) for h in held)
        self._seen_total = int(counted or 0)
        self._drift = [*self._drift[-2:], difference]
        if len(self._drift) == 3 and difference != 0 and len(set(self._drift)) == 1:
            logger.warning(
                "%s counted %d messages where the queues hold %d; corrected",
                TOTAL,
                int(counted or 0),
                int(counted or 0) - difference,
            )
            await self._call("decrby", TOTAL, difference)
            self._drift = []

    # -- producing -------------------------------------------------------------------------

    async def put(
        self,
        message: Message,
        ttl_seconds: float,
        claim: RouteClaim | None = None,
        delay: float = 0.0,
    ) -> bool:
        route = None
        if claim is not None:
            await self._client()  # (whether it is a cluster is known once connected)
            if self.cluster:
                # The route's key is in another slot than the queue's, likely on another
                # node: claimed first, so that no answer can come before it.
                await self.claim_route(*claim)
            else:
                # One server takes a connection's commands in order: the route's SET goes in
                # the pipeline of the put, before it.
                route = self._route_command(*claim)
        agent_id = message.to_agent
        low = message.priority is Priority.LOW
        per_agent, total = self._low_limits if low else self._limits
        now = self._now_ms()
        args = [
            message.message_id,
            json.dumps(message.to_dict(), separators=(",", ":")),
            "0" if self.fifo else _score(message),
            now + int(ttl_seconds * 1000),
            now,
            per_agent,
            WAKE,
            self._wake_for(agent_id),
            message.priority.rank,
            message.from_agent,
            now + int(delay * 1000) if delay > 0 else 0,
        ]
        result = await self._put(agent_id, args, total, route)
        if int(result[0]) == -2:
            await self.sweep()  # expired messages elsewhere must not hold capacity
            result = await self._put(agent_id, args, total)
        self._report(agent_id, result[1])
        status = int(result[0])
        if status == -3:
            raise message_id_taken(agent_id, message.message_id, _text(result[2]))
        for_low = " for LOW priority" if low else ""
        if status == -2:
            # Refused by the broker-wide count before the script looked: a retry of a message
            # already held is the harmless duplicate it is, not a send refused; another
            # sender's message under that id is refused as the script refuses it.
            held = await self._call("hget", _keys(agent_id)[2], message.message_id)
            if held is not None:
                holder = str(json.loads(held).get("from_agent", ""))
                if holder != message.from_agent:
                    raise message_id_taken(agent_id, message.message_id, holder)
                return False
            # (The count includes places other replicas reserved a moment ago, for puts of
            # theirs that may yet be refused: never more than the limit are held.)
            held_now = min(int(result[2]), self.max_total_messages)
            raise MessageQueueFullError(
                f"{agent_id} queue full: the brokers hold {held_now} of their "
                f"{self.max_total_messages} messages{for_low}",
                retry_after=self.retry_after_seconds,
            )
        if status == -1:
            raise MessageQueueFullError(
                f"{agent_id} queue full ({int(result[2])} of {self.max_messages_per_agent} "
                f"messages){for_low}",
                retry_after=self.retry_after_seconds,
            )
        return status == 1

    async def _put(
        self,
        agent_id: str,
        args: list[Any],
        total_limit: int,
        route: tuple[Any, ...] | None = None,
    ) -> Any:
        """Runs the put script, together with the other puts of this loop iteration: a batch
        (or concurrent senders) costs two round trips to Redis, whatever its size."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._puts.append(_Put(agent_id, args, total_limit, future, route))
        if len(self._puts) == 1:
            asyncio.get_running_loop().call_soon(self._flush_puts)
        return await future

    def _flush_puts(self) -> None:
        puts, self._puts = self._puts, []
        self._spawn(self._execute_puts(puts))

    async def _execute_puts(self, puts: list[_Put]) -> None:
        try:
            await self._reserve_and_put(puts)
        except BaseException as error:  # no sender is ever left waiting
            for put in puts:
                if not put.future.done():
                    put.future.set_exception(
                        error if isinstance(error, BrokerUnavailableError) else _unavailable(error)
                    )
            if not isinstance(error, Exception):
                raise

    async def _reserve_and_put(self, puts: list[_Put]) -> None:
        """Takes places in the broker-wide count for the group and runs the put scripts in
        one pipeline, in submission order; places not used (refused, duplicates) are given
        back. Far from the limit (by the count last seen) the reservation travels in the same
        pipeline as the puts: one round trip. Near it, the places are reserved first and only
        the puts that fit run (another round trip when some did not add a message and those
        after them may fit now), so the limit holds exactly however many replicas share it."""
        calls = [(p.agent_id, p.args) for p in puts]
        new_queues = sorted({p.agent_id for p in puts} - self._queues_known)
        extra = [("SADD", QUEUES, *new_queues)] if new_queues else []
        routes = [p.route for p in puts if p.route is not None]
        tightest = min(p.total_limit for p in puts)
        if self._seen_total + len(puts) <= tightest * FAST_SHARE:
            try:
                (counted, *_), results = await self._run_many(
                    "put", calls, [("INCRBY", TOTAL, len(puts)), *extra, *routes]
                )
            except BrokerUnavailableError as error:
                self._settle_puts(puts, [error] * len(puts), 0)
                return
            self._seen_total = int(counted)
            self._queues_known.update(new_queues)
            taken = await self._take_back_over_limit(puts, results, int(counted))
            await self._name_first_queues(puts, results, new_queues)
            self._settle_puts(puts, results, -taken)
            return
        try:
            reserved_to = int((await self._commands([("INCRBY", TOTAL, len(puts)), *routes]))[0])
        except BrokerUnavailableError as error:
            for put in puts:
                if not put.future.done():
                    put.future.set_exception(error)
            return
        # The puts run in rounds, each the longest run of them that fits were every one to
        # add a message, so that each is judged by what those before it did (a duplicate, or
        # a put its agent's queue refused, adds nothing), as if they had run one by one; a
        # place that will not be used goes back as soon as that is known.
        held = reserved_to - len(puts)
        self._seen_total = held
        remaining = puts
        while remaining:
            run: list[_Put] = []
            later: list[_Put] = []
            for index, put in enumerate(remaining):
                if held + len(run) < put.total_limit:
                    run.append(put)
                elif run:  # it may fit once those before it have run
                    later = remaining[index:]
                    break
                else:  # no room whatever the others do: its place goes back at once
                    self._release(1)
                    if not put.future.done():
                        put.future.set_result([-2, [], held])
            remaining = later
            if not run:
                break
            try:
                _, results = await self._run_many("put", [(p.agent_id, p.args) for p in run], extra)
                self._queues_known.update(new_queues)
            except BrokerUnavailableError as error:
                results = [error] * len(run)
            await self._name_first_queues(run, results, new_queues)
            took = sum(1 for r in results if _added(r))
            held += took
            self._seen_total = held
            self._settle_puts(run, results, 0)  # (the places of those that added nothing)

    async def _name_first_queues(
        self, puts: list[_Put], results: list[Any], named: list[str]
    ) -> None:
        """Names in mesh:busy, and in mesh:queues unless the pipeline named them there, the
        queues that got their first message since a sweep found them empty or they were
        forgotten (seq gone: another replica may have taken the queue out while this one
        still knew it), before their senders hear of it."""
        first = {
            put.agent_id
            for put, result in zip(puts, results, strict=True)
            if _added(result) and int(result[2])
        }
        if not first:
            return
        try:
            pipe = (await self._client()).pipeline(transaction=False)
            pipe.sadd(BUSY, *sorted(first))
            if unnamed := sorted(first - set(named)):
                pipe.sadd(QUEUES, *unnamed)
            await pipe.execute()
        except FAILED as error:
            if not _failed(error):
                raise
            # (the messages are in: a sweep through every queue names them)
            logger.warning("could not name new queues %s: %s", sorted(first), error)
            return
        self._queues_known.update(first)

    async def _take_back_over_limit(
        self, puts: list[_Put], results: list[Any], counted: int
    ) -> int:
        """Other replicas filled the broker-wide count meanwhile and these puts went past
        the limit: takes back those still queued (their senders are refused, as if they had
        reserved first; one already delivered stays accepted). Returns how many."""
        held = counted - len(puts)
        over: dict[str, list[int]] = {}
        for i, (put, result) in enumerate(zip(puts, results, strict=True)):
            if not _added(result):
                continue
            if held < put.total_limit:
                held += 1
            else:
                over.setdefault(put.agent_id, []).append(i)
        if not over:
            return 0
        agents = list(over)
        try:
            _, removed = await self._run_many(
                "take_back", [(a, [puts[i].args[0] for i in over[a]]) for a in agents]
            )
        except BrokerUnavailableError:
            return 0  # they stay accepted
        taken = 0
        taken_back: set[tuple[str, str]] = set()
        for agent_id, ids in zip(agents, removed, strict=True):
            if isinstance(ids, BaseException):
                continue
            gone = {_text(message_id) for message_id in ids}
            for i in over[agent_id]:
                if puts[i].args[0] in gone:
                    results[i] = [-2, [], held]
                    taken += 1
                    taken_back.add((agent_id, puts[i].args[0]))
        # A put of the group that found one of those held (a retry sent with it) is refused
        # with it: what it would be told was accepted is no longer there.
        for i, (put, result) in enumerate(zip(puts, results, strict=True)):
            duplicate = not isinstance(result, BaseException) and int(result[0]) == 0
            if duplicate and (put.agent_id, put.args[0]) in taken_back:
                results[i] = [-2, [], held]
        return taken

    def _settle_puts(self, puts: list[_Put], results: list[Any], unused: int) -> None:
        """Gives back the places of the puts that did not add a message (refused, duplicates,
        not run), then answers each."""
        unused += sum(1 for result in results if not _added(result))
        self._release(unused)
        for put, result in zip(puts, results, strict=True):
            if put.future.done():
                continue
            if isinstance(result, BaseException):
                put.future.set_exception(result)
            else:
                put.future.set_result(result)

    # -- consuming -------------------------------------------------------------------------

    async def pop(
        self,
        agent_id: str,
        max_messages: int = 0,
        max_bytes: int = 0,
        size_of: Callable[[Message], int] | None = None,
    ) -> list[Popped]:
        # (measured here by the stored JSON, longer than the message on the wire)
        now = self._now_ms()
        popped, events = await self._run("pop", agent_id, [now, max_messages, max_bytes])
        self._report(agent_id, events)
        return [
            Popped(_message(body), max(0.0, (now - float(_text(accepted))) / 1000), int(attempts))
            for body, accepted, attempts in popped
        ]

    async def lease(self, agent_id: str, subscriber: str, lease_seconds: float) -> Lease | None:
        leases = await self.lease_many(agent_id, subscriber, lease_seconds, 1)
        return leases[0] if leases else None

    async def lease_many(
        self, agent_id: str, subscriber: str, lease_seconds: float, most: int
    ) -> list[Lease]:
        now = self._now_ms()
        leases, events = await self._run(
            "lease", agent_id, [now, now + int(lease_seconds * 1000), subscriber, most]
        )
        self._report(agent_id, events)
        expires = datetime.fromtimestamp((now / 1000) + lease_seconds, UTC)
        return [
            Lease(
                message=_message(body),
                agent_id=agent_id,
                subscriber=subscriber,
                attempt=int(attempt),
                lease_expires_at=expires,
                queued_seconds=max(0.0, (now - float(_text(accepted))) / 1000),
            )
            for body, attempt, accepted in leases
        ]

    async def ack(self, agent_id: str, message_ids: Iterable[str]) -> int:
        ids = list(message_ids)
        if not ids:
            return 0
        acked = await self._run("ack", agent_id, ids)
        for message_id, subscriber in acked:
            if subscriber:
                self._released(Released(_text(message_id), agent_id, _text(subscriber)))
        return len(acked)

    async def extend_lease(
        self, agent_id: str, message_ids: Iterable[str], lease_seconds: float
    ) -> int:
        ids = list(message_ids)
        if not ids:
            return 0
        now = self._now_ms()
        lease_end = now + int(lease_seconds * 1000)
        return int(await self._run("extend", agent_id, [now, lease_end, *ids]))

    async def withdraw(self, agent_id: str, message_ids: Iterable[str]) -> tuple[int, int]:
        ids = list(message_ids)
        if not ids:
            return (0, 0)
        waiting = leased = 0
        for message_id, subscriber in await self._run("withdraw", agent_id, ids):
            if subscriber:
                leased += 1
                self._released(Released(_text(message_id), agent_id, _text(subscriber), True))
            else:
                waiting += 1
        return (waiting, leased)

    async def cancel(self, agent_id: str, sender: str, message_ids: Iterable[str]) -> list[str]:
        ids = list(dict.fromkeys(message_ids))
        if not ids:
            return []
        return [_text(i) for i in await self._run("cancel", agent_id, [sender, *ids])]

    def _return_args(self) -> list[Any]:
        return [
            self._now_ms(),
            self.max_delivery_attempts,
            self._wall().isoformat(),
            self.max_dead_letters,
        ]

    async def nack(
        self,
        agent_id: str,
        message_ids: Iterable[str],
        *,
        dead_letter_reason: str = "",
        delay: float = 0.0,
    ) -> tuple[int, int]:
        args = self._return_args()
        back_at = int(args[0] + delay * 1000) if delay > 0 else 0
        events = await self._run(
            "nack", agent_id, [*args, dead_letter_reason, back_at, *list(message_ids)]
        )
        self._report(agent_id, events)
        kinds = [_text(e[0]) for e in events]
        return kinds.count("requeued") + kinds.count("deferred"), kinds.count("dead")

    async def still_leased(
        self, agent_id: str, subscriber: str, message_ids: Collection[str]
    ) -> set[str]:
        ids = list(message_ids)
        if not ids:
            return set()
        metas = await self._call("hmget", _keys(agent_id)[3], ids)
        return {
            message_id
            for message_id, meta in zip(ids, metas, strict=True)
            if meta is not None and json.loads(meta).get("s") == subscriber
        }

    async def release_subscriber(
        self, agent_id: str, subscriber: str, *, seen: Collection[str] | None = None
    ) -> int:
        unseen = [] if seen is None else ["1", *seen]
        events = await self._run("release", agent_id, [*self._return_args(), subscriber, *unseen])
        self._report(agent_id, events)
        return len(events)

    async def sweep(self) -> None:
        """Expires, reclaims and dead-letters what is due in the queues that may hold
        messages (mesh:busy), and every FULL_SWEEP_SECONDS (or when a replica is gone) in
        every queue: an idle queue costs a sweep nothing, however many agents are registered."""
        gone, leader = await self._beat()
        if gone and self.listener is not None:
            self.listener.on_replicas_gone(gone)
        self._queues_known.clear()  # each queue is named to mesh:queues again once a sweep
        started = time.monotonic()
        full = bool(gone) or started - self._swept_all_at >= FULL_SWEEP_SECONDS
        agents = [_text(a) for a in await self._call("smembers", QUEUES if full else BUSY)]
        args = [*self._return_args(), *gone]
        _, results = await self._run_many("sweep", [(agent_id, args) for agent_id in agents])
        idle: list[str] = []
        held: list[str] = []
        for agent_id, result in zip(agents, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            events, went_idle = result
            self._report(agent_id, events)
            (idle if int(went_idle) else held).append(agent_id)
        await self._mark_idle(idle, held if full else [])
        if full:
            self._swept_all_at = started
        await self._settle()
        if leader:
            await self._reconcile(agents)

    async def _mark_idle(self, idle: list[str], held: list[str]) -> None:
        """Takes the queues a sweep found empty (their seq deleted) out of mesh:busy, and
        names those found holding messages. A put to an idle queue meanwhile either came
        before the look at its seq afterwards (the queue is named again here) or finds seq
        gone after it, and its replica names the queue (see _name_first_queues)."""
        if held:
            await self._call("sadd", BUSY, *held)
        if not idle:
            return
        await self._call("srem", BUSY, *idle)
        client = await self._client()
        try:
            pipe = client.pipeline(transaction=False)
            for agent_id in idle:
                pipe.exists(_keys(agent_id)[6])
            counters = await pipe.execute()
        except FAILURES as error:
            raise _unavailable(error) from None
        again = [agent_id for agent_id, n in zip(idle, counters, strict=True) if int(n)]
        if again:
            await self._call("sadd", BUSY, *again)

    async def _beat_once(self) -> int:
        """Says this replica lives (until a while from now); returns the time it beat."""
        now = self._now_ms()
        try:
            await self._call("hset", REPLICAS, self.replica_id, now + REPLICA_TIMEOUT_MS)
        except BrokerUnavailableError:
            self._beating_since = None
            raise
        stalled = now - self._last_beat > REPLICA_TIMEOUT_MS // 2
        if self._beating_since is None or stalled:
            # Beating again after a gap (the store away, or this process held up): the
            # others were most likely held up alike, and get the time to beat again.
            self._beating_since = now
        self._last_beat = now
        return now

    async def _beat(self) -> tuple[list[str], bool]:
        """Records that this replica is alive; returns the replicas that stopped beating
        (forgetting them, once their leases are handed back by this sweep) and whether this
        replica is the one that keeps the broker-wide count right (the live one with the
        lowest id)."""
        now = await self._beat_once()
        beats = {
            _text(r): int(until) for r, until in (await self._call("hgetall", REPLICAS)).items()
        }
        # While this replica could not reach the store the others could not either, most
        # likely: their last beats are as old as the outage. They are judged once they have
        # had the time to beat again (and so, on start-up, once this replica has beaten a while).
        since = self._beating_since  # (None again if the heartbeat failed meanwhile)
        settled = since is not None and now - since >= REPLICA_TIMEOUT_MS
        gone = [replica for replica, until in beats.items() if until < now] if settled else []
        if gone:
            logger.warning("broker replicas gone: %s; their leases return", ", ".join(gone))
            await self._call("hdel", REPLICAS, *gone)
        live = [replica for replica in beats if replica not in gone]
        return gone, min(live, default=self.replica_id) == self.replica_id

    # -- reading ---------------------------------------------------------------------------

    async def _agents(self, agent_id: str | None) -> list[str]:
        if agent_id is not None:
            return [agent_id]
        return sorted(_text(a) for a in await self._call("smembers", QUEUES))

    async def _stats(self, agent_id: str | None) -> list[tuple[str, list[Any]]]:
        agents = await self._agents(agent_id)
        args = [self._now_ms(), RANK_SPAN, "1" if self.fifo else "0"]
        _, results = await self._run_many("stats", [(aid, args) for aid in agents])
        out = []
        for aid, result in zip(agents, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            self._report(aid, result[6])
            out.append((aid, result))
        return out

    async def stats(self, agent_id: str | None = None) -> list[QueueStats]:
        return [
            QueueStats(aid, int(high), int(medium), int(low), int(leased), int(dead), int(deferred))
            for aid, (high, medium, low, leased, dead, _held, _events, deferred) in (
                await self._stats(agent_id)
            )
        ]

    async def held(self) -> int:
        """Messages held (queued or leased) for every agent, counted queue by queue."""
        return sum(int(result[5]) for _, result in await self._stats(None))

    async def depth(self, agent_id: str) -> int:
        return int(await self._call("zcard", _keys(agent_id)[0]))

    async def listing(self, agent_id: str) -> list[Held]:
        listed, events = await self._run("listing", agent_id, [self._now_ms()])
        self._report(agent_id, events)
        return [
            Held(
                _message(body),
                int(attempts),
                float(_text(accepted)) / 1000,
                float(_text(expires)) / 1000,
                _LISTED[_text(state)],
                float(_text(until)) / 1000 if _text(until) else None,
            )
            for body, accepted, expires, attempts, state, until in listed
        ]

    async def dead_letters(self, agent_id: str | None = None) -> list[DeadLetter]:
        out = []
        for aid in await self._agents(agent_id):
            for raw in await self._call("lrange", _keys(aid)[5], 0, -1):
                data = json.loads(raw)
                out.append(
                    DeadLetter(
                        message=_message(data["b"]),
                        reason=data["r"],
                        attempts=int(data["a"]),
                        dead_lettered_at=datetime.fromisoformat(data["t"]),
                    )
                )
        return out

    async def remove_dead_letters(self, agent_id: str, message_ids: Collection[str]) -> int:
        if not message_ids:
            return 0
        return int(await self._run("undead", agent_id, list(message_ids)))

    async def sync(self) -> None:
        return None  # every script has run in Redis before it returns

    # -- registrations ---------------------------------------------------------------------

    async def save_agent(self, info: AgentInfo) -> None:
        await self._call("hset", AGENTS, info.agent_id, json.dumps(info.to_dict()))
        await self._call("publish", REGISTRY, info.agent_id)

    async def update_agent(
        self, agent_id: str, change: Callable[[AgentInfo | None], AgentInfo | None]
    ) -> AgentInfo | None:
        """Read, changed, written back only if no replica wrote it in between (else read
        again): instances registering or leaving at the same moment, through any replicas,
        all count."""
        for attempt in range(REGISTRATION_TRIES):
            raw = await self._call("hget", AGENTS, agent_id)
            kept = change(AgentInfo.from_dict(json.loads(raw)) if raw else None)
            fresh = json.dumps(kept.to_dict()) if kept is not None else ""
            if int(
                await self._call(
                    "eval", _SWAP_AGENT, 1, AGENTS, agent_id, _text(raw) if raw else "", fresh
                )
            ):
                await self._call("publish", REGISTRY, agent_id)
                if kept is None:
                    await self._forget_queue(agent_id)
                return kept
            await asyncio.sleep(random.uniform(0, 0.001 * (attempt + 1)))  # (out of step)
        raise BrokerUnavailableError(
            f"the registration of {agent_id} changed {REGISTRATION_TRIES} times while this "
            "change was being made: try again"
        )

    async def forget_agent(self, agent_id: str) -> None:
        await self._call("hdel", AGENTS, agent_id)
        await self._call("publish", REGISTRY, agent_id)
        await self._forget_queue(agent_id)

    async def _forget_queue(self, agent_id: str) -> None:
        # An agent that left with nothing held and no dead letters leaves no queue behind:
        # every sweep of every replica goes through each queue named in mesh:queues, and
        # agents that come and go under new ids would otherwise be swept for ever. Named out
        # first, then found empty (its counter deleted), else named again: a put meanwhile
        # either comes before the look (and the queue is named again) or finds the counter
        # gone and has its replica name the queue after it (see _name_first_queues).
        self._queues_known.discard(agent_id)
        await self._call("srem", QUEUES, agent_id)
        if not await self._run("forget", agent_id, []):
            await self._call("sadd", QUEUES, agent_id)

    async def saved_agents(self) -> list[AgentInfo]:
        return [
            AgentInfo.from_dict(json.loads(raw))
            for raw in (await self._call("hgetall", AGENTS)).values()
        ]

    async def saved_agent(self, agent_id: str) -> AgentInfo | None:
        raw = await self._call("hget", AGENTS, agent_id)
        return AgentInfo.from_dict(json.loads(raw)) if raw else None

    async def restore_agent(self, info: AgentInfo) -> bool:
        if not await self._call("hsetnx", AGENTS, info.agent_id, json.dumps(info.to_dict())):
            return False
        await self._call("publish", REGISTRY, info.agent_id)
        return True

    # -- replicas --------------------------------------------------------------------------

    def _wake_for(self, agent_id: str) -> str:
        """What ``mesh:wake`` carries: the replica that queued, a newline, the agent."""
        return f"{self.replica_id}\n{agent_id}"

    def _answers(self, replica: str) -> str:
        return f"mesh:answer:{replica}"

    async def claim_route(self, key: tuple[str, str], ttl: float) -> None:
        """Records that this replica waits for the answer keyed (requester, correlation)."""
        await self._commands([self._route_command(key, ttl)])

    def _route_command(self, key: tuple[str, str], ttl: float) -> tuple[Any, ...]:
        """The SET that records this replica as where the answer keyed (requester,
        correlation id) is waited for, for ``ttl`` seconds and a moment."""
        route = f"mesh:route:{key[0]}:{key[1]}"
        return ("SET", route, self.replica_id, "PX", int(ttl * 1000) + 1000)

    async def _commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Plain commands in one pipeline, in order; their answers."""
        client = await self._client()
        try:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            results: list[Any] = await pipe.execute()
        except FAILURES as error:
            raise _unavailable(error) from None
        return results

    async def give_up_route(self, key: tuple[str, str]) -> None:
        route = f"mesh:route:{key[0]}:{key[1]}"
        with contextlib.suppress(BrokerUnavailableError):
            await self._call("set", route, GIVEN_UP_ROUTE, px=int(GIVEN_UP_SECONDS * 1000))

    async def route_of(self, key: tuple[str, str]) -> str | None:
        raw = await self._call("get", f"mesh:route:{key[0]}:{key[1]}")
        return _text(raw) if raw else None

    async def forward_answer(self, replica: str, message: Message) -> bool:
        """Sends an answer to the replica whose requester waits for it; False when that
        replica is gone (or holds MAX_HANDED_OVER answers it has not taken). It is kept in the
        store until that replica takes it: a replica that lives but does not listen for a
        moment (it lost its connection to Redis and subscribes again), or that lost the
        connection the answer was on, reads it when it follows the others again."""
        body = json.dumps(message.to_dict(), separators=(",", ":"))
        kept = self._handed_over(replica)
        client = await self._client()
        try:
            heard = await client.eval(
                _HAND_OVER,
                1,
                kept,
                message.message_id,
                body,
                MAX_HANDED_OVER,
                HANDED_OVER_KEEP_MS,
                self._answers(replica),
            )
        except FAILURES as error:
            raise _unavailable(error) from None
        if heard == -1:
            logger.warning(
                "replica %s has not taken %d answers forwarded to it: answer %s dropped",
                replica,
                MAX_HANDED_OVER,
                message.message_id,
            )
            return False
        if heard:
            return True
        beats_until = await self._call("hget", REPLICAS, replica)
        if beats_until is not None and int(beats_until) > self._now_ms():
            return True  # (it reads the answer when it follows the others again)
        with contextlib.suppress(BrokerUnavailableError):
            await self._call("hdel", kept, message.message_id)
        return False

    def _handed_over(self, replica: str) -> str:
        return f"{HANDED_OVER}{replica}"

    def _took(self, message_id: str) -> None:
        """An answer forwarded to this replica reached it: no longer kept for it."""
        self._taken.append(message_id)
        if self._forgetting is None or self._forgetting.done():
            self._forgetting = asyncio.get_running_loop().create_task(
                self._forget_taken(), name="redis-forget-taken"
            )

    async def _forget_taken(self) -> None:
        while self._taken:
            taken, self._taken = self._taken, []
            with contextlib.suppress(BrokerUnavailableError):  # (kept a while, read again)
                await self._call("hdel", self._handed_over(self.replica_id), *taken)

    async def _take_handed_over(self, listener: Any) -> None:
        """Answers forwarded to this replica that it did not hear (it was not listening, or
        lost the connection they were on): each goes to its request, if that still waits.
        Tried again until the store answers (a cluster failing over may still route the key
        to a dead node)."""
        kept = self._handed_over(self.replica_id)
        while True:
            try:
                answers = await self._call("hgetall", kept)
                for body in answers.values():
                    listener.on_answer(_message(body))
                if answers:
                    await self._call("hdel", kept, *answers)
                return
            except BrokerUnavailableError as error:
                logger.debug("could not read the answers kept for this replica: %s", error)
            await asyncio.sleep(FOLLOW_AGAIN_SECONDS)

    async def remember_forward(
        self, key: tuple[str, str], agent_id: str, message_id: str, ttl: float
    ) -> None:
        forwards = f"mesh:forwards:{key[0]}:{key[1]}"
        # One round trip; best effort: what is not recorded expires with its request anyway.
        try:
            pipe = (await self._client()).pipeline(transaction=False)
            pipe.rpush(forwards, f"{agent_id}\n{message_id}")
            pipe.ltrim(forwards, -MAX_FORWARDS, -1)
            pipe.pexpire(forwards, max(1, int(ttl * 1000)))
            await pipe.execute()
        except FAILED as error:
            if not _failed(error):
                raise

    async def take_forwards(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        raw = await self._call("lpop", f"mesh:forwards:{key[0]}:{key[1]}", MAX_FORWARDS)
        places = [_text(entry).split("\n", 1) for entry in raw or ()]
        return [(place[0], place[1]) for place in places if len(place) == 2]

    async def watch(self, listener: Any) -> None:
        """Follows the other replicas: wake-ups, registrations and answers for this one."""
        self.listener = listener
        await self._check_mark()
        await self._subscribe()
        self._watcher = asyncio.create_task(self._follow(listener), name="redis-watch")
        self._heart = asyncio.create_task(self._beat_forever(), name="redis-heartbeat")

    async def _beat_forever(self) -> None:
        failing = 0  # beats in a row that failed unforeseen: the first is logged, whole
        while True:
            stop_if_cancelled()
            try:
                await self._beat_once()
                await self._check_mark()
                # Measured again once a beat has gone through (a host's clock may be
                # stepped), here and not in the sweeps' beats, five times as frequent.
                await self._sync_clock(await self._client())
                failing = 0
            except BrokerUnavailableError:
                pass
            except Exception:
                # The heartbeat must outlive any one bad beat (redis-py's cluster client
                # can raise AttributeError while a node restarts): stopped, it would let the
                # other replicas take this one for dead, and nothing here would see the
                # store lose its data any more.
                failing += 1
                logger.log(
                    logging.ERROR if failing == 1 else logging.DEBUG,
                    "a heartbeat failed; beating again in %.0f s",
                    REPLICA_TIMEOUT_MS / 3000,
                    exc_info=True,
                )
            await asyncio.sleep(REPLICA_TIMEOUT_MS / 3000)

    async def _subscribe(self) -> None:
        client = await self._client()
        url = self.url
        if isinstance(client, RedisCluster):
            # Every node of a cluster hears every PUBLISH: any one will do, on a connection
            # of the watcher's own (the cluster client drops its nodes' connections each time
            # it refreshes its map of the slots, as it does over and over during a failover).
            # After a failure the next node is tried: a primary that died stays in the list
            # until the cluster has failed over.
            nodes = client.get_nodes()
            node = nodes[self._pubsub_turn % len(nodes)]
            self._pubsub_turn += 1
            url = _with_address(self.url, node.host, int(node.port))
        if self._pubsub_client is not None:
            with contextlib.suppress(Exception):
                await self._pubsub_client.aclose()
        # A client of its own that never connects again by itself: on a lost connection
        # redis-py would subscribe again on a new one unseen (its pub/sub reconnects, and
        # subscribes again, before it raises, whatever its retries), and what was published
        # in between would be lost to this replica without a word, read by nobody until that
        # connection closed. The watcher has to see the cut (and end the watches it failed).
        self._pubsub_client = aioredis.from_url(
            url, decode_responses=False, retry=Retry(NoBackoff(), 0, supported_errors=())
        )
        self._pubsub = self._pubsub_client.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(
            WAKE,
            REGISTRY,
            self._answers(self.replica_id),
            _released_channel(self.replica_id),
            *self._followed,
        )
        # A SUBSCRIBE can go out on a connection that is already dead: an answered PING
        # says the subscription is really there.
        await self._pubsub.ping()
        async with asyncio.timeout(SUBSCRIBE_CHECK_SECONDS):
            while True:
                event = await self._pubsub.get_message(timeout=SUBSCRIBE_CHECK_SECONDS)
                if event is None:
                    continue
                if event.get("type") == "pong":
                    return
                self._early.append(event)

    async def _follow(self, listener: Any) -> None:
        failures = 0  # in a row: the first is a warning, the rest of an outage is quiet
        while True:
            stop_if_cancelled()
            try:
                while self._early:
                    await self._handle(self._early.pop(0), listener)
                async for event in self._pubsub.listen():
                    await self._handle(event, listener)
                # listen() ends at once on a connection subscribed to nothing (a subscribe
                # that failed while Redis was away): not a reason to go round without a pause.
                raise ConnectionError("the subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a lost connection (or node): subscribe again
                failures += 1
                if failures == 1:
                    self.cut_off = True
                    for hook in self._refollowed:
                        hook()
                logger.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "following the other replicas failed (%s); retrying every 0.5 s",
                    error,
                )
                await asyncio.sleep(FOLLOW_AGAIN_SECONDS)
                with contextlib.suppress(Exception):
                    await self._pubsub.aclose()
                with contextlib.suppress(Exception):
                    # (the mark first: the registry is read again once it is known whether
                    # the store lost it; failing, the subscription is not made either)
                    await self._check_mark()
                    await self._subscribe()
                    logger.info("following the other replicas again")
                    failures = 0
                    self.cut_off = False
                    listener.on_followed_again()
                    # (subscribed first: what is forwarded from now on is heard)
                    await cancel_and_wait(self._taking_over)
                    self._taking_over = asyncio.create_task(
                        self._take_handed_over(listener), name="redis-take-handed-over"
                    )
                    for hook in self._refollowed:
                        hook()

    async def still_holds(self) -> bool:
        return not await self._check_mark()

    async def _check_mark(self) -> bool:
        """Reads the store's :data:`MARK` (set first if it has none: one round trip); one
        other than the last seen means the registrations were lost meanwhile: the listener
        is told, and this says so. Checked on every beat, so that a lost cluster node that
        this replica's watcher did not follow is noticed too, and before a registration the
        store does not hold is taken for a deregistration."""
        mark = _text(
            (await self._commands([("SET", MARK, secrets.token_hex(8), "NX"), ("GET", MARK)]))[1]
        )
        seen, self._mark = self._mark, mark
        if seen is not None and mark != seen:
            logger.warning(
                "the store lost the registrations (its mark %s is now %s: a Redis restarted "
                "without persistence, or flushed); this replica puts back those it knows",
                seen,
                mark,
            )
            self.listener.on_store_emptied()
            return True
        return False

    async def _handle(self, event: dict[str, Any], listener: Any) -> None:
        if event.get("type") != "message":
            return
        channel, data = _text(event["channel"]), event["data"]
        if channel == WAKE:
            origin, _, agent_id = _text(data).partition("\n")
            if origin != self.replica_id:  # (this replica woke its own subscribers itself)
                listener.on_wake(agent_id)
        elif channel == REGISTRY:
            agent_id = _text(data)
            info = await self.saved_agent(agent_id)
            if info is None and await self._check_mark():
                return  # (lost with the store, not deregistered: put back instead)
            listener.on_agent_changed(agent_id, info)
        elif channel == self._answers(self.replica_id):
            message = _message(data)
            listener.on_answer(message)
            self._took(message.message_id)
        elif channel == _released_channel(self.replica_id):
            notice = json.loads(data)
            listener.on_released(
                Released(
                    notice["message_id"],
                    notice["agent_id"],
                    notice["subscriber"],
                    bool(notice.get("withdrawn")),
                )
            )
        elif (handler := self._followed.get(channel)) is not None:
            handler(data)

    async def close(self) -> None:
        if self._tasks:  # puts already sent to Redis get their answers
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._redis is None:
            return
        await cancel_and_wait(self._heart)
        self._heart = None
        with contextlib.suppress(BrokerUnavailableError):
            await self._settle()
            if self._notifying is not None:
                await asyncio.shield(self._notifying)  # what the others must still hear
            await self._call("hdel", REPLICAS, self.replica_id)
        await cancel_and_wait(self._watcher)  # redis-py may swallow one cancellation
        self._watcher = None
        await cancel_and_wait(self._taking_over)
        await cancel_and_wait(self._forgetting)  # (what it did not forget expires)
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
        if self._pubsub_client is not None:
            with contextlib.suppress(Exception):
                await self._pubsub_client.aclose()
        await self._redis.aclose()

    async def flush(self) -> None:
        """Removes every mesh key (for tests and benchmarks that reuse one server)."""
        client = await self._client()
        keys = [k async for k in client.scan_iter(match="mesh:*")]
        if keys:
            await client.delete(*keys)
        self._queues_known.clear()


def _released_channel(replica: str) -> str:
    return f"{RELEASED}{replica}"


def _replica_of(subscriber: str) -> str | None:
    """The replica a subscription is held through: subscriber ids read
    ``<agent>#<replica>-<n>`` (the broker names them so; the sweep script reads them too)."""
    _, hash_, rest = subscriber.rpartition("#")
    replica, dash, number = rest.rpartition("-")
    if not hash_ or not dash or not replica or not number.isdigit():
        return None
    return replica
