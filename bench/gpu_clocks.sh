# shellcheck shell=bash
# GPU clocks while a benchmark measures (sourced by bench/serve_configs.sh). nvidia-smi samples every
# GPU every 200 ms into a file; a run's summary, over its busy samples (utilisation >= 50 %), is the mean
# SM clock and the shares of samples whose clocks were held down by the software power cap (clock event
# reason 0x4) and by thermal or hardware slowdowns (0x8, 0x20, 0x40, 0x80). Under load an H200 meets its
# 700 W cap in compute-bound stretches (a Whisper burst's encoder runs: 1,605-1,860 MHz against 1,980),
# so two runs of one configuration can differ by their clocks alone. TD_NVIDIA_SMI names the program.
gpu_clocks_smi=${TD_NVIDIA_SMI:-nvidia-smi}
gpu_clocks_q="" gpu_clocks_pid=""

# Whether sampling works here (a GPU and nvidia-smi); picks the driver's name of the reasons field.
gpu_clocks_init() {
  local r
  for r in clocks_event_reasons.active clocks_throttle_reasons.active; do
    if "$gpu_clocks_smi" --query-gpu="index,utilization.gpu,clocks.sm,$r" --format=csv,noheader,nounits \
      >/dev/null 2>&1; then
      gpu_clocks_q="index,utilization.gpu,clocks.sm,$r"
      return 0
    fi
  done
  return 1
}

gpu_clocks_start() { # FILE
  [[ -n $gpu_clocks_q ]] || return 0
  "$gpu_clocks_smi" --query-gpu="$gpu_clocks_q" --format=csv,noheader,nounits -lms 200 >"$1" 2>/dev/null &
  gpu_clocks_pid=$!
}

gpu_clocks_stop() {
  [[ -n $gpu_clocks_pid ]] || return 0
  kill "$gpu_clocks_pid" 2>/dev/null
  wait "$gpu_clocks_pid" 2>/dev/null
  gpu_clocks_pid=""
  return 0
}

# FILE: "1912 MHz, capped 41 %, slowed 0 %" over the busy samples; "-" without any
gpu_clocks_of() {
  [[ -s $1 ]] || { echo "-"; return 0; }
  awk -F', *' '
    function nib(s, k) { return index("0123456789abcdef", tolower(substr(s, length(s) - k, 1))) - 1 }
    NF == 4 && $2 + 0 >= 50 && $3 + 0 > 0 && $4 ~ /^0x[0-9a-fA-F]+$/ && length($4) == 18 {
      n++; mhz += $3; lo = nib($4, 0); hi = nib($4, 1)
      if (lo % 8 >= 4) cap++
      if (lo >= 8 || int(hi / 2) % 8) slow++
    }
    END { if (n) printf "%.0f MHz, capped %.0f %%, slowed %.0f %%\n", mhz / n, 100 * cap / n, 100 * slow / n; else print "-" }' "$1"
}
