#!/usr/bin/env bash
# Whole-system checks on a GPU machine, from the repository root, with the
# programs packed by device-pack (tandem-generate, tandem-router, tandem-worker,
# tandem-client, bench-decode-step):
#   tests/gpu/run_integration.sh PACKDIR OUTDIR [generate] [cluster] [cluster-fixtures] [bench] [encoder-trace] [fixtures]
# (cluster-fixtures also needs bench-serve)
set -u
pack=$1 out=$2
shift 2
steps=${*:-generate cluster bench}
# a packed build (device-pack) has env.sh; a build folder (CI, on the CPU) has bin/ alone
[[ -f $pack/env.sh ]] && source "$pack/env.sh"
mkdir -p "$out"
{ nvidia-smi -L 2>/dev/null || echo "no GPU"; } | tee "$out/device.txt"
summary=()
steps_failed=0
run() { # name timeout command...
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
  ((rc == 0)) || steps_failed=$((steps_failed + 1))
  tail -n 20 "$out/$name.log"
}
# a fixture's reference requests as a request file (Whisper features beside it)
generate_requests() { # fixture dir, request file
  python3 - "$1" "$2" <<'PY'
import json, sys, os
m, path = sys.argv[1], sys.argv[2]
ref = json.load(open(f"{m}/reference.json"))
cfg = json.load(open(f"{m}/config.json"))
with open(path, "w") as f:
    for i, r in enumerate(ref["requests"]):
        line = {"id": f"r{i}", "decoder_prompt": r["decoder_prompt"], "max_new_tokens": len(r["greedy_tokens"]),
                "forced_bos_token_id": None, "forced_eos_token_id": None}
        if "input_ids" in r:
            line["input_ids"] = r["input_ids"]
        else:
            size = 4 * cfg["num_mel_bins"] * 2 * cfg["max_source_positions"]  # one input's float32 [mels, frames]
            with open(f"{m}/input_features.f32", "rb") as src:
                src.seek(i * size)
                one = src.read(size)
            fp = f"{path}.{i}.f32"
            with open(fp, "wb") as dst:
                dst.write(one)
            line["input_features"] = os.path.abspath(fp)
        f.write(json.dumps(line) + "\n")
PY
}
generate() {
  # every fixture through tandem-generate --device cuda: tokens and logits against transformers
  local tmp=$out/gen
  mkdir -p "$tmp"
  for m in tests/data/*/; do
    m=${m%/}
    [[ -f $m/reference.json ]] || continue
    name=$(basename "$m")
    generate_requests "$m" "$tmp/$name.jsonl"
    tandem-generate --model "$m" --requests "$tmp/$name.jsonl" --device cuda --logits-out "$tmp/$name.logits" \
      --block-size 16 >"$tmp/$name.out" 2>"$tmp/$name.err"
    echo "$name rc=$?"
    python3 - "$m" "$tmp/$name.out" "$tmp/$name.logits" <<'PY'
import json, sys
import numpy as np
m, outp, lgp = sys.argv[1:4]
ref = json.load(open(f"{m}/reference.json"))
V = json.load(open(f"{m}/config.json"))["vocab_size"]
got = [json.loads(l) for l in open(outp)]
rl = np.fromfile(f"{m}/ref_logits.f32", dtype="<f4").reshape(-1, V)
gl = np.fromfile(lgp, dtype="<f4").reshape(-1, V)
off, worst, same, n = 0, 0.0, 0, 0
for r, g in zip(ref["requests"], got):
    rows = len(r["decoder_prompt"]) + len(r["greedy_tokens"]) - 1
    e = np.abs(gl[off:off + rows] - rl[off:off + rows]).max() / np.abs(rl[off:off + rows]).max()
    worst = max(worst, e)
    toks = g["outputs"][0]["tokens"]
    same += toks == r["greedy_tokens"]
    n += 1
    off += rows
print(f"  {m.split('/')[-1]}: logits max|diff|/max|ref| {worst:.3g}, greedy tokens equal {same}/{n}")
PY
  done
}
# every fixture through a cluster on the GPU, aggregated and disaggregated (encoder states pushed and
# projected on arrival, and K/V pushed; with TD_CFX_MODES also encoder groups, etp2 / etp2r (by rows) / epp2, and decode
# pipelines, dpp2 / dpp2s (two running sets), whose ranks need a GPU each; int8 cross K/V: q8 (aggregated), q8s (encoder
# states projected into int8), q8k (int8 K/V pushed by an int8 encoder)): greedy tokens against transformers. TD_CFX_FIXTURES: which fixtures
# (default every one); TD_DEVICE: cuda (default) or cpu.
cluster_fixtures() {
  local tmp=$out/cfx dev=${TD_DEVICE:-cuda} bad=0
  mkdir -p "$tmp"
  for m in tests/data/*/; do
    m=${m%/}
    [[ -f $m/reference.json ]] || continue
    name=$(basename "$m")
    [[ -z ${TD_CFX_FIXTURES:-} || " $TD_CFX_FIXTURES " == *" $name "* ]] || continue
    generate_requests "$m" "$tmp/$name.jsonl"
    for mode in ${TD_CFX_MODES:-agg states kv}; do
      case $mode in
        agg) flags=(--encoders 0) ;;
        states) flags=(--encoders 1) ;;
        kv) flags=(--encoders 1 --cross-transfer kv) ;;
        etp2) flags=(--encoders 1 --encoder-tp 2) ;;
        etp2r) flags=(--encoders 1 --encoder-tp 2 --tp-encoder rows) ;;
        epp2) flags=(--encoders 1 --encoder-pp 2) ;;
        dpp2) flags=(--encoders 0 --decode-pp 2) ;;
        dpp2s) flags=(--encoders 0 --decode-pp 2 --pp-sets 2) ;;
        q8) flags=(--encoders 0 --cross-kv-dtype int8) ;;   # int8 cross K/V, encoded in the decode worker
        q8s) flags=(--encoders 1 --cross-kv-dtype int8) ;;  # int8 cross K/V projected from an encoder's states
        q8k) flags=(--encoders 1 --cross-transfer kv --cross-kv-dtype int8) ;;  # int8 K/V pushed by an int8 encoder
        *) echo "  unknown mode $mode"; bad=$((bad + 1)); continue ;;
      esac
      local run=$tmp/run-$name-$mode
      TANDEM_BIN="$pack/bin" setsid bash deploy/local.sh --model "$m" --device "$dev" --prefills 0 --decodes 1 --no-gateway --no-metrics \
        "${flags[@]}" --run-dir "$run" >"$run.log" 2>&1 &
      local lp=$!
      for _ in $(seq 240); do grep -q '^logs' "$run.log" && break; kill -0 $lp 2>/dev/null || break; sleep 0.5; done
      local ep
      ep=$(awk '/^router-local local:/ { print $2; exit }' "$run.log"); [[ -n $ep ]] || ep=$(grep -m1 -E '^router tcp:' "$run.log" | awk '{print $2}')
      if [[ -n $ep ]]; then
        "$pack/bin/bench-serve" --router "$ep" --model "$m" --workload "$tmp/$name.jsonl" --results "$tmp/$name-$mode.res" \
          >"$tmp/$name-$mode.out" 2>&1
        python3 - "$m" "$tmp/$name-$mode.res" "$mode" "$dev" <<'PY'
