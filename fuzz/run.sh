#!/usr/bin/env bash
# Bounded fuzz run of every cargo-fuzz target (not part of CI).
#
#   fuzz/run.sh                          # every target, 60 s each
#   FUZZ_SECONDS=300 fuzz/run.sh kv_decode
#
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly rustc flags (-Zsanitizer=...):
# with a nightly toolchain installed (`rustup toolchain install nightly`) it uses
# `cargo +nightly fuzz`; without one it falls back to the stable toolchain with
# RUSTC_BOOTSTRAP=1 (which unlocks the same -Z flags on a stable compiler). Both work here
# (nightly 1.97; stable 1.95 with RUSTC_BOOTSTRAP=1): see fuzz/README.md.
#
# Seeds come from the repository (KV-event fixtures, example routing files, request
# bodies written below); the corpus grows in fuzz/corpus/<target> (git-ignored). A crash
# leaves its input in fuzz/artifacts/<target>/ and makes this script exit non-zero:
# commit such an input as a regression test next to the code it broke.
#
# Knobs: FUZZ_SECONDS (60 per target), FUZZ_JOBS (1), FUZZ_SANITIZER (address | none),
# FUZZ_TOOLCHAIN (nightly | stable-bootstrap, default: nightly when installed).
set -euo pipefail
cd "$(dirname "$0")"
FUZZ_DIR=$(pwd)
ROOT=$(cd .. && pwd)
SECONDS_EACH="${FUZZ_SECONDS:-60}"
SANITIZER="${FUZZ_SANITIZER:-address}"
ALL_TARGETS=(prompt_parse response_id token_ids kv_decode config_parse)
if [ $# -gt 0 ]; then TARGETS=("$@"); else TARGETS=("${ALL_TARGETS[@]}"); fi
# Sanitizer builds stay out of any shared target directory.
export CARGO_TARGET_DIR="$FUZZ_DIR/target"

if ! cargo fuzz --version > /dev/null 2>&1; then
  echo "installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

TOOLCHAIN="${FUZZ_TOOLCHAIN:-}"
if [ -z "$TOOLCHAIN" ]; then
  if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then TOOLCHAIN=nightly; else TOOLCHAIN=stable-bootstrap; fi
fi
case "$TOOLCHAIN" in
  nightly) CARGO=(cargo +nightly) ;;
  stable-bootstrap) export RUSTC_BOOTSTRAP=1; CARGO=(cargo +stable) ;;
  *) echo "FUZZ_TOOLCHAIN must be nightly or stable-bootstrap" >&2; exit 2 ;;
esac
echo "toolchain: $TOOLCHAIN ($("${CARGO[@]}" --version)), sanitizer: $SANITIZER" >&2

# Seed corpora from what the repository already has.
seed() { mkdir -p "seeds/$1"; }
seed kv_decode; cp "$ROOT"/tests/fixtures/kv_events/*.bin seeds/kv_decode/
seed config_parse; cp "$ROOT"/conf/*.toml seeds/config_parse/
# Once a crash: a quoted key with a newline split a problem over two lines.
printf '"a\\nb" = 1\n[limits]\n"x\\ty" = 2\n' > seeds/config_parse/control_chars
seed token_ids
printf '1,2,3' > seeds/token_ids/short
printf ' 0 , 4294967295,17 ' > seeds/token_ids/edges
seq -s, 1 2000 | tr -d '\n' > seeds/token_ids/long
seed prompt_parse
# First byte: the endpoint (`Endpoint::ALL[byte % 15]`: 0 chat, 1 completions, 2 responses,
# 3 messages, 5 embeddings, 13 transcriptions) and the upstream model (byte / 32 % 2).
printf '\0{"model":"llama","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"stream":true}' > seeds/prompt_parse/chat
printf '\0{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:a"}}]},{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}]}' > seeds/prompt_parse/parts
printf '\1{"model":"m","prompt":"abc","stream":false}' > seeds/prompt_parse/completion
printf '\1{"model":"m","prompt":[[1,2],[3]]}' > seeds/prompt_parse/token_batch
printf '\56{"model":"m\\u00e9\\"","prompt":["a","b"]}' > seeds/prompt_parse/escaped_model
printf '\2{"model":"m","instructions":"S","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call","name":"f","arguments":"{}","call_id":"c"},{"type":"function_call_output","call_id":"c","output":"ok"}],"previous_response_id":"resp_1","stream":true}' > seeds/prompt_parse/responses
printf '\3{"model":"m","system":[{"type":"text","text":"S"}],"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"a":1}}]}]}' > seeds/prompt_parse/messages
printf '\5{"input":["a"],"model":"m","encoding_format":"float"}' > seeds/prompt_parse/embeddings
printf '\15--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--XyZ--\r\n' > seeds/prompt_parse/transcription
seed response_id
printf '\0{"id":"resp_1","object":"response","output":[{"id":"msg_1"}]}' > seeds/response_id/json
printf '\1event: response.created\ndata: {"type":"response.created","response":{"id":"resp_2","output":[]}}\n\n' > seeds/response_id/sse

status=0
summary="| target | seconds | runs | corpus | result |\n|---|---:|---:|---:|---|\n"
for t in "${TARGETS[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log="$FUZZ_DIR/target/fuzz-$t.log"
  echo "### $t: ${SECONDS_EACH} s" >&2
  set +e
  "${CARGO[@]}" fuzz run --release --sanitizer "$SANITIZER" "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -max_len=65536 -timeout=10 \
    -jobs="${FUZZ_JOBS:-1}" -workers="${FUZZ_JOBS:-1}" -print_final_stats=1 > "$log" 2>&1
  rc=$?
  set -e
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  corpus=$(find "corpus/$t" -type f | wc -l)
  if [ $rc -eq 0 ]; then result=ok; else result="CRASH (exit $rc, see $log and artifacts/$t/)"; status=1; fi
  summary+="| $t | $SECONDS_EACH | ${runs:-?} | $corpus | $result |\n"
done
printf "%b" "$summary"
exit $status
