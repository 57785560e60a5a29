#!/usr/bin/env bash
# Rewrites the generated seeds of tests/fuzz/corpus (protobuf messages and
# KV descriptors: seeds.c) and copies the fixture-based ones. Needs a
# configured build (its generated protobuf sources): BUILD, default build-asan.
# (seeds.c encodes descriptors only: the decoder's helpers are dropped at link.)
#   tests/fuzz/make_seeds.sh [BUILD]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${1:-$root/build-asan}" && pwd)
c=$root/tests/fuzz/corpus
d=$root/tests/data
for t in fuzz_wire_client fuzz_wire_cluster fuzz_kv_desc fuzz_safetensors fuzz_config fuzz_jsonl; do mkdir -p "$c/$t"; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -std=c11 -D_GNU_SOURCE -ffunction-sections -Wl,--gc-sections -I"$root" -I"$build/proto" "$root/tests/fuzz/seeds.c" "$root/kvtransfer/wire.c" \
   "$root/common/status.c" "$build/proto/tandem.pb-c.c" "$build/proto/cluster.pb-c.c" -lprotobuf-c -lzmq \
   -o "$tmp/seeds"
"$tmp/seeds" "$c"
# config.json (selector 0) and generation_config.json (1: t5-tiny, 2: bart-tiny, 3: whisper-tiny)
one() { { printf "\\x$(printf %02x "$2")"; cat "$3"; } > "$c/$1"; }
for m in t5-tiny bart-tiny whisper-tiny marian-sinusoidal mt5-silu-tied; do one fuzz_config/config_$m 0 "$d/$m/config.json"; done
one fuzz_config/gen_t5-tiny 1 "$d/t5-tiny/generation_config.json"
one fuzz_config/gen_bart-tiny 2 "$d/bart-tiny/generation_config.json"
one fuzz_config/gen_whisper-tiny 3 "$d/whisper-tiny/generation_config.json"
# safetensors (selector 0: a file; 1: an index over a.safetensors / b.safetensors)
python3 - "$c/fuzz_safetensors" "$d" <<'PY'
import json, struct, sys
out, data = sys.argv[1], sys.argv[2]
def st(name, tensors, meta=None):
    hdr, body = {}, b""
    for k, (dt, shape, raw) in tensors.items():
        hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    if meta: hdr["__metadata__"] = meta
    h = json.dumps(hdr, separators=(",", ":")).encode()
    open(f"{out}/{name}", "wb").write(b"\x00" + struct.pack("<Q", len(h)) + h + body)
st("dtypes", {"f32": ("F32", [2, 2], struct.pack("<4f", 1, -2, 0.5, 3e38)),
              "f16": ("F16", [3], struct.pack("<3H", 0x3c00, 0x7c00, 0x0001)),
              "bf16": ("BF16", [2], struct.pack("<2H", 0x3f80, 0xff80)),
              "f64": ("F64", [1], struct.pack("<d", 1e300)),
              "i64": ("I64", [1], struct.pack("<q", -1)),
              "b": ("BOOL", [2], b"\x01\x00"),
              "e4m3": ("F8_E4M3", [2], b"\x38\x7f"),
              "e5m2": ("F8_E5M2", [2], b"\x3c\x7c"),
              "empty": ("F32", [0, 4], b"")}, {"format": "pt"})
st("scalar", {"s": ("F32", [], struct.pack("<f", 7))})
# a real header (t5-tiny's), its data cut off: every offset then reaches past the end
raw = open(f"{data}/t5-tiny/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
open(f"{out}/t5_header_only", "wb").write(b"\x00" + raw[:8 + n])
def idx(name, wm):
    open(f"{out}/{name}", "wb").write(b"\x01" + json.dumps({"metadata": {"total_size": 16}, "weight_map": wm}).encode())
idx("index", {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"})
idx("index_missing", {"x": "a.safetensors", "w": "b.safetensors"})
idx("index_wrong_shard", {"x": "b.safetensors", "y": "b.safetensors", "z": "b.safetensors"})
PY
# request lines (fixture folder: f.f32, a.wav)
j=$c/fuzz_jsonl
printf '%s' '{"id": "r1", "input_ids": [5, 6, 7, 1], "max_new_tokens": 8, "num_beams": 4, "num_return_sequences": 2, "length_penalty": 1.5, "early_stopping": "never"}' > "$j/ids_beams"
printf '%s' '{"id": 17, "input_ids": [1], "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 42, "n": 3, "logprobs": true, "stop_token_ids": [1, 2], "decoder_prompt": [0], "forced_bos_token_id": 2, "forced_eos_token_id": null, "ignore_eos": false}' > "$j/ids_sample"
printf '%s' '{"input_features": "f.f32"}' > "$j/features"
printf '%s' '{"id": "t", "text": "translate English to German: one two three"}' > "$j/text"
printf '%s' '{"audio": "a.wav", "language": "en", "task": "translate", "timestamps": true}' > "$j/audio"
printf '%s' '{"input_ids": [1], "text": "both"}' > "$j/two_inputs"
printf '%s' '{"input_ids": [1], "unknown": 1}' > "$j/unknown_field"
echo "seeds: $(find "$c" -type f | wc -l) files, $(du -sk "$c" | cut -f1) KB"
