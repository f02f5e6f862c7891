-- include: locals owner
-- KEYS[1] = the worker's handle map, KEYS[2] = last sequence per worker, KEYS[3] = map version per worker,
-- KEYS[4] = incarnation per worker, KEYS[5] = last lease renewal per worker (the sweep's); ARGV = key base,
-- name, token, seq ("" = none: an update keeps the last one, a replace drops it), deletes (12-byte keys),
-- upserts (12-byte key + 16-byte value each), mode: "" update, "replace" (the map becomes exactly the
-- upserts), "drop" (map and sequence gone: a clear; the process stays recorded), "forget" (the incarnation
-- and renewal too: the worker is gone), both unfenced unless a token is given (the sweep's '!free': nobody
-- may hold the lease), incarnation ("" = the recorded one stays: the engine process the map describes, set
-- with it). A large "replace" comes in steps, none of which holds Redis for long: "fill" adds a chunk of
-- upserts to KEYS[1], a temporary map (no version bump: it is nobody's map yet; ARGV[8] = its TTL in ms),
-- then "replace" with KEYS[6] = that temporary map swaps it in whole (UNLINK frees the old map off the
-- main thread, RENAME is O(1)); -3 when the temporary map is gone (it expired: nothing changed).
-- -2 when fenced. Every other call bumps the version, so a reader that scans the map in chunks
-- (load_handles) can tell that it changed under it.
local base, name, token, seq, dels, ups, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local inc = ARGV[8]
local drop = mode == 'drop' or mode == 'forget'
if not (drop and token == '') and not fence_ok(base, name, token) then return -2 end
local function hset_records(key, recs)
  for start = 1, #recs, 28000 do
    local f = {}
    for off = start, min(#recs, start + 27999), 28 do
      f[#f + 1] = sub(recs, off, off + 11)
      f[#f + 1] = sub(recs, off + 12, off + 27)
    end
    call('HSET', key, unpack(f))
  end
end
if mode == 'fill' then
  hset_records(KEYS[1], ups)
  call('PEXPIRE', KEYS[1], inc)
  return 0
end
if mode == 'replace' and KEYS[6] and call('EXISTS', KEYS[6]) == 0 then return -3 end
call('HINCRBY', KEYS[3], name, 1)
if drop then
  call('DEL', KEYS[1])
  call('HDEL', KEYS[2], name)
  if mode == 'forget' then
    call('HDEL', KEYS[4], name)
    call('HDEL', KEYS[5], name)
  end
  return 0
end
if mode == 'replace' and KEYS[6] then
  call('UNLINK', KEYS[1])
  call('RENAME', KEYS[6], KEYS[1])
  call('PERSIST', KEYS[1])
elseif mode == 'replace' then
  call('DEL', KEYS[1])
end
for start = 1, #dels, 12000 do
  local f = {}
  for off = start, min(#dels, start + 11999), 12 do f[#f + 1] = sub(dels, off, off + 11) end
  call('HDEL', KEYS[1], unpack(f))
end
hset_records(KEYS[1], ups)
if seq ~= '' then
  call('HSET', KEYS[2], name, seq)
elseif mode == 'replace' then
  call('HDEL', KEYS[2], name)
end
if inc ~= '' then call('HSET', KEYS[4], name, inc) end
return 0
