#!/usr/bin/env bash
# Long-form transcription end to end: deploy/local.sh starts a cluster with
# the toy Whisper (a 4 s window; an encoder, a prefill and a decode worker),
# and audio made of six of its number wavs one after another (8.5 s) goes
# through the gateway's /v1/audio/transcriptions:
# - verbose_json against transformers' long-form generate, the reference
#   tests/tools/make_longform_reference.py writes (tokens, segments and their
#   times, text; conditioned on the previous windows and not);
# - tandem-generate (the engine in one process) gives the same;
# - concurrent transcriptions have their windows in flight together;
# - the stream, the other formats, and the refusals (audio past
#   --max-audio-seconds, thresholds out of range).
#   tests/integration/test_longform.sh BIN_DIR WORK_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
test_dirs "$1" "$2"
wh="$root/tests/data/toy-numbers-whisper"
ref="$wh/longform_reference.json"
m=toy-numbers-whisper
status_is() { # want, curl args...
  local want=$1; shift
  local got
  got=$(curl -s -o "$work/body" -w '%{http_code}' "$@")
  [[ $got == "$want" ]] || { echo "  HTTP $got (want $want): $(head -c 400 "$work/body")" >&2; return 1; }
  grep -q '"error"' "$work/body" || [[ $want == 200 ]] || { echo "  no error object: $(head -c 400 "$work/body")" >&2; return 1; }
}
says() { grep -q -- "$1" "$work/body" || { echo "  want '$1' in: $(head -c 400 "$work/body")" >&2; return 1; }; }
jqe() { jq -e "$@" >/dev/null; }

# ---- the audio: the reference's wavs (else the script's default list), their PCM one after another
files=(number-42.wav number-4207.wav number-7.wav number-305.wav number-1999.wav number-18.wav)
if [[ -f $ref ]]; then mapfile -t files < <(jq -r '.files[]' "$ref"); fi
paths=(); for f in "${files[@]}"; do paths+=("$wh/$f"); done
concat_wavs "$work/long.wav" "${paths[@]}" || { echo "FAIL making the audio"; exit 1; }
concat_wavs "$work/longer.wav" "$work/long.wav" "$work/long.wav" || { echo "FAIL making the audio"; exit 1; }
samples=$(( ($(stat -c %s "$work/long.wav") - 44) / 2 ))
frames=$((samples / 160))
windows=$(( (frames + 399) / 400 ))
echo "audio: ${files[*]}: $samples samples, $frames frames, $windows windows of 400"

# ---- a cluster through local.sh, and a second gateway (debug log, 10 s of audio at most) on its router
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
rm -rf "$work/cluster"; rm -f "$work/cluster.out"
"$root/deploy/local.sh" --run-dir "$work/cluster" --model "$wh" --encoders 1 --prefills 1 --decodes 1 \
  >"$work/cluster.out" 2>"$work/cluster.err" &
pids+=($!)
wait_for 600 grep -q '^gateway ' "$work/cluster.out"
router=$(awk '/^router /{print $2}' "$work/cluster.out")
gw=$(awk '/^gateway /{print $2}' "$work/cluster.out")
[[ -n $router && -n $gw ]] || { echo "FAIL the cluster did not start"; cat "$work/cluster.out" "$work/cluster.err"; exit 1; }
"$bin/tandem-gateway" --router "$router" --model "$wh" --port 0 --log-level debug --max-audio-seconds 10 \
  >"$work/gw2.out" 2>"$work/gw2.log" &
pids+=($!)
wait_for 200 grep -q "gateway serving" "$work/gw2.log"
gw2=$(grep -o "gateway serving http://[^ ]*" "$work/gw2.log" | head -1 | cut -d' ' -f3)
[[ -n $gw2 ]] || { echo "FAIL the second gateway did not start"; cat "$work/gw2.log"; exit 1; }
echo "router $router, gateway $gw, second gateway $gw2"
tr="$gw/v1/audio/transcriptions"
# the settings the reference was made with: no fallback (a sampled window could not be compared)
same=(-F model=$m -F file=@"$work/long.wav" -F language=en -F temperature_increment_on_fallback=0
      -F compression_ratio_threshold=1.35 -F logprob_threshold=-1.0 -F no_speech_threshold=0.6)

# ---- verbose_json, conditioned on the previous windows and not
for cond in true false; do
  curl -s "$tr" "${same[@]}" -F condition_on_previous_text=$cond -F response_format=verbose_json >"$work/v-$cond.json"
  check "verbose_json ($cond): segments" jqe '.segments | length > 0' "$work/v-$cond.json"
  # what the toy does (it never learnt timestamps: one timestamp and EOS a window), by hand
  check "verbose_json ($cond): a segment a window, starting at its seek" jqe --argjson w "$windows" \
    '[.segments[] | (.start - .seek / 100 | fabs) < 1e-9] | length == $w and all' "$work/v-$cond.json"
  check "verbose_json ($cond): each window's no-speech probability and temperature 0" jqe \
    '[.segments[] | (.no_speech_prob >= 0 and .no_speech_prob <= 1 and .temperature == 0)] | all' "$work/v-$cond.json"
done
check "verbose_json: the duration" jqe --argjson s "$samples" '.duration == $s / 16000' "$work/v-true.json"

# ---- against transformers (tests/tools/make_longform_reference.py)
if [[ ! -f $ref ]]; then
  echo "FAIL no transformers reference: run python3 tests/tools/make_longform_reference.py where transformers is installed ($ref)"
  failed=$((failed + 1))
