-- include: locals
-- KEYS[1] = lease, KEYS[2] = fencing token, KEYS[3] = last renewal per worker (ms); ARGV = owner, ttl ms,
-- name. Returns the owner's fencing token, or nil while another owner holds the lease. The token is the
-- owner and a count (<owner>:<n>): after Redis lost its data the count starts again, and a count alone
-- would equal a stale holder's token (its writes would pass the fence).
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
local last = call('GET', KEYS[2])
local n = (last and tonumber(match(last, '(%d+)$')) or 0) + 1
local token = ARGV[1] .. ':' .. n
call('SET', KEYS[2], token)
call('HSET', KEYS[3], ARGV[3], now)
return token
