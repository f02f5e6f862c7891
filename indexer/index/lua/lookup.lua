-- include: locals
-- KEYS[1] = id->name hash, KEYS[2] = name->id hash, KEYS[3] = blocks hash; ARGV = packed hashes,
-- "1" when only the names that follow are allowed (else "0"), [allowed names...].
-- Returns {g4_run, name, gpu, cpu, local, name, ...} for workers that hold block 0.
local packed = ARGV[1]
local allowed = nil
if ARGV[2] == '1' then
  allowed = {}
  for i = 3, #ARGV do
    local id = call('HGET', KEYS[2], ARGV[i])
    if id then allowed[tonumber(id)] = true end
  end
end
local n = #packed / 8
local v0 = call('HGET', KEYS[3], sub(packed, 1, 8))
if not v0 then return {0} end
-- block 0: who holds it; runs[wid] = {gpu, cpu, local, gpu alive, cpu alive, gpu token, cpu token}
local wids, runs = {}, {}
local g4, g4_alive = 0, false
for s in gmatch(v0, '-?%d+') do
  local m = tonumber(s)
  if m < 0 then
    g4, g4_alive = 1, true
  else
    local wid = floor(m / 2)
    if allowed == nil or allowed[wid] then
      local r = runs[wid]
      if r == nil then
        r = {0, 0, 1, false, false, ',' .. (wid * 2) .. ',', ',' .. (wid * 2 + 1) .. ','}
        runs[wid] = r
        wids[#wids + 1] = wid
      end
      if m % 2 == 0 then r[1], r[4] = 1, true else r[2], r[5] = 1, true end
    end
  end
end
-- later blocks, fetched in growing chunks (early exit stays cheap); only live runs are checked
local alive, na = {}, #wids
for i, wid in ipairs(wids) do alive[i] = runs[wid] end
local pos, chunk = 2, 16
while pos <= n and (na > 0 or g4_alive) do
  local last = min(n, pos + chunk - 1)
  local fields = {}
  for i = pos, last do fields[i - pos + 1] = sub(packed, i * 8 - 7, i * 8) end
  local vals = call('HMGET', KEYS[3], unpack(fields))
  for j = 1, #fields do
    local v = vals[j]
    if not v then
      na, g4_alive = 0, false
      break
    end
    local died = false
    for k = 1, na do
      local r = alive[k]
      local g = find(v, r[6], 1, true)
      local c = (r[5] or not g) and find(v, r[7], 1, true)
      if g or c then
        r[3] = r[3] + 1
        if r[4] then if g then r[1] = r[1] + 1 else r[4] = false end end
        if r[5] then if c then r[2] = r[2] + 1 else r[5] = false end end
      else
        r[8] = true
        died = true
      end
    end
    if died then
      local keep = {}
      for k = 1, na do if not alive[k][8] then keep[#keep + 1] = alive[k] end end
      alive, na = keep, #keep
    end
    if g4_alive then
      if find(v, ',-1,', 1, true) then g4 = g4 + 1 else g4_alive = false end
    end
    if na == 0 and not g4_alive then break end
  end
  pos = last + 1
  chunk = min(chunk * 4, 1024)
end
local out = {g4}
for _, wid in ipairs(wids) do
  local r = runs[wid]
  local name = call('HGET', KEYS[1], tostring(wid))
  if name then
    out[#out + 1] = name
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
  end
end
return out
