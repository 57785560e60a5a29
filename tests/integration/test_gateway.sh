#!/usr/bin/env bash
# The HTTP gateway end to end: deploy/local.sh starts a cluster with the toy
# number models and their tokenizers, and curl and the official openai Node
# client (installed from the npm registry into the build tree) call it:
# completions plain and streamed, transcriptions in every response format,
# refusals (bad uploads, unknown models, oversized bodies, malformed JSON,
# the request and connection limits), while tandem-client keeps being
# served over ZeroMQ.
#   tests/integration/test_gateway.sh BIN_DIR WORK_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
test_dirs "$1" "$2"
t5="$root/tests/data/toy-numbers-t5"
wh="$root/tests/data/toy-numbers-whisper"
status_is() { # want, curl args...
  local want=$1; shift
  local got
  got=$(curl -s -o "$work/body" -w '%{http_code}' "$@")
  [[ $got == "$want" ]] || { echo "  HTTP $got (want $want): $(head -c 400 "$work/body")" >&2; return 1; }
  grep -q '"error"' "$work/body" || [[ $want == 200 ]] || { echo "  no error object: $(head -c 400 "$work/body")" >&2; return 1; }
}

# ---- the openai Node client, from the npm registry (CI reaches it: no skipping)
npm_dir="$work/npm"
mkdir -p "$npm_dir"
if [[ ! -f $npm_dir/node_modules/openai/package.json ]]; then
  if ! (cd "$npm_dir" && npm install --no-audit --no-fund --loglevel=error --cache "$work/npm-cache" openai@4 >"$work/npm.log" 2>&1); then
    echo "FAIL npm install openai@4 (the test needs the npm registry):" >&2
    cat "$work/npm.log" >&2
    exit 1
  fi
fi
cp "$root/tests/integration/gateway_openai.mjs" "$npm_dir/"

# ---- a cluster through local.sh; "router EP" and "gateway URL" come out
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
start_cluster() { # name, local.sh args...
  local name=$1; shift
  rm -rf "$work/$name"
  # a previous run's files would answer the wait below before the new process truncates them
  rm -f "$work/$name.out" "$work/$name.err"
  "$root/deploy/local.sh" --run-dir "$work/$name" --encoders 1 --prefills 0 "$@" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  for _ in $(seq 600); do
    grep -q '^gateway ' "$work/$name.out" 2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  router=$(awk '/^router /{print $2}' "$work/$name.out")
  gw=$(awk '/^gateway /{print $2}' "$work/$name.out")
  if [[ -z $router || -z $gw ]]; then
    kill -0 "${pids[-1]}" 2>/dev/null || { wait "${pids[-1]}"; echo "local.sh exited with $?"; }
    echo "FAIL $name: the cluster did not start"
    cat "$work/$name.out" "$work/$name.err"
    exit 1
  fi
  echo "$name: router $router, gateway $gw"
}
stop_cluster() { # stops the last cluster; its gateway's log must hold no sanitizer report
  local p=${pids[-1]} name=$1
  kill -TERM "$p" 2>/dev/null
  wait "$p" 2>/dev/null
  unset 'pids[-1]'
  check "$name: the gateway's log holds no sanitizer report" \
    bash -c "! grep -E 'ERROR: (Address|Leak)Sanitizer|runtime error:' '$work/$name/gateway.log'"
}

# ---------------------------------------------------------------- text (T5)
start_cluster text --model "$t5"
j='Content-Type: application/json'
r=$(curl -s "$gw/v1/models"); check "models" has "$r" '"id":"toy-numbers-t5"'
r=$(curl -s "$gw/health"); check "health" has "$r" '"status":"ok"'
# GETs keep the connection open for the next request (a client's pool): three on one connection
r=$(curl -sv "$gw/health" "$gw/v1/models" "$gw/metrics" -o /dev/null -o /dev/null -o /dev/null 2>&1)
check "GETs keep the connection alive" test "$(grep -c 'Re-using existing connection' <<<"$r")" = 2

# ZeroMQ clients all along the HTTP part
zmq_req="$work/zmq.jsonl"
: >"$zmq_req"
for i in $(seq 40); do echo "{\"id\": \"z$i\", \"input_ids\": [39, 8, 26, 11, 27, 10, 1], \"max_new_tokens\": 12}" >>"$zmq_req"; done
( for k in 1 2 3; do "$bin/tandem-client" --router "$router" --requests "$zmq_req" --timeout-ms 60000; done ) \
  >"$work/zmq.out" 2>&1 &
