-- include: locals split owner member_write
-- Writes. KEYS[1] = counts hash, KEYS[2] = blocks hash; ARGV: see _member_write.lua. Fields are read with
-- one HMGET and written with one HSET per chunk of 1000 blocks. Returns the entries added, -1 (nothing
-- written) when the member's id no longer names the worker, -2 when the fencing token is stale.
return each_chunk(function(fields, vals)
  local sets = {}
  for i, f in ipairs(fields) do
    local v = vals[i]
    local nv = nil
    if not v then nv = tok elseif not find(v, tok, 1, true) then nv = v .. m .. ',' end
    if nv then
      sets[#sets + 1] = f
      sets[#sets + 1] = nv
      local bucket, hi = split(f)
      call('SADD', rpre .. bucket, hi)
    end
  end
  if #sets > 0 then call('HSET', KEYS[2], unpack(sets)) end
  return #sets / 2
end, 1)
