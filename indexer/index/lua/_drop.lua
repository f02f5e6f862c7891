-- shared by the index scripts (included by name, see indexer/index/scripts.py)
-- drop member token tok from the given fields; returns the number of fields that held it
local function drop(blocks, fields, vals, tok)
  local sets, dels = {}, {}
  for i, f in ipairs(fields) do
    local v = vals[i]
    if v then
      local s, e = find(v, tok, 1, true)
      if s then
        local nv = sub(v, 1, s) .. sub(v, e + 1)
        if nv == ',' then
          dels[#dels + 1] = f
        else
          sets[#sets + 1] = f
          sets[#sets + 1] = nv
        end
      end
    end
  end
  if #sets > 0 then call('HSET', blocks, unpack(sets)) end
  if #dels > 0 then call('HDEL', blocks, unpack(dels)) end
  return #sets / 2 + #dels
end
