-- shared by the index scripts (included by name, see indexer/index/scripts.py)
-- the caller's cached worker id must still name this worker (Redis may have restarted, ids reassigned): -1;
-- its fencing token, when it holds the worker's lease, must still be current: -2. Token '!free': only
-- while nobody holds the lease (the sweep).
local function fence_ok(base, name, token)
  if token == '' then return true end
  if token == '!free' then return call('EXISTS', base .. 'lease:' .. name) == 0 end
  return call('GET', base .. 'fence:' .. name) == token
end
local function owner_check(base, m, name, token)
  if name == '' then return 0 end
  if call('HGET', base .. 'i', tostring(floor(tonumber(m) / 2))) ~= name then return -1 end
  if not fence_ok(base, name, token) then return -2 end
  return 0
end
