-- include: locals split drop owner
-- ARGV = key base, member, first bucket, end bucket (exclusive), worker name ("" for G4), fencing token
local base, m = ARGV[1], ARGV[2]
local bad = owner_check(base, m, ARGV[5], ARGV[6])
if bad < 0 then return bad end
local rpre, tok = base .. 'r:' .. m .. ':', ',' .. m .. ','
local removed = 0
for bucket = tonumber(ARGV[3]), tonumber(ARGV[4]) - 1 do
  local rkey = rpre .. bucket
  local his = call('SMEMBERS', rkey)
  for start = 1, #his, 1000 do
    local fields = {}
    for i = start, min(#his, start + 999) do fields[#fields + 1] = join(bucket, tonumber(his[i])) end
    removed = removed + drop(KEYS[2], fields, call('HMGET', KEYS[2], unpack(fields)), tok)
  end
  if #his > 0 then call('DEL', rkey) end
end
if removed > 0 then call('HINCRBY', KEYS[1], m, -removed) end
return removed
