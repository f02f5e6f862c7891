-- include: locals
-- KEYS[1] = name->id, KEYS[2] = id->name, KEYS[3] = id counter; ARGV[1] = name
local id = call('HGET', KEYS[1], ARGV[1])
if id then return tonumber(id) end
id = call('INCR', KEYS[3]) - 1
call('HSET', KEYS[1], ARGV[1], id)
call('HSET', KEYS[2], id, ARGV[1])
return id
