-- include: locals
-- KEYS[1] = lease; ARGV[1] = owner. Deletes the lease only while that owner holds it, in one step: a GET
-- then a DEL deleted the lease of another owner that took it over between the two (ours had lapsed).
if call('GET', KEYS[1]) == ARGV[1] then call('DEL', KEYS[1]) end
return 0
