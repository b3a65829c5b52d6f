"""The Lua scripts that change buffer state in Redis, one per operation.

Why Lua: the accounting invariant `put = acked + dropped + pending + in_flight` must hold
exactly at every instant, with many producers and consumers at once, and across a Redis
crash. A script runs atomically inside Redis and its effects reach the AOF as one
MULTI/EXEC block, so a truncated AOF either replays a whole operation or none of it:
counters and sets can never disagree, not even after `kill -9` of Redis.

Key layout under the prefix `P` (a Redis Cluster hash tag keeps every key in one slot):

- `P:version`   the trainer's current version (string integer, only moves forward)
- `P:ctr`       hash of counters: put, admitted, accepted, acked, claimed, duplicate,
                redelivered, dropped:<reason>, stored_bytes, seq, resv_seq,
                reservations_expired
- `P:pending`   sorted set, score = oldest token version, member = `<seq:016d>:<group_id>`
                (so equal versions are served first in, first out)
- `P:inflight`  sorted set, score = claim time (ms), member = group_id: the pending-entries
                list of a stream consumer group, with redelivery by idle time
- `P:g:<id>`    hash per group: st (pending|in_flight|acked|dropped), why, ov, nv, n, b,
                m (pending member), c (consumer), dc (deliveries), t (put time), d (payload)
- `P:idx`       sorted set of admitted group ids by oldest version (inspection/export)
- `P:resv`      sorted set of capacity reservations, score = expiry time (ms)
- `P:rr:<rollout>`  sorted set of one rollout's reservations, score = expiry time (ms): the
                index that lets a rollout release all of its reservations without reading
                every other replica's (entries leave with the reservation, expired ones at
                that rollout's next reserve, and the key itself expires with its newest entry)
- `P:retained`  sorted set of acked groups whose payload is kept for export (by ack time)
- `P:rq:<kind>:<request_id>`  short-lived answers of retried requests

Time comes from Redis `TIME`, one clock for every buffer replica and across restarts.
Numbers that are written back are formatted with `%d`, because Lua's default number
formatting would round large integers.
"""

from __future__ import annotations

PRELUDE = r"""
local P = ARGV[1]
local CTR = P .. ':ctr'
local VER = P .. ':version'
local PENDING = P .. ':pending'
local INFLIGHT = P .. ':inflight'
local IDX = P .. ':idx'
local RESV = P .. ':resv'
local RETAINED = P .. ':retained'
local function gkey(gid) return P .. ':g:' .. gid end
local function rqkey(kind, rid) return P .. ':rq:' .. kind .. ':' .. rid end
local function rrkey(rollout) return P .. ':rr:' .. rollout end
-- A reservation id is "<rollout_id>#<seq>": its rollout is everything before the last '#'.
local function resv_rollout(id) return string.match(id, '^(.*)#[^#]*$') end
-- A reservation ends (fulfilled, released or refused): out of the set and its rollout's index.
local function drop_resv(id)
  local n = redis.call('ZREM', RESV, id)
  local rollout = resv_rollout(id)
  if rollout then redis.call('ZREM', rrkey(rollout), id) end
  return n
end
local function int(x) return string.format('%d', x) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function version()
  return tonumber(redis.call('GET', VER) or '0')
end
local function counter(name)
  return tonumber(redis.call('HGET', CTR, name) or '0')
end
local function expire_reservations(now)
  local n = redis.call('ZREMRANGEBYSCORE', RESV, '-inf', int(now))
  if n > 0 then redis.call('HINCRBY', CTR, 'reservations_expired', n) end
end
local function capacity(v, mcr, bs, eta, qs)
  local running = redis.call('ZCARD', RESV)
  local accepted = counter('accepted')
  local by_concurrency = mcr - running
  local by_staleness = (eta + v + 1) * bs - (accepted + running)
  local by_queue = qs - (redis.call('ZCARD', PENDING) + running)
  local cap = math.min(by_concurrency, by_staleness, by_queue)
  if cap < 0 then cap = 0 end
  return cap, running, accepted
end
-- A stored group leaves pending/in_flight: free its bytes, keep a tombstone for idempotency.
local function retire(gid, state, reason, now, tomb_ttl, retain)
  local g = gkey(gid)
  local b = tonumber(redis.call('HGET', g, 'b') or '0')
  redis.call('HINCRBY', CTR, 'stored_bytes', -b)
  if state == 'acked' and retain > 0 then
    redis.call('ZADD', RETAINED, int(now), gid)
    local extra = redis.call('ZCARD', RETAINED) - retain
    if extra > 0 then
      local old = redis.call('ZPOPMIN', RETAINED, extra)
      for i = 1, #old, 2 do redis.call('HDEL', gkey(old[i]), 'd') end
    end
  else
    redis.call('HDEL', g, 'd')
  end
  redis.call('HSET', g, 'st', state, 'why', reason)
  redis.call('HDEL', g, 'c')
  if tomb_ttl > 0 then redis.call('EXPIRE', g, tomb_ttl) end
end
"""

