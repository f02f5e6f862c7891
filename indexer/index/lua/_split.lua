-- shared by the index scripts (included by name, see indexer/index/scripts.py)
local function split(h8)
  local b1, b2, b3, b4, b5, b6, b7, b8 = byte(h8, 1, 8)
  local bucket = (b7 % 8) * 256 + b8
  local hi = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
  return bucket, format('%.0f', hi * 32 + floor(b7 / 8))
end
local function join(bucket, hi)
  local low5 = hi % 32
  local rest = (hi - low5) / 32
  local b = {}
  for i = 6, 1, -1 do
    local x = rest % 256
    b[i] = x
    rest = (rest - x) / 256
  end
  return char(b[1], b[2], b[3], b[4], b[5], b[6], low5 * 8 + floor(bucket / 256), bucket % 256)
end
