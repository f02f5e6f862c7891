-- KEYS[1] = the worker's handle map, KEYS[2] = last sequence per worker; ARGV[1] = name.
-- The map and its sequence as one snapshot: the fallback of load_handles when the map kept changing under
-- its chunked scan (it blocks Redis for the whole map, so it is not the first choice).
return {redis.call('HGETALL', KEYS[1]), redis.call('HGET', KEYS[2], ARGV[1])}