# ARGV: P, gid, oldest_version, newest_version, n_traj, payload, reservation_id, eta,
#       filtered(0|1), max_groups, max_bytes, tomb_ttl_s
# -> {code, version, ...}: admitted(member) | duplicate(st, why) | stale | filtered
#    | full(groups, bytes)
PUT = (
    PRELUDE
    + r"""
local gid, ov, nv, n = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local payload, rid, eta, filtered = ARGV[6], ARGV[7], tonumber(ARGV[8]), ARGV[9]
local max_groups, max_bytes, tomb_ttl = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local g = gkey(gid)
local v = version()
if redis.call('EXISTS', g) == 1 then
  redis.call('HINCRBY', CTR, 'duplicate', 1)
  local st = redis.call('HMGET', g, 'st', 'why')
  return {'duplicate', int(v), st[1] or '', st[2] or ''}
end
local now = now_ms()
local function drop_at_put(reason)
  if rid ~= '' then drop_resv(rid) end
  redis.call('HSET', g, 'st', 'dropped', 'why', reason, 'ov', int(ov), 'nv', int(nv), 'n', n,
             't', int(now))
  if tomb_ttl > 0 then redis.call('EXPIRE', g, tomb_ttl) end
  redis.call('HINCRBY', CTR, 'put', 1)
  redis.call('HINCRBY', CTR, 'dropped:' .. reason, 1)
end
if ov < v - eta then
  drop_at_put('stale_at_put')
  return {'stale', int(v)}
end
if filtered == '1' then
  drop_at_put('filtered')
  return {'filtered', int(v)}
end
local stored = redis.call('ZCARD', PENDING) + redis.call('ZCARD', INFLIGHT)
local bytes = counter('stored_bytes')
if stored + 1 > max_groups or bytes + #payload > max_bytes then
  return {'full', int(v), int(stored), int(bytes)}
end
if rid ~= '' then drop_resv(rid) end
local seq = redis.call('HINCRBY', CTR, 'seq', 1)
local member = string.format('%016d', seq) .. ':' .. gid
redis.call('ZADD', PENDING, int(ov), member)
redis.call('HSET', g, 'st', 'pending', 'why', '', 'ov', int(ov), 'nv', int(nv), 'n', n,
           'b', #payload, 'm', member, 't', int(now), 'dc', 0, 'd', payload)
redis.call('ZADD', IDX, int(ov), gid)
redis.call('HINCRBY', CTR, 'put', 1)
redis.call('HINCRBY', CTR, 'admitted', 1)
redis.call('HINCRBY', CTR, 'accepted', 1)
redis.call('HINCRBY', CTR, 'stored_bytes', #payload)
return {'admitted', int(v), member}
"""
)

# A put that failed validation: counted once as dropped{invalid}, nothing stored.
# ARGV: P, gid (may be ''), request_id (may be ''), reservation_id, tomb_ttl_s, rq_ttl_s
# -> {'counted'|'seen', version}
PUT_INVALID = (
    PRELUDE
    + r"""
local gid, rid, resv = ARGV[2], ARGV[3], ARGV[4]
local tomb_ttl, rq_ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local v = version()
if gid ~= '' and redis.call('EXISTS', gkey(gid)) == 1 then return {'seen', int(v)} end
if rid ~= '' and redis.call('EXISTS', rqkey('put', rid)) == 1 then return {'seen', int(v)} end
if resv ~= '' then drop_resv(resv) end
redis.call('HINCRBY', CTR, 'put', 1)
redis.call('HINCRBY', CTR, 'dropped:invalid', 1)
if gid ~= '' then
  redis.call('HSET', gkey(gid), 'st', 'dropped', 'why', 'invalid', 't', int(now_ms()))
  if tomb_ttl > 0 then redis.call('EXPIRE', gkey(gid), tomb_ttl) end
end
if rid ~= '' then redis.call('SET', rqkey('put', rid), '1', 'EX', rq_ttl) end
return {'counted', int(v)}
"""
)

