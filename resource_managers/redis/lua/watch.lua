-- watch: has any watched key changed? (a read-only branch's vote)
-- KEYS: the watched keys; ARGV: their watches (see unchanged), in the same order
-- Reply: {'OK'} | {'CHANGED', key}
for i = 1, #KEYS do
  if not unchanged(KEYS[i], ARGV[i]) then return {'CHANGED', KEYS[i]} end
end
return {'OK'}
