-- wrk script of loadtest/overhead.sh's long-body runs: POST /v1/chat/completions with
-- conversations that grow as chat does. 16 conversations share a system prompt of
-- BODY_BYTES/4; each has its own history of BODY_BYTES/2 (user/assistant turns of ~4 KiB),
-- then 4 turns, each adding BODY_BYTES/16 (a user and an assistant message): turn t's body
-- is about BODY_BYTES * (3/4 + t/16), 13/16 to 16/16 of BODY_BYTES, mean 29/32. Request n
-- is conversation n % 16 at turn (n / 16) % 4 + 1, so each conversation's request extends
-- its previous one (after its fourth turn it starts over from the first).
local size = tonumber(os.getenv("BODY_BYTES"))
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

local function text(seed, bytes)
  local unit = "word" .. seed .. " "
  return string.rep(unit, math.max(1, math.floor(bytes / #unit)))
end

local function msg(role, content)
  return '{"role":"' .. role .. '","content":"' .. content .. '"}'
end

local system = msg("system", "You are a careful assistant. " .. text("s", size / 4))
local bodies = {}
for c = 1, 16 do
  local parts = { system }
  local history, turn_bytes = size / 2, 4096
  local i = 0
  while history > 0 do
    i = i + 1
    local role = (i % 2 == 1) and "user" or "assistant"
    parts[#parts + 1] = msg(role, text(c .. "h" .. i, math.min(turn_bytes, history)))
    history = history - turn_bytes
  end
  bodies[c] = {}
  for t = 1, 4 do
    parts[#parts + 1] = msg("user", text(c .. "u" .. t, size / 32))
    bodies[c][t] = '{"model":"bench","messages":[' .. table.concat(parts, ",") .. ']}'
    parts[#parts + 1] = msg("assistant", text(c .. "a" .. t, size / 32))
  end
end

local n = 0
request = function()
  local c, t = n % 16 + 1, math.floor(n / 16) % 4 + 1
  n = n + 1
  return wrk.format(nil, "/v1/chat/completions", nil, bodies[c][t])
end