# ARGV: P, consumer, n, eta, idle_ms, allow_partial(0|1), request_id, rq_ttl_s, tomb_ttl_s,
#       retain, max_reply_bytes, with_payloads(0|1)
# -> {version, dropped_stale, redelivered, replayed(0|1), too_big_bytes,
#     gid1, ov1, dc1, member1, payload1 ('' without payloads), gid2, ...}
# too_big_bytes > 0: the n groups at the head hold that many bytes, more than one reply may
# carry; nothing was handed out (ask for fewer groups per claim).
CLAIM = (
    PRELUDE
    + r"""
local consumer, n, eta, idle_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local allow_partial, rid = ARGV[6], ARGV[7]
local rq_ttl, tomb_ttl, retain = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local max_reply, with_payloads = tonumber(ARGV[11]), ARGV[12] == '1'
local now = now_ms()
local v = version()
local out = {int(v), 0, 0, 0, 0}
local function hand_out(gid, again)
  local g = gkey(gid)
  redis.call('ZADD', INFLIGHT, int(now), gid)
  redis.call('HSET', g, 'st', 'in_flight', 'c', consumer)
  if not again then redis.call('HINCRBY', g, 'dc', 1) end
  local f = redis.call('HMGET', g, 'ov', 'dc', 'm')
  table.insert(out, gid)
  table.insert(out, f[1])
  table.insert(out, f[2])
  table.insert(out, f[3])
  table.insert(out, with_payloads and (redis.call('HGET', g, 'd') or '') or '')
end
-- A retried claim (same request_id) gets the same groups again, if they are still its own
-- and still fresh: the version may have moved since the first answer (a trainer that resumed
-- from a checkpoint repeats the claim its dead predecessor made). Any stale one is dropped
-- and the rest go back to pending, in their order, for the ordinary claim below.
local stale_n = 0
if rid ~= '' then
  local prev = redis.call('GET', rqkey('claim', rid))
  if prev then
    local mine = {}
    for gid in string.gmatch(prev, '[^\n]+') do
      local f = redis.call('HMGET', gkey(gid), 'st', 'c', 'ov')
      if f[1] == 'in_flight' and f[2] == consumer then
        if tonumber(f[3]) < v - eta then
          redis.call('ZREM', INFLIGHT, gid)
          retire(gid, 'dropped', 'stale_at_claim', now, tomb_ttl, 0)
          stale_n = stale_n + 1
        else
          table.insert(mine, gid)
        end
      end
    end
    if stale_n == 0 then
      out[4] = 1
      for _, gid in ipairs(mine) do hand_out(gid, true) end
      return out
    end
    for _, gid in ipairs(mine) do
      local g = gkey(gid)
      redis.call('ZREM', INFLIGHT, gid)
      redis.call('ZADD', PENDING, redis.call('HGET', g, 'ov'), redis.call('HGET', g, 'm'))
      redis.call('HSET', g, 'st', 'pending')
      redis.call('HDEL', g, 'c')
    end
    if #mine > 0 then redis.call('HINCRBY', CTR, 'redelivered', #mine) end
    out[3] = #mine
    redis.call('DEL', rqkey('claim', rid))
  end
end
-- Redeliver claims idle longer than idle_ms (the consumer died or stalled): back to pending,
-- in their original order, so the staleness check below applies to them again.
if idle_ms > 0 then
  local expired = redis.call('ZRANGEBYSCORE', INFLIGHT, '-inf', int(now - idle_ms),
                             'LIMIT', 0, 1000)
  for _, gid in ipairs(expired) do
    local f = redis.call('HMGET', gkey(gid), 'ov', 'm')
    redis.call('ZREM', INFLIGHT, gid)
    redis.call('ZADD', PENDING, f[1], f[2])
    redis.call('HSET', gkey(gid), 'st', 'pending')
    redis.call('HDEL', gkey(gid), 'c')
  end
  if #expired > 0 then redis.call('HINCRBY', CTR, 'redelivered', #expired) end
  out[3] = out[3] + #expired
end
-- Stale at claim: pending is ordered by oldest version, so stale groups are at its head.
local stale = redis.call('ZRANGEBYSCORE', PENDING, '-inf', '(' .. int(v - eta), 'LIMIT', 0, 10000)
for _, member in ipairs(stale) do
  local gid = string.sub(member, 18)
  redis.call('ZREM', PENDING, member)
  retire(gid, 'dropped', 'stale_at_claim', now, tomb_ttl, 0)
end
stale_n = stale_n + #stale
if stale_n > 0 then
  redis.call('HINCRBY', CTR, 'dropped:stale_at_claim', stale_n)
  redis.call('HINCRBY', CTR, 'accepted', -stale_n)
end
out[2] = stale_n
if redis.call('ZCARD', PENDING) < n and allow_partial ~= '1' then return out end
local members = redis.call('ZRANGE', PENDING, 0, n - 1)
local total = 0
local fit = 0
for _, member in ipairs(members) do
  total = total + tonumber(redis.call('HGET', gkey(string.sub(member, 18)), 'b') or '0')
  if total <= max_reply then fit = fit + 1 end
end
if fit < #members then
  if allow_partial ~= '1' or fit == 0 then
    out[5] = int(total)
    return out
  end
  for i = #members, fit + 1, -1 do table.remove(members, i) end
end
local gids = {}
for _, member in ipairs(members) do
  local gid = string.sub(member, 18)
  redis.call('ZREM', PENDING, member)
  hand_out(gid, false)
  table.insert(gids, gid)
end
if #gids > 0 then
  redis.call('HINCRBY', CTR, 'claimed', #gids)
  if rid ~= '' then
    redis.call('SET', rqkey('claim', rid), table.concat(gids, '\n'), 'EX', rq_ttl)
  end
end
return out
"""
)