zmq_pid=$!

r=$(curl -s "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "four thousand two hundred seven", "max_tokens": 12}')
check "completion" has "$r" '"text":"4207","index":0,"logprobs":null,"finish_reason":"stop"'
r=$(curl -sN "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": ["forty two", "seven"], "stream": true, "max_tokens": 12}')
check "streamed completion ends with [DONE]" has "$r" 'data: [DONE]'
txt=$(grep '"index":0' <<<"$r" | grep -o '"text":"[^"]*"' | cut -d'"' -f4 | tr -d '\n')
check "streamed completion's text (choice 0: 42)" test "$txt" = 42
r=$(curl -s "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "nine hundred ninety nine thousand nine hundred ninety nine", "stop": ["99"], "max_tokens": 12}')
check "a stop string cuts the text" has "$r" '"text":"","index":0'
# concurrent HTTP requests share the router link
par=()
for i in $(seq 16); do
  curl -s "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "three hundred five", "max_tokens": 12}' >"$work/par$i" &
  par+=($!)
done
wait "${par[@]}"
ok=0; for i in $(seq 16); do grep -q '"text":"305"' "$work/par$i" && ok=$((ok + 1)); done
check "16 concurrent completions" test "$ok" = 16

check "unknown model: 404" status_is 404 "$gw/v1/completions" -H "$j" -d '{"model": "gpt-4", "prompt": "seven"}'
check "malformed JSON: 400" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "se'
check "huge max_tokens: 400" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven", "max_tokens": 100000000}'
check "max_tokens past the model: 400" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven", "max_tokens": 60000}'
check "a streamed request the router refuses: 400 before the stream" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven", "max_tokens": 60000, "stream": true}'
check "token id outside the vocabulary: 400" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": [5, 99999]}'
head -c $((3 << 20)) /dev/zero | tr '\0' ' ' >"$work/big.json"
check "oversized JSON body: 413" status_is 413 "$gw/v1/completions" -H "$j" --data-binary @"$work/big.json"
check "oversized chunked body: 413" status_is 413 "$gw/v1/completions" -H "$j" -H 'Transfer-Encoding: chunked' --data-binary @"$work/big.json"
check "unknown endpoint: 404" status_is 404 "$gw/v1/chat/completions" -H "$j" -d '{}'
check "GET on a POST endpoint: 405" status_is 405 "$gw/v1/completions"
check "audio endpoint on a text model: 400" status_is 400 "$gw/v1/audio/transcriptions" -F model=toy-numbers-t5 -F file=@"$wh/number-7.wav"
hdr=$(head -c 100000 /dev/zero | tr '\0' 'a')
code=$(curl -s -o /dev/null -w '%{http_code}' "$gw/health" -H "X-Big: $hdr")
check "a header past the connection's buffer: 431 ($code)" test "$code" = 431
# garbage on the socket, then the gateway still answers
printf 'NOT HTTP AT ALL\r\n\r\n\x00\xff' | timeout 5 bash -c "cat > /dev/tcp/${gw#http://}" 2>/dev/null
check "a JSON field given twice: 400" status_is 400 "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven", "stop": ["a","b","c","d"], "stop": ["e","f","g","h"]}'
check "... naming it" grep -q '"param":"stop"' "$work/body"
r=$(curl -s "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven"}')
check "still serving after garbage" has "$r" '"text":"7"'
# the gateway's own Prometheus metrics count what was answered above
r=$(curl -s "$gw/metrics")
ep='endpoint="/v1/completions"'
check "metrics: 20 completions answered 200" has "$r" "tandem:gateway_requests_total{$ep,code=\"200\"} 20"
check "metrics: 6 refused 400" has "$r" "tandem:gateway_requests_total{$ep,code=\"400\"} 6"
check "metrics: 2 bodies too large (413)" has "$r" "tandem:gateway_requests_total{$ep,code=\"413\"} 2"
check "metrics: an unknown model (404)" has "$r" "tandem:gateway_requests_total{$ep,code=\"404\"} 1"
check "metrics: a GET on a POST endpoint (405)" has "$r" "tandem:gateway_requests_total{$ep,code=\"405\"} 1"
check "metrics: an unknown endpoint" has "$r" 'tandem:gateway_requests_total{endpoint="other",code="404"} 1'
check "metrics: the audio endpoint's refusal" has "$r" 'tandem:gateway_requests_total{endpoint="/v1/audio/transcriptions",code="400"} 1'
check "metrics: one stream's first event" has "$r" "tandem:gateway_time_to_first_token_seconds_count{$ep} 1"
for st in admit cluster answer; do
  check "metrics: the stream's first event, stage $st" has "$r" "tandem:gateway_first_event_stage_seconds_count{$ep,stage=\"$st\"} 1"
done
check "metrics: request durations" has "$r" "tandem:gateway_request_duration_seconds_count{$ep} "
gen=$(grep "^tandem:gateway_generation_tokens_total{$ep}" <<<"$r" | awk '{print $2}')
check "metrics: generated tokens counted ($gen)" test "${gen:-0}" -gt 20
check "metrics: POST /metrics is 405" status_is 405 "$gw/metrics" -d x

# bench-serve over ZeroMQ reads every worker's counters before and after the run: the decode worker
# stepped and generated, the encoder ran the four inputs in one to four runs; each began after the run's
# start and ended before its end (ms)
bs=$("$bin/bench-serve" --router "$router" --model "$t5" --workload trt --requests 4 --concurrency 2 --seed 4242 2>&1)
check "bench-serve --router: four answered" has "$bs" "| 2 in flight | 4/4 |"
check "bench-serve --router: the decode worker's steps and batch" \
  grep -qE '^\| 2 in flight \| decode-0 \| [0-9.]+ \| [1-9][0-9]* \| [1-9][0-9.]* \| [0-9.]+ \| 0 \| 0 \| 0\.0 \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+|-) \|$' <<<"$bs"
check "bench-serve --router: the encoder's runs" \
  grep -qE '^\| 2 in flight \| encoder-0 \| [0-9.]+ \| 0 \| 0\.0 \| 0\.00 \| 4 \| [1-4] \| [0-9.]+ \| 0\.0 \| [0-9.]+ \| ([0-9.]+|-) \|$' <<<"$bs"
# the router's stages: the decode worker's part of the first token, reported, within the whole
first_parts() {
  awk -F' [|] ' '$1 == "| 2 in flight" && NF == 11 && $2 ~ /^[0-9.]+$/ { ok = $8 > 0 && $8 <= $7 + 0.01 } END { exit !ok }' <<<"$bs"
}
check "bench-serve --router: the first token's part on its worker" first_parts

# bench-serve over HTTP reads the gateway's stages of the run's first events back from /metrics
bs=$("$bin/bench-serve" --gateway "$gw" --model "$t5" --workload trt --requests 4 --concurrency 1 2>&1)
check "bench-serve --gateway: four streams answered" has "$bs" "| 1 in flight | 4/4 |"
check "bench-serve --gateway: the gateway's stages of those four" grep -qE '^\| 1 in flight \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| 4 \|$' <<<"$bs"
check "bench-serve --gateway: the client's side of those four" grep -qE '^\| 1 in flight( \| [0-9.]+){4} \| 4 \|$' <<<"$bs"
# a burst on warm connections opens none: 8 warmed, then 8 sent at once; with bench-serve's model list,
# its two scrapes of /metrics and this check's, 12 connections (20 if the burst opened its own)
opened() { curl -s "$gw/metrics" | awk '/^tandem:gateway_connections_opened_total / {print $2}'; }
c0=$(opened)
bs=$("$bin/bench-serve" --gateway "$gw" --model "$t5" --workload trt --requests 8 --http-warm 8 2>&1)
c1=$(opened)
check "bench-serve --gateway: a burst of 8 answered" has "$bs" "| all at once | 8/8 |"
check "a burst on 8 warm connections opens no more ($c0 -> $c1)" test $((c1 - c0)) -le 14

check "openai Node client (text)" node "$npm_dir/gateway_openai.mjs" text "$gw" toy-numbers-t5

# the limits on requests in flight (429) and connections, on a second gateway of the same cluster
rm -f "$work/gw2.log" "$work/gw3.log" # a previous run's logs would answer the waits below
"$bin/tandem-gateway" --router "$router" --model "$t5" --port 0 --max-requests 1 --max-connections 3 \
  --idle-timeout-s 5 >"$work/gw2.log" 2>&1 &
gw2_pid=$!
for _ in $(seq 100); do grep -q "gateway serving" "$work/gw2.log" && break; sleep 0.05; done
gw2=$(grep -o 'http://[0-9.:]*' "$work/gw2.log" | head -1)
hp=${gw2#http://}
exec 7<>"/dev/tcp/${hp%:*}/${hp#*:}"   # a request whose body never comes holds the one slot
printf 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{' >&7
sleep 0.3
check "requests past --max-requests: 429" status_is 429 "$gw2/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven"}'
exec 8<>"/dev/tcp/${hp%:*}/${hp#*:}"
exec 9<>"/dev/tcp/${hp%:*}/${hp#*:}"
sleep 0.3
# past the limit a connection waits in the listen backlog until one closes
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$gw2/health")
check "connections past --max-connections wait ($code)" test "$code" = 000
exec 7>&- 8>&- 9>&-
sleep 0.3
r=$(curl -s "$gw2/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven"}')
check "the second gateway serves once the slots are free" has "$r" '"text":"7"'
kill -TERM "$gw2_pid"; wait "$gw2_pid"
check "the second gateway stops cleanly" test $? = 0

# a gateway whose threads poll before they sleep (--spin-us): the same answers, streamed and not
rm -f "$work/gw3.log"
"$bin/tandem-gateway" --router "$router" --model "$t5" --port 0 --spin-us 2000 >"$work/gw3.log" 2>&1 &
gw3_pid=$!
for _ in $(seq 100); do grep -q "gateway serving" "$work/gw3.log" && break; sleep 0.05; done
gw3=$(grep -o 'http://[0-9.:]*' "$work/gw3.log" | head -1)
r=$(curl -s "$gw3/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "forty two", "max_tokens": 12}')
check "--spin-us: an answer" has "$r" '"text":"42"'
r=$(curl -sN "$gw3/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": ["seven", "three hundred five"], "stream": true, "max_tokens": 12}')
check "--spin-us: a stream of two prompts ends" has "$r" 'data: [DONE]'
txt0=$(grep '"index":0' <<<"$r" | grep -o '"text":"[^"]*"' | cut -d'"' -f4 | tr -d '\n')
txt1=$(grep '"index":1' <<<"$r" | grep -o '"text":"[^"]*"' | cut -d'"' -f4 | tr -d '\n')
check "--spin-us: the streamed text (7, 305)" test "$txt0 $txt1" = "7 305"
kill -TERM "$gw3_pid"; wait "$gw3_pid"
check "--spin-us: the gateway stops cleanly" test $? = 0

# a gateway that asks for API keys (--api-keys): curl and the openai client with and without one
rm -f "$work/gw4.log"
keyfile="$work/api.keys"
(umask 077 && printf '# keys\nsk-tandem-one\nsk-tandem-two\n' >"$keyfile")
chmod 644 "$keyfile"
"$bin/tandem-gateway" --router "$router" --model "$t5" --port 0 --api-keys "$keyfile" >"$work/gw4.log" 2>&1
check "--api-keys readable by others: refused at start" grep -q "readable by others (mode 644): chmod 600 it" "$work/gw4.log"
chmod 600 "$keyfile"
"$bin/tandem-gateway" --router "$router" --model "$t5" --port 0 --api-keys "$keyfile" >"$work/gw4.log" 2>&1 &
gw4_pid=$!
for _ in $(seq 100); do grep -q "gateway serving" "$work/gw4.log" && break; sleep 0.05; done
gw4=$(grep -o 'http://[0-9.:]*' "$work/gw4.log" | head -1)
body='{"model": "toy-numbers-t5", "prompt": "seven"}'
check "--api-keys: a completion without a key: 401" status_is 401 "$gw4/v1/completions" -H "$j" -d "$body"
check "... as OpenAI's invalid_api_key" has "$(cat "$work/body")" '"code":"invalid_api_key"'
check "--api-keys: a wrong key: 401" status_is 401 "$gw4/v1/completions" -H "$j" -H 'Authorization: Bearer sk-tandem-on' -d "$body"
check "--api-keys: an upload without a key: 401" status_is 401 "$gw4/v1/audio/transcriptions" -F model=x -F file=@"$wh/number-7.wav"
check "--api-keys: /v1/models without a key: 401" status_is 401 "$gw4/v1/models"
check "--api-keys: the second key: 200" status_is 200 "$gw4/v1/completions" -H "$j" -H 'Authorization: Bearer sk-tandem-two' -d "$body"
check "... with the answer" has "$(cat "$work/body")" '"text":"7"'
check "--api-keys: /health without a key: 200" status_is 200 "$gw4/health"
check "--api-keys: the refusals counted in /metrics" has "$(curl -s "$gw4/metrics")" 'code="401"'
check "--api-keys: a refusal logged" grep -q "refused: no API key" "$work/gw4.log"
check "openai Node client with and without the key" node "$npm_dir/gateway_openai.mjs" keys "$gw4" toy-numbers-t5 sk-tandem-one
kill -TERM "$gw4_pid"; wait "$gw4_pid"
check "--api-keys: the gateway stops cleanly" test $? = 0

wait "$zmq_pid"
check "tandem-client served meanwhile (3 x 40 requests)" test "$(grep -c '"tokens"' "$work/zmq.out")" = 120

# the router killed while it holds requests (decode-0 stopped: they cannot end first): plain and streamed ones
# answer 503 with an error object at once, not at their deadline; the supervisor's new router serves the next
held() { # name, stream
  curl -s -o "$work/$1.body" -w '%{http_code} %{time_total}' "$gw/v1/completions" -H "$j" \
    -d "{\"model\": \"toy-numbers-t5\", \"prompt\": \"seven\", \"max_tokens\": 12, \"stream\": $2}" >"$work/$1.out"
}
kill -STOP "$(cat "$work/text/decode-0.pid")"
held held_plain false & hp=$!
held held_stream true & hs=$!
sleep 1
kill -KILL "$(cat "$work/text/router.pid")"
wait "$hp" "$hs"
kill -CONT "$(cat "$work/text/decode-0.pid")"
for h in held_plain held_stream; do
  read -r code secs <"$work/$h.out"
  check "$h: 503 when the router dies ($code after ${secs}s)" awk -v c="$code" -v s="$secs" 'BEGIN { exit !(c == 503 && s < 4) }'
  check "$h: ... saying the router is unreachable" grep -q '"code":"router_unreachable"' "$work/$h.body"
done
served() { r=$(curl -s "$gw/v1/completions" -H "$j" -d '{"model": "toy-numbers-t5", "prompt": "seven"}'); [[ $r == *'"text":"7"'* ]]; }
check "the gateway serves through the restarted router" wait_for 300 served
stop_cluster text

# ---------------------------------------------------------------- audio (Whisper)
start_cluster audio --model "$wh" --tokenizer "$wh"
m=toy-numbers-whisper
tr="$gw/v1/audio/transcriptions"
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-4207.wav"); check "transcription json" test "$r" = '{"text":"4207"}'
r=$(curl -s "$gw/metrics")
sec=$(grep '^tandem:gateway_audio_seconds_total{endpoint="/v1/audio/transcriptions"}' <<<"$r" | awk '{print $2}')
check "metrics: the transcription's audio seconds ($sec)" awk -v s="${sec:-0}" 'BEGIN { exit !(s > 0.5 && s < 10) }'
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-42.wav" -F response_format=text); check "transcription text" test "$r" = 42
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F response_format=srt)
check "transcription srt" has "$r" $'1\n00:00:00,000 --> 00:00:0'
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F response_format=vtt)
check "transcription vtt" has "$r" $'WEBVTT\n\n00:00:00.000 --> 00:00:0'
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-305.wav" -F response_format=verbose_json)
check "transcription verbose_json" has "$r" '"task":"transcribe","language":"en","duration":'
check "verbose_json segments" has "$r" '"segments":[{"id":0,"seek":0,"start":0,'
r=$(curl -s "$tr" -F model=$m -F file=@"$wh/number-305.wav" -F response_format=verbose_json -F 'timestamp_granularities[]=segment')
check "verbose_json with segment timestamps" has "$r" '"segments":['
r=$(curl -sN "$tr" -F model=$m -F file=@"$wh/number-305.wav" -F stream=true)
check "streamed transcription" has "$r" '"type":"transcript.text.done","text":" 305"'
check "translation" status_is 200 "$gw/v1/audio/translations" -F model=$m -F file=@"$wh/number-7.wav"
check "unknown model: 404" status_is 404 "$tr" -F model=whisper-1 -F file=@"$wh/number-7.wav"
check "no file: 400" status_is 400 "$tr" -F model=$m
head -c 5000 /dev/urandom >"$work/noise.bin"
check "a file that is no audio: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/noise.bin"
head -c 20000 "$wh/number-4207.wav" >"$work/cut.wav"
check "a truncated wav answers (200 or 400)" bash -c "c=\$(curl -s -o /dev/null -w '%{http_code}' '$tr' -F model=$m -F file=@'$work/cut.wav'); [[ \$c == 200 || \$c == 400 ]]"
check "not multipart: 400" status_is 400 "$tr" -H "$j" -d '{"model": "x"}'
check "a malformed multipart body: 400" status_is 400 "$tr" -H 'Content-Type: multipart/form-data; boundary=XX' --data-binary $'--XX\r\nContent-Disposition: form-data; name="model"\r\n\r\nabc\r\n--XY--'
check "an unknown form field: 400" status_is 400 "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F colour=red
check "a form field given twice: 400" status_is 400 "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F language=en -F language=de
check "... naming it" grep -q '"param":"language"' "$work/body"
check "a model name past its bound: 400" status_is 400 "$tr" -F model="$m$(printf 'x%.0s' $(seq 200))" -F file=@"$wh/number-7.wav"
check "a NaN temperature: 400" status_is 400 "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F temperature=nan
check "an unknown response_format: 400" status_is 400 "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F response_format=xml
check "word timestamps: 400" status_is 400 "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F 'timestamp_granularities[]=word'
# a 5 s WAV (the model's window is 4 s): transcribed long-form (tests/integration/test_longform.sh has the rest)
node -e '
const n = 5 * 16000, b = Buffer.alloc(44 + 2 * n);
b.write("RIFF", 0); b.writeUInt32LE(36 + 2 * n, 4); b.write("WAVEfmt ", 8); b.writeUInt32LE(16, 16);
b.writeUInt16LE(1, 20); b.writeUInt16LE(1, 22); b.writeUInt32LE(16000, 24); b.writeUInt32LE(32000, 28);
b.writeUInt16LE(2, 32); b.writeUInt16LE(16, 34); b.write("data", 36); b.writeUInt32LE(2 * n, 40);
require("fs").writeFileSync(process.argv[1], b);' "$work/long.wav"
check "audio longer than the window: long-form, 200" status_is 200 "$tr" -F model=$m -F file=@"$work/long.wav" -F response_format=verbose_json
check "... a segment a window (5 s of silence: 2)" grep -q '"seek":400,' "$work/body"
head -c $((26 << 20)) /dev/zero >"$work/huge.wav"
check "an upload past 25 MB: 413" status_is 413 "$tr" -F model=$m -F file=@"$work/huge.wav"
check "a completion on an audio model: 400" status_is 400 "$gw/v1/completions" -H "$j" -d "{\"model\": \"$m\", \"prompt\": \"x\"}"
# uploads held at once past --max-held-bytes: 503
"$bin/tandem-gateway" --router "$router" --model "$wh" --tokenizer "$wh" \
  --port 0 --max-held-bytes 10000 --idle-timeout-s 1 >"$work/gw3.log" 2>&1 &
gw3_pid=$!
for _ in $(seq 200); do grep -q "gateway serving" "$work/gw3.log" && break; sleep 0.05; done
gw3=$(grep -o 'http://[0-9.:]*' "$work/gw3.log" | head -1)
check "uploads past --max-held-bytes: 503" status_is 503 "$gw3/v1/audio/transcriptions" -F model=$m -F file=@"$wh/number-7.wav"
# a client that stops sending mid-headers is closed after --idle-timeout-s
hp=${gw3#http://}
exec 7<>"/dev/tcp/${hp%:*}/${hp#*:}"
printf 'POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Le' >&7
start=$SECONDS
timeout 10 cat <&7 >/dev/null
check "a silent connection is closed after the idle timeout ($((SECONDS - start)) s)" test $((SECONDS - start)) -le 5
exec 7>&-
kill -TERM "$gw3_pid"; wait "$gw3_pid"
check "the third gateway stops cleanly" test $? = 0
check "openai Node client (audio)" node "$npm_dir/gateway_openai.mjs" audio "$gw" $m "$wh"
stop_cluster audio

rm -f "$work/big.json" "$work/huge.wav"
((failed == 0)) || { echo "$failed checks failed; logs in $work" >&2; exit 1; }
echo "all gateway checks passed"
