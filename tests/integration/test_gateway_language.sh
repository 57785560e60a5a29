#!/usr/bin/env bash
# The gateway's language detection end to end: deploy/local.sh starts a
# cluster with the toy Whisper (whisper-large-v3's tokenizer: the language
# tokens, no default language), and audio without a language goes through
# /v1/audio/transcriptions and /translations:
# - the answer equals tandem-generate's for the same audio without a
#   language (it detects as transformers' detect_language), short and
#   long-form, and equals the gateway's with the detected language given;
# - verbose_json names the detected language, as the debug log does;
# - one detection request a transcription without a language, none with one
#   (the gateway's tandem:gateway_language_detections_total).
#   tests/integration/test_gateway_language.sh BIN_DIR WORK_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
test_dirs "$1" "$2"
wh="$root/tests/data/toy-numbers-whisper"
m=toy-numbers-whisper
jqe() { jq -e "$@" >/dev/null; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
rm -rf "$work/cluster"; rm -f "$work/cluster.out" "$work/cluster.err"
"$root/deploy/local.sh" --run-dir "$work/cluster" --model "$wh" --tokenizer "$wh" --encoders 1 --prefills 0 \
  >"$work/cluster.out" 2>"$work/cluster.err" &
pids+=($!)
wait_for 1800 grep -q '^gateway ' "$work/cluster.out"  # a loaded machine starts slowly
router=$(awk '/^router /{print $2}' "$work/cluster.out")
[[ -n $router ]] || { echo "FAIL the cluster did not start"; cat "$work/cluster.out" "$work/cluster.err"; exit 1; }
check "an audio model's cluster takes its clients over ZeroMQ by default (local.sh --local-link auto)" \
  grep -q "^router tcp://" "$work/cluster.out"
# a gateway of our own on its router: its debug log names each detection
"$bin/tandem-gateway" --router "$router" --model "$wh" --port 0 --log-level debug >"$work/gw.out" 2>"$work/gw.log" &
pids+=($!)
wait_for 200 grep -q "gateway serving" "$work/gw.log"
gw=$(grep -o "gateway serving http://[^ ]*" "$work/gw.log" | head -1 | cut -d' ' -f3)
[[ -n $gw ]] || { echo "FAIL the gateway did not start"; cat "$work/gw.log"; exit 1; }
tr="$gw/v1/audio/transcriptions"
detections() { # endpoint: the gateway's count of detection requests
  curl -s "$gw/metrics" | awk -v ep="$1" '$1 == "tandem:gateway_language_detections_total{endpoint=\"" ep "\"}" { v = $2 }
    END { print v + 0 }'
}

# ---- long audio (past the toy's 4 s window): three number wavs one after another
concat_wavs "$work/long.wav" "$wh/number-42.wav" "$wh/number-4207.wav" \
  "$wh/number-7.wav" "$wh/number-305.wav" || { echo "FAIL making the long audio"; exit 1; }

# ---- tandem-generate, no language: it detects
files=(number-4207.wav number-42.wav number-1999.wav)
: >"$work/gen.jsonl"
for f in "${files[@]}"; do echo "{\"id\": \"$f\", \"audio\": \"$wh/$f\"}" >>"$work/gen.jsonl"; done
echo "{\"id\": \"long\", \"audio\": \"$work/long.wav\", \"temperature_increment_on_fallback\": 0}" >>"$work/gen.jsonl"
"$bin/tandem-generate" --model "$wh" --requests "$work/gen.jsonl" >"$work/gen.out" 2>"$work/gen.err"
check "tandem-generate answered every request" test "$(jq -s '[.[] | select(.outputs)] | length' "$work/gen.out")" = 4

# ---- short audio without a language: tandem-generate's answer, the language named
before=$(detections /v1/audio/transcriptions)
for f in "${files[@]}"; do
  curl -s "$tr" -F model=$m -F file=@"$wh/$f" -F response_format=verbose_json >"$work/$f.json"
  check "$f: tandem-generate's tokens" jqe --slurpfile g "$work/gen.out" --arg id "$f" \
    '[.segments[].tokens[]] == ($g[] | select(.id == $id) | .outputs[0].tokens)' "$work/$f.json"
  check "$f: tandem-generate's text" jqe --slurpfile g "$work/gen.out" --arg id "$f" \
    '.text == ($g[] | select(.id == $id) | .outputs[0].text | sub("^ +"; "") | sub("[ \n]+$"; ""))' "$work/$f.json"
  lang=$(jq -r .language "$work/$f.json")
  check "$f: verbose_json names a language ($lang)" grep -qE '^[a-z]{2,3}$' <<<"$lang"
  check "$f: the one the gateway detected" grep -q "language detected: $lang\$" "$work/gw.log"
  # the detected language given: the same answer, no detection
  curl -s "$tr" -F model=$m -F file=@"$wh/$f" -F response_format=verbose_json -F language="$lang" >"$work/$f.given.json"
  check "$f: with language=$lang given, the same answer" jqe --slurpfile d "$work/$f.json" \
    '[.text, .language, [.segments[].tokens]] == ($d[0] | [.text, .language, [.segments[].tokens]])' "$work/$f.given.json"
done
# the toy hears other languages than English in some: detection is told apart from the old default ("en")
others=$(for f in "${files[@]}"; do jq -r .language "$work/$f.json"; done | grep -cvx en)
check "a language other than en detected ($others of ${#files[@]})" test "$others" -gt 0
after=$(detections /v1/audio/transcriptions)
check "a detection request a transcription without a language ($before -> $after)" test "$after" = $((before + 3))

# ---- a language given: no detection request, whatever the format
before=$(detections /v1/audio/transcriptions)
for fmt in json text verbose_json; do
  curl -s -o /dev/null "$tr" -F model=$m -F file=@"$wh/number-7.wav" -F language=en -F response_format=$fmt
done
curl -s -o /dev/null "$tr" -F model=$m -F file=@"$work/long.wav" -F language=en
check "language given: no detection request" test "$(detections /v1/audio/transcriptions)" = "$before"

# ---- long-form without a language: detected from the first window, then tandem-generate's loop
before=$(detections /v1/audio/transcriptions)
curl -s "$tr" -F model=$m -F file=@"$work/long.wav" -F response_format=verbose_json \
  -F temperature_increment_on_fallback=0 >"$work/long.json"
check "long-form: one detection request" test "$(detections /v1/audio/transcriptions)" = $((before + 1))
check "long-form: tandem-generate's tokens" jqe --slurpfile g "$work/gen.out" \
  '[.segments[].tokens[]] == ($g[] | select(.id == "long") | .outputs[0].tokens)' "$work/long.json"
check "long-form: tandem-generate's segment times" jqe --slurpfile g "$work/gen.out" \
  '[.segments[] | [.start, .end]] == ($g[] | select(.id == "long") | [.outputs[0].segments[] | [.start, .end]])' \
  "$work/long.json"
lang=$(jq -r .language "$work/long.json")
check "long-form: verbose_json names the language ($lang)" grep -qE '^[a-z]{2,3}$' <<<"$lang"
curl -s "$tr" -F model=$m -F file=@"$work/long.wav" -F response_format=verbose_json \
  -F temperature_increment_on_fallback=0 -F language="$lang" >"$work/long.given.json"
check "long-form: with language=$lang given, the same answer" jqe --slurpfile d "$work/long.json" \
  '[.text, [.segments[].tokens]] == ($d[0] | [.text, [.segments[].tokens]])' "$work/long.given.json"

# ---- the stream and translations detect too
r=$(curl -sN "$tr" -F model=$m -F file=@"$wh/number-4207.wav" -F stream=true)
check "stream without a language: the same text" has "$r" "\"type\":\"transcript.text.done\",\"text\":\" $(jq -r .text "$work/number-4207.wav.json")\""
before=$(detections /v1/audio/translations)
curl -s "$gw/v1/audio/translations" -F model=$m -F file=@"$wh/number-42.wav" -F response_format=verbose_json \
  >"$work/translate.json"
check "translation: detected" test "$(detections /v1/audio/translations)" = $((before + 1))
check "translation: the task stays translate, the language named" jqe \
  '.task == "translate" and (.language | test("^[a-z]{2,3}$"))' "$work/translate.json"

kill -TERM "${pids[1]}" 2>/dev/null; wait "${pids[1]}" 2>/dev/null
check "the gateway's log holds no sanitizer report" \
  bash -c "! grep -E 'ERROR: (Address|Leak)Sanitizer|runtime error:' '$work/gw.log' '$work/cluster/gateway.log'"
echo "$failed failed"
exit $((failed > 0))