# ARGV: P, tomb_ttl_s, retain, gid... -> number newly acknowledged
ACK = (
    PRELUDE
    + r"""
local tomb_ttl, retain = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local acked = 0
for i = 4, #ARGV do
  local gid = ARGV[i]
  local f = redis.call('HMGET', gkey(gid), 'st', 'dc', 'm')
  local ok = false
  if f[1] == 'in_flight' then
    redis.call('ZREM', INFLIGHT, gid)
    ok = true
  elseif f[1] == 'pending' and tonumber(f[2] or '0') > 0 then
    -- delivered, then moved back by redelivery, and acked late by its first consumer:
    -- it was trained on, so it is done.
    redis.call('ZREM', PENDING, f[3])
    ok = true
  end
  if ok then
    retire(gid, 'acked', '', now, tomb_ttl, retain)
    acked = acked + 1
  end
end
if acked > 0 then redis.call('HINCRBY', CTR, 'acked', acked) end
return acked
"""
)

# Drop claimed (in-flight) groups, e.g. rejected by a filter applied at claim time.
# ARGV: P, reason, tomb_ttl_s, gid... -> number dropped
DROP_CLAIMED = (
    PRELUDE
    + r"""
local reason, tomb_ttl = ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local dropped = 0
for i = 4, #ARGV do
  local gid = ARGV[i]
  if redis.call('HGET', gkey(gid), 'st') == 'in_flight' then
    redis.call('ZREM', INFLIGHT, gid)
    retire(gid, 'dropped', reason, now, tomb_ttl, 0)
    dropped = dropped + 1
  end
end
if dropped > 0 then
  redis.call('HINCRBY', CTR, 'dropped:' .. reason, dropped)
  redis.call('HINCRBY', CTR, 'accepted', -dropped)
end
return dropped
"""
)

# Give claimed groups back to pending, in their original order, as if never handed out
# (a claim that could not complete its batch). ARGV: P, consumer, gid... -> number returned
UNCLAIM = (
    PRELUDE
    + r"""
local consumer = ARGV[2]
local back = 0
for i = 3, #ARGV do
  local g = gkey(ARGV[i])
  local f = redis.call('HMGET', g, 'st', 'c', 'ov', 'm')
  if f[1] == 'in_flight' and f[2] == consumer then
    redis.call('ZREM', INFLIGHT, ARGV[i])
    redis.call('ZADD', PENDING, f[3], f[4])
    redis.call('HSET', g, 'st', 'pending')
    redis.call('HDEL', g, 'c')
    redis.call('HINCRBY', g, 'dc', -1)
    back = back + 1
  end
end
if back > 0 then redis.call('HINCRBY', CTR, 'claimed', -back) end
return back
"""
)