else
  for cond in true false; do
    jq --argjson c $cond '.cases[] | select(.condition_on_prev_tokens == $c)' "$ref" >"$work/ref-$cond.json"
    check "transformers ($cond): the same segments" jqe --slurpfile r "$work/ref-$cond.json" '
      ($r[0].segments) as $w | (.segments | length) == ($w | length) and
      ([range(0; $w | length) as $i | .segments[$i] as $s | $w[$i] as $x |
        $s.tokens == $x.tokens and ($s.start - $x.start | fabs) < 1e-9 and ($s.end - $x.end | fabs) < 1e-9 and
        $s.text == $x.text] | all)' "$work/v-$cond.json"
    check "transformers ($cond): the same text" jqe --slurpfile r "$work/ref-$cond.json" \
      '.text == ($r[0].text | sub("^ +"; "") | sub("[ \n]+$"; ""))' "$work/v-$cond.json"
    if ((failed)); then echo "  ours: $(jq -c '[.segments[] | {start: .start, end: .end, tokens: .tokens}]' "$work/v-$cond.json")"; \
      echo "  transformers: $(jq -c '[.segments[] | {start: .start, end: .end, tokens: .tokens}]' "$work/ref-$cond.json")"; fi
  done
fi

# ---- tandem-generate: the engine in one process gives the same
echo "{\"id\": \"long\", \"audio\": \"$work/long.wav\", \"language\": \"en\", \"temperature_increment_on_fallback\": 0}" \
  >"$work/gen.jsonl"
"$bin/tandem-generate" --model "$wh" --requests "$work/gen.jsonl" >"$work/gen.out" 2>"$work/gen.err"
check "tandem-generate: the gateway's tokens" jqe --slurpfile g "$work/gen.out" \
  '[.segments[].tokens[]] == $g[0].outputs[0].tokens' "$work/v-true.json"
check "tandem-generate: the gateway's segment times" jqe --slurpfile g "$work/gen.out" \
  '[.segments[] | [.start, .end]] == [$g[0].outputs[0].segments[] | [.start, .end]]' "$work/v-true.json"

# ---- concurrent transcriptions: every one right, their windows in flight together
par=()
for i in 1 2 3 4; do
  curl -s "$gw2/v1/audio/transcriptions" "${same[@]}" -F response_format=verbose_json >"$work/par$i.json" &
  par+=($!)
done
wait "${par[@]}"
ok=0
# the same windows and tokens (a window's probabilities differ in their last bits with the batch around it)
for i in 1 2 3 4; do
  jqe --slurpfile v "$work/v-true.json" '[.segments[] | [.start, .end, .tokens, .text]] ==
    [$v[0].segments[] | [.start, .end, .tokens, .text]]' "$work/par$i.json" && ok=$((ok + 1))
done
check "4 concurrent transcriptions, each as alone" test "$ok" = 4
# in the second gateway's log: another transcription's window was sent while one's was in flight
check "windows of concurrent transcriptions in flight together" awk '
  / window [0-9]+ sent/ { id = $0; sub(/.*gateway: /, "", id); sub(/:.*/, "", id); w = $0; sub(/.* window /, "", w); sub(/ .*/, "", w)
                          for (k in open) if (k != id) overlap = 1; open[id] = 1 }
  / window [0-9]+ done/ { id = $0; sub(/.*gateway: /, "", id); sub(/:.*/, "", id); delete open[id] }
  END { exit !overlap }' "$work/gw2.log"

# ---- the stream: the text a window at a time, then the whole
r=$(curl -sN "$tr" "${same[@]}" -F stream=true)
check "stream ends with transcript.text.done" has "$r" '"type":"transcript.text.done"'
# ---- the other formats answer
for f in json text srt vtt; do check "response_format $f" status_is 200 "$tr" "${same[@]}" -F response_format=$f; done

# ---- refusals, each naming its cause
check "audio past --max-audio-seconds: 400" status_is 400 "$gw2/v1/audio/transcriptions" -F model=$m -F file=@"$work/longer.wav"
check "... naming the limit" says "over the limit of 10"
check "logprob_threshold above 0: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F logprob_threshold=2
check "... naming it" says "logprob_threshold: 2"
check "no_speech_threshold without logprob_threshold: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F logprob_threshold=none
check "... saying so" says "no_speech_threshold needs logprob_threshold"
check "compression_ratio_threshold 0: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F compression_ratio_threshold=0
check "no_speech_threshold 1.5: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F no_speech_threshold=1.5
check "a ladder of 101 temperatures: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F temperature_increment_on_fallback=0.01
check "... naming its limit" says "more than 16 temperatures"
check "a threshold that is no number: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F logprob_threshold=low
check "condition_on_previous_text neither true nor false: 400" status_is 400 "$tr" -F model=$m -F file=@"$work/long.wav" -F condition_on_previous_text=maybe
# ZeroMQ clients: the router converts one window and says where long-form runs
"$bin/tandem-client" --router "$router" --audio "$work/long.wav" --language en >"$work/zmq.out" 2>&1
check "tandem-client --audio past the window: the router names the gateway" grep -q "tandem-gateway" "$work/zmq.out"

kill -TERM "${pids[1]}" 2>/dev/null; wait "${pids[1]}" 2>/dev/null
check "the gateways' logs hold no sanitizer report" \
  bash -c "! grep -E 'ERROR: (Address|Leak)Sanitizer|runtime error:' '$work/gw2.log' '$work/cluster/gateway.log'"
echo "$failed failed"
exit $((failed > 0))
