-- shared by the index scripts (included by name, see indexer/index/scripts.py)
local call, find, sub, byte, char = redis.call, string.find, string.sub, string.byte, string.char
local format, floor, gmatch, match, min = string.format, math.floor, string.gmatch, string.match, math.min
local ipairs, unpack, tonumber, tostring = ipairs, unpack, tonumber, tostring
