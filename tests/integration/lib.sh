# Helpers of the shell tests (sourced): named checks counted in $failed,
# waits by polling, substring expectations, the test's folders, WAV files.
failed=0
lib_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
test_dirs() { # BIN_DIR WORK_DIR: sets root, bin and work (made, absolute) and exports TANDEM_BIN
  root=$lib_root
  bin=$(cd "$1" && pwd)
  mkdir -p "$2"
  work=$(cd "$2" && pwd)
  export TANDEM_BIN=$bin
}
check() { # name, then a command that must succeed
  local name=$1; shift
  if "$@"; then echo "ok   $name"; else echo "FAIL $name"; failed=$((failed + 1)); fi
}
wait_for() { # tries of 0.1 s, then a command
  local n=$1; shift
  for _ in $(seq "$n"); do "$@" && return 0; sleep 0.1; done
  return 1
}
has() { [[ $1 == *"$2"* ]] || { echo "  want '$2' in: ${1:0:600}" >&2; return 1; }; }
concat_wavs() { # out, wavs...: their PCM one after another (16 kHz mono 16-bit)
node -e '
const fs = require("fs"), [out, ...ins] = process.argv.slice(1);
const data = Buffer.concat(ins.map((f) => {
  const b = fs.readFileSync(f);
  for (let p = 12; p + 8 <= b.length;) {
    const id = b.toString("latin1", p, p + 4), n = b.readUInt32LE(p + 4);
    if (id === "data") return b.subarray(p + 8, p + 8 + n);
    p += 8 + n + (n & 1);
  }
  throw new Error(f + ": no data chunk");
}));
const h = Buffer.alloc(44);
h.write("RIFF", 0); h.writeUInt32LE(36 + data.length, 4); h.write("WAVEfmt ", 8); h.writeUInt32LE(16, 16);
h.writeUInt16LE(1, 20); h.writeUInt16LE(1, 22); h.writeUInt32LE(16000, 24); h.writeUInt32LE(32000, 28);
h.writeUInt16LE(2, 32); h.writeUInt16LE(16, 34); h.write("data", 36); h.writeUInt32LE(data.length, 40);
fs.writeFileSync(out, Buffer.concat([h, data]));' "$@"
}
