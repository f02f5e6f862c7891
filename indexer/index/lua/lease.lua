-- include: locals
-- KEYS[1] = lease, KEYS[2] = fencing counter, KEYS[3] = last renewal per worker (ms); ARGV = owner, ttl ms,
-- name. Returns the owner's fencing token, or nil while another owner holds the lease.
local cur = call('GET', KEYS[1])
local t = call('TIME')
local now = t[1] * 1000 + floor(t[2] / 1000)
if cur == ARGV[1] then
  call('PEXPIRE', KEYS[1], ARGV[2])
  call('HSET', KEYS[3], ARGV[3], now)
  return call('GET', KEYS[2])
end
if cur then return false end
call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local token = call('INCR', KEYS[2])
call('HSET', KEYS[3], ARGV[3], now)
return tostring(token)
