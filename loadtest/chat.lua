-- wrk script of loadtest/overhead.sh and scripts/build-pgo.sh: POST /v1/chat/completions
-- with BODY_BYTES-byte bodies, 64 conversations sharing a system prompt (model "bench");
-- STREAM=1 asks for streamed (SSE) answers.
local size = tonumber(os.getenv("BODY_BYTES"))
local bodies = {}
local stream = os.getenv("STREAM") == "1" and '"stream":true,' or ""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local system = string.rep("You are a careful assistant. ", math.floor(size / 2 / 29))
for i = 1, 64 do
  local user = string.rep("question " .. i .. " ", math.floor(size / 2 / (10 + #tostring(i))))
  bodies[i] = '{"model":"bench",' .. stream .. '"messages":[{"role":"system","content":"' ..
    system .. '"},{"role":"user","content":"' .. user .. '"}]}'
end
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, "/v1/chat/completions", nil, bodies[(n % 64) + 1])
end
-- Think time uniform in [0, 2 * PACE_MS]: a fixed one keeps the 64 connections in step,
-- so they arrive as one burst of 64 every PACE_MS and measure their own queueing.
local pace = tonumber(os.getenv("PACE_MS") or "0")
if pace > 0 then
  delay = function() return math.random(0, 2 * pace) end
end
