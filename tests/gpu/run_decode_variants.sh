#!/usr/bin/env bash
# Decode step under several builds / settings on one GPU, same weights, in
# one session (A/B comparisons for docs/cuda.md):
#   tests/gpu/run_decode_variants.sh PACK OUT BATCHES 'NAME:PROGRAM:ENV...' ...
# PROGRAM is a bench-decode-step binary in PACK/bin (other builds can be
# packed beside it under other names); ENV is KEY=VALUE pairs separated by
# spaces. Each variant runs once per round, rounds interleaved (ROUNDS,
# default 2), so drift in the card's state spreads over all of them.
set -u
pack=$1 out=$2 batches=$3
shift 3
source "$pack/env.sh"
mkdir -p "$out"
model=${MODEL_DIR:-/tmp/td-variants-model}
rounds=${ROUNDS:-2}
for r in $(seq 1 "$rounds"); do
  for v in "$@"; do
    name=${v%%:*} rest=${v#*:}
    prog=${rest%%:*} envs=${rest#*:}
    [[ $envs == "$rest" ]] && envs=""
    echo "==== $name (round $r): $prog $envs" | tee -a "$out/variants.log"
    # shellcheck disable=SC2086
    env $envs timeout 240 "$pack/bin/$prog" --no-record --model-dir "$model" --batches "$batches" \
      >"$out/v.part" 2>&1
    echo "rc=$?" >>"$out/v.part"
    cat "$out/v.part" >>"$out/variants.log"
    grep -E '^ +[0-9]+ |^encoder|rc=' "$out/v.part" | sed "s/^/$name r$r /" >>"$out/variants.txt"
  done
done
rm -f "$out/v.part"
# one table: step ms per variant and batch, each round
python3 - "$out/variants.txt" <<'PY'
import sys, collections
rows = collections.OrderedDict()
bs = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 4 and f[2].isdigit():
        name, b, ms = f[0], int(f[2]), float(f[3])
        rows.setdefault(name, {}).setdefault(b, []).append(ms)
        if b not in bs: bs.append(b)
print("%-14s" % "variant" + "".join("%16d" % b for b in bs))
for name, d in rows.items():
    print("%-14s" % name + "".join("%16s" % "/".join("%.3f" % x for x in d.get(b, [])) for b in bs))
PY