# ARGV: P, count, max_concurrent_rollouts, consumer_batch_size, eta, queue_size, request_id,
#       rollout_id, reservation_ttl_ms, rq_ttl_s, served_version ('' = not given)
# -> {version, capacity_after, replayed(0|1), id...}
# The staleness term counts from min(version, served_version): the version the asking
# replica's weights hold, if older than the trainer's (see the proto's ReserveCapacityRequest).
RESERVE = (
    PRELUDE
    + r"""
local count, mcr, bs, eta = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local qs = tonumber(ARGV[6])
local rid, rollout, ttl, rq_ttl = ARGV[7], ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local now = now_ms()
expire_reservations(now)
local v = version()
local cv = v
if ARGV[11] and ARGV[11] ~= '' then cv = math.min(v, tonumber(ARGV[11])) end
if rid ~= '' then
  local prev = redis.call('GET', rqkey('reserve', rid))
  if prev then
    local out = {int(v), int(capacity(cv, mcr, bs, eta, qs)), 1}
    for id in string.gmatch(prev, '[^\n]+') do table.insert(out, id) end
    return out
  end
end
local cap = capacity(cv, mcr, bs, eta, qs)
local grant = math.min(count, cap)
local out = {int(v), int(cap - grant), 0}
local ids = {}
local rr = rrkey(rollout)
if grant > 0 then redis.call('ZREMRANGEBYSCORE', rr, '-inf', int(now)) end
for i = 1, grant do
  local id = rollout .. '#' .. redis.call('HINCRBY', CTR, 'resv_seq', 1)
  redis.call('ZADD', RESV, int(now + ttl), id)
  redis.call('ZADD', rr, int(now + ttl), id)
  table.insert(ids, id)
  table.insert(out, id)
end
if grant > 0 then redis.call('PEXPIRE', rr, int(ttl)) end
-- Only a grant is remembered: an empty answer changed nothing, so asking again under the
-- same id (a held reserve, a retried call) must look at the capacity afresh.
if rid ~= '' and grant > 0 then
  redis.call('SET', rqkey('reserve', rid), table.concat(ids, '\n'), 'EX', rq_ttl)
end
return out
"""
)

# ARGV: P, rollout_id -> number released (every reservation id is "<rollout_id>#<seq>")
RELEASE_ROLLOUT = (
    PRELUDE
    + r"""
local rr = rrkey(ARGV[2])
local released = 0
for _, id in ipairs(redis.call('ZRANGE', rr, 0, -1)) do
  released = released + redis.call('ZREM', RESV, id)
end
redis.call('DEL', rr)
return released
"""
)

# ARGV: P, id... -> number released
RELEASE = (
    PRELUDE
    + r"""
local released = 0
for i = 2, #ARGV do released = released + drop_resv(ARGV[i]) end
return released
"""
)

# ARGV: P, max_concurrent_rollouts, consumer_batch_size, eta, queue_size
#   -> {capacity, version, running, accepted}
CAPACITY = (
    PRELUDE
    + r"""
local mcr, bs, eta = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local qs = tonumber(ARGV[5])
expire_reservations(now_ms())
local v = version()
local cap, running, accepted = capacity(v, mcr, bs, eta, qs)
return {int(cap), int(v), int(running), int(accepted)}
"""
)

# ARGV: P, version, request_id, rq_ttl_s -> {ok(0|1), version}
SET_VERSION = (
    PRELUDE
    + r"""
local new, rid, rq_ttl = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local cur = version()
if rid ~= '' and redis.call('EXISTS', rqkey('version', rid)) == 1 then return {1, int(cur)} end
if new < cur then return {0, int(cur)} end
if new > cur then redis.call('SET', VER, int(new)) end
if rid ~= '' then redis.call('SET', rqkey('version', rid), '1', 'EX', rq_ttl) end
return {1, int(new)}
"""
)

# One consistent snapshot of everything the invariant and the metrics need.
# ARGV: P, max_concurrent_rollouts, consumer_batch_size, eta, queue_size
# -> {version, pending, in_flight, capacity, running, accepted, retained, k1, v1, k2, v2, ...}
STATS = (
    PRELUDE
    + r"""
local mcr, bs, eta = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local qs = tonumber(ARGV[5])
expire_reservations(now_ms())
local v = version()
local cap, running, accepted = capacity(v, mcr, bs, eta, qs)
local out = {int(v), redis.call('ZCARD', PENDING), redis.call('ZCARD', INFLIGHT), int(cap),
             int(running), int(accepted), redis.call('ZCARD', RETAINED)}
local all = redis.call('HGETALL', CTR)
for i = 1, #all do table.insert(out, all[i]) end
return out
"""
)

ALL = {
    "put": PUT,
    "put_invalid": PUT_INVALID,
    "claim": CLAIM,
    "ack": ACK,
    "drop_claimed": DROP_CLAIMED,
    "unclaim": UNCLAIM,
    "reserve": RESERVE,
    "release": RELEASE,
    "release_rollout": RELEASE_ROLLOUT,
    "capacity": CAPACITY,
    "set_version": SET_VERSION,
    "stats": STATS,
}
