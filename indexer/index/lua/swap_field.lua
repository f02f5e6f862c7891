-- KEYS[1] = a hash; ARGV = field, value. Sets the field and returns the value it had (nil: none), in one
-- step: two gateways recording a worker's incarnation at once each see the other's or the first one's.
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return old