import array, json, sys
m, resp, mode, dev = sys.argv[1:5]
ref = json.load(open(f"{m}/reference.json"))
got = {j["id"]: j for j in map(json.loads, open(resp)) if "id" in j}
# On a GPU (bf16) a token may differ where transformers' own margin between the two tokens is within
# the GPU's logit tolerance (5 % of the row's largest logit, as the parallel tests allow): a near tie.
# The CPU computes in float32 and must match exactly.
V = json.load(open(f"{m}/config.json"))["vocab_size"]
lg = array.array("f")
with open(f"{m}/ref_logits.f32", "rb") as f:
    lg.frombytes(f.read())
same = tie = 0
off, notes = 0, []
for i, r in enumerate(ref["requests"]):
    want, have = r["greedy_tokens"], got.get(f"r{i}", {}).get("tokens")
    p = len(r["decoder_prompt"]) - 1
    if have == want:
        same += 1
    elif dev != "cpu" and have:
        k = next((k for k in range(min(len(want), len(have))) if want[k] != have[k]), None)
        if k is not None and 0 <= have[k] < V:
            row = lg[(off + p + k) * V:(off + p + k + 1) * V]
            big = max(abs(x) for x in row)
            gap = row[want[k]] - row[have[k]]
            if gap <= 0.05 * big:
                tie += 1
                notes.append(f"r{i} step {k}: {want[k]} / {have[k]}, margin {gap:.3g} = {100 * gap / big:.1f} % of the largest logit")
    off += len(r["decoder_prompt"]) + len(want) - 1
n = len(ref["requests"])
extra = f", {tie} up to a near tie ({'; '.join(notes)})" if tie else ""
print(f"  {m.split('/')[-1]} {mode}: greedy tokens equal {same}/{n}{extra}")
sys.exit(same + tie != n)
PY
        (($? == 0)) || bad=$((bad + 1))
      else
        echo "  $name $mode: the cluster did not start"
        bad=$((bad + 1))
      fi
      rm -f "$run"/*.pid
      kill -TERM -- -$lp 2>/dev/null
      sleep 1
      kill -KILL -- -$lp 2>/dev/null
    done
  done
  echo "cluster-fixtures: $bad failed"
  ((bad == 0))
}
export -f generate_requests generate cluster_fixtures
export out pack
for s in $steps; do
  case $s in
    generate) run generate 300 bash -c generate ;;
    cluster-fixtures) run cluster-fixtures 500 bash -c cluster_fixtures ;;
    cluster) run cluster 200 env TANDEM_BIN="$pack/bin" deploy/local.sh --device cuda --demo --run-dir "$out/run" ;;
    bench) run bench 400 bench-decode-step --batches 1,16,64 ;;
    bench-bart) run bench-bart 300 bench-decode-step --shape bart-large --batches 1,64 ;;
    # where an encoder run's time goes, by kernel (the bias pass, the GEMMs, attention): Whisper and BART shapes
    encoder-trace) run encoder-trace 400 sh -c "bench-decode-step --shape whisper-large-v3 --batches 16 --trace-encoder --no-record && bench-decode-step --shape bart-large --batches 64 --trace-encoder --no-record" ;;
    fixtures) run fixtures 200 sh -c "mkdir -p /tmp/fx2 && PYTHONUNBUFFERED=1 python3 tests/tools/make_fixtures.py /tmp/fx2 t5-gated-untied-head && tar -C /tmp/fx2 -czf $out/fixtures2.tgz ." ;;
  esac
done
cp bench/RESULTS.md "$out/RESULTS.md" 2>/dev/null
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
((steps_failed == 0))
