-- shared by store and remove: ARGV = key base "P:{M}:", member, packed hashes (unique), worker name ("" for
-- G4), fencing token; stops with -1/-2 (owner_check). apply(fields, vals) runs per chunk of 1000 blocks
-- after one HMGET and returns how many entries it changed; the member's count moves by their sum * sign.
local base, m, packed = ARGV[1], ARGV[2], ARGV[3]
local bad = owner_check(base, m, ARGV[4], ARGV[5])
if bad < 0 then return bad end
local rpre, tok = base .. 'r:' .. m .. ':', ',' .. m .. ','
local function each_chunk(apply, sign)
  local changed = 0
  for start = 1, #packed, 8000 do
    local fields = {}
    for off = start, min(#packed, start + 7999), 8 do fields[#fields + 1] = sub(packed, off, off + 7) end
    changed = changed + apply(fields, call('HMGET', KEYS[2], unpack(fields)))
  end
  if changed > 0 then call('HINCRBY', KEYS[1], m, sign * changed) end
  return changed
end
