-- include: locals split drop owner member_write
-- KEYS and ARGV as store.lua; returns the entries removed (or -1/-2).
return each_chunk(function(fields, vals)
  for i, f in ipairs(fields) do
    local v = vals[i]
    if v and find(v, tok, 1, true) then
      local bucket, hi = split(f)
      call('SREM', rpre .. bucket, hi)
    end
  end
  return drop(KEYS[2], fields, vals, tok)
end, -1)
