#!/usr/bin/env bash
# Starts a whole Tandem cluster on this machine: a router and encoder,
# prefill and decode workers (CPU unless a GPU is present), with the bundled
# model (tests/data/toy-numbers-t5: number words to digits) or --model. The
# router takes text (and, for Whisper, audio) when the model folder has a
# tokenizer (--tokenizer DIR names another folder). Prints "router
# tcp://HOST:PORT" once it serves, "metrics http://HOST:PORT/metrics" (the
# router's Prometheus metrics, docs/metrics.md), and "gateway http://HOST:PORT" (the
# OpenAI-compatible HTTP gateway) when there is a tokenizer. Ctrl-C or
# SIGTERM stops every process (the workers drain first); --demo sends sample
# requests, prints the results and stops. Every process runs under
# deploy/supervise.sh, which restarts it when it exits abnormally; its log and
# pid files are in the run directory (default run/local-TIME-PID, linked from
# run/latest).
#
#   deploy/local.sh add ROLE [--gpu N] [--id ID] [--gpu-memory-fraction F] [--run-dir DIR]
#                   (one more worker in a running cluster: ROLE encode, prefill, decode or
#                   encode,decode; ID by default encoder-N, prefill-N or decode-N, the first
#                   N free; prints "added ID")
#   deploy/local.sh remove ID [--run-dir DIR]
#                   (SIGTERM to the worker through its supervisor: it drains, then exits;
#                   prints "removed ID")
#   deploy/local.sh [--model DIR] [--tokenizer DIR] [--device cpu|cuda] [--port N] [--run-dir DIR]
#                   (--port N: the router on N and N + 1; without it, a free pair below
#                   the ephemeral range, picked again if taken before the router binds)
#                   [--encoders N] [--prefills N] [--decodes N] [--demo]
#                   [--decode-tp N | --decode-pp N [--pp-sets 2]] (each decode worker a group of N ranks; with
#                                                     --encoders 0 each group encodes its own requests; --pp-sets 2:
#                                                     two running sets alternate through a pipeline's stages)
#                   [--encode-defer N]  (with --pp-sets 2: steps waiting requests may wait to share an encoder
#                                        run while both sets run; default 8, -1: never)
#                   [--encoder-tp N | --encoder-pp N] (each encoder a group of N ranks; it pushes encoder states)
#                   [--tp-encoder heads|rows]  (a TP group's encoder: each rank its heads (default) or the
#                                               whole encoder over its share of the rows: faster, more memory)
#                   [--decoders-encode [--local-encode-pct P] [--local-encode-margin R] [--local-encode-seqs N]]
#                                                     (decode workers also encode, sharing the encoding with
#                                                     the encoders while fewer than P % of their batch
#                                                     decode, default 50, and the encoders are more than R
#                                                     of their encoder runs further behind, default 0; their
#                                                     encoder runs at most N inputs, so that a run stalls
#                                                     their decode batch less; default: the worker's)
#                   [--encoder-seqs N]                (encoder workers' runs at most N inputs: shorter runs,
#                                                     earlier first tokens, less batching; default: the worker's)
#                   [--encode-queue-runs N]           (an encoder's queue at most N of its runs; past it,
#                                                     requests wait or go to decoders that encode; default 3)
#                   [--kv-transport auto|ucx|zmq]     (KV between workers; auto: UCX where possible)
#                   [--cross-transfer states|kv]      (what encoder workers push: encoder states, projected
#                                                     on arrival (the default), or K/V)
#                   [--cross-mode auto|kv|states|dual] (what the cross pools hold: router and every
#                                                     worker; auto: dual, --cross-states: states)
#                   [--max-held-mb N]                 (the router's bound on the client messages it holds;
#                                                     default 256: 170 Whisper requests of 30 s)
#                   [--max-batch N]                   (sequences a decode step, every worker; default:
#                                                     256 on a GPU, 32 on the CPU)
#                   [--encoder-cache-fraction F]      (of each worker's cross pool kept for encoder outputs
#                                                     seen again, every worker; 0 turns the encoder cache
#                                                     off, as a benchmark repeating its inputs wants)
#                   [--gpu-memory-fraction F]         (of each GPU, for the workers on it together,
#                                                     split by role: decode 3 parts, encode and
#                                                     prefill 1; default 0.9)
#                   [--gateway-port N | --no-gateway]  (the HTTP gateway; default: any free port)
#                   [--cross-kv-dtype bf16|int8]       (int8: decode workers keep the cross K/V in int8
#                                                     with a scale a row: half the bytes a decode step
#                                                     reads, not the reference's bits; GPU workers of one
#                                                     rank; encoders keep them in int8 too where they push
#                                                     K/V (--cross-transfer kv), else decode workers
#                                                     project the encoder states into int8)
#                   [--gateway-api-keys FILE]         (HTTP clients must give one of its keys, one a line,
#                                                     mode 0600, as "Authorization: Bearer KEY" for /v1/;
#                                                     with --auth and without this, one key is made in
#                                                     RUN_DIR/keys/gateway-api.keys; prints "api-keys FILE")
#                   [--gateway-spin-us N]             (its router link and waiting HTTP threads poll N us
#                                                     before they sleep: less latency for CPU; default 0)
#                   [--spin-us N]                     (the router's loop and each worker's loop and compute
#                                                     thread poll N us after work before they sleep: fewer
#                                                     wake-ups a request, a core each while spinning;
#                                                     default: 5000 on GPUs where the host has two cores
#                                                     for each spinning thread, else 0)
#                   [--local-link auto|off|workers|all]  (workers, and with all clients too, reach the
#                                                     router over Unix sockets in RUN_DIR instead of
#                                                     ZeroMQ: a hop's thread wake-ups saved
#                                                     (docs/latency.md); with all, clients on this host
#                                                     may also use the line "router-local local:PATH"
#                                                     (the router's TCP endpoint is printed either way;
#                                                     the demo and the gateway take the link); a
#                                                     group's ranks keep the endpoint;
#                                                     not with --auth; default auto: all, or off with
#                                                     --auth or an audio model (its features are
#                                                     carried faster by ZeroMQ's I/O threads))
#                   [--metrics-port N | --no-metrics]  (the router's /metrics on 127.0.0.1; default: any
#                                                     free port)
#                   [--auth [--spare-keys N]]         (CURVE keys for every process: made with tandem-keygen
#                                                     in RUN_DIR/keys, N more worker keys for `add`,
#                                                     default 4; prints "keys DIR"; clients give
#                                                     --curve-secret DIR/client.key --router-key
#                                                     DIR/router.pub; docs/security.md)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
supervise="$root/deploy/supervise.sh"

# ---- add / remove: a running cluster, found by its run directory
cluster_dir() { # the run directory given, or run/latest
  local d=${1:-"$root/run/latest"}
  [[ -f $d/local.env ]] || { echo "local.sh: no cluster in ${d} (no local.env; --run-dir DIR)" >&2; exit 2; }
  (cd "$d" && pwd -P)
}
# a live process (an exited one that nobody reaped yet, as where the
# container's init reaps none, counts as gone)
running() {
  local st
  st=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) && [[ -n $st && $st != Z ]]
}
sup_alive() { # name in the run directory: its supervisor lives
  local f="$run_dir/$1.supervisor.pid"
  [[ -f $f ]] && running "$(cat "$f" 2>/dev/null)"
}
if [[ ${1:-} == add ]]; then
  shift
  role=${1:-}; shift || true
  case $role in encode|prefill|decode|encode,decode|decode,encode) ;;
    *) echo "local.sh add: ROLE must be encode, prefill, decode or encode,decode" >&2; exit 2 ;;
  esac
  add_gpu="" add_id="" add_frac="" run_dir=""
  while (($#)); do
    case $1 in
      --gpu) add_gpu=$2; shift 2 ;;
      --id) add_id=$2; shift 2 ;;
      --gpu-memory-fraction) add_frac=$2; shift 2 ;;
      --run-dir) run_dir=$2; shift 2 ;;
      *) echo "local.sh add: unknown option $1" >&2; exit 2 ;;
    esac
  done
  run_dir=$(cluster_dir "$run_dir")
  # shellcheck disable=SC1091
  source "$run_dir/local.env"
  keys=${keys:-} # a cluster started without keys
  [[ -v client_keys ]] || client_keys=()
  [[ -v enc_extra ]] || enc_extra=() # a cluster started before they were kept
  [[ -v dec_extra ]] || dec_extra=()
  # the options its role's workers were started with (--cross-transfer, --encoder-seqs, --local-encode-seqs)
  role_extra=()
  [[ $role == encode ]] && role_extra=("${enc_extra[@]}")
  [[ $role == *decode* ]] && role_extra=("${dec_extra[@]}")
  [[ -z $add_gpu || ( $add_gpu =~ ^[0-9]+$ && $add_gpu -lt $ngpu ) ]] ||
    { echo "local.sh add: --gpu must be 0 to $((ngpu - 1))" >&2; exit 2; }
  add_gpu=${add_gpu:-0}
  [[ -z $add_frac ]] || awk -v f="$add_frac" 'BEGIN { exit !(f + 0 > 0 && f + 0 <= 1 && f ~ /^[0-9.]+$/) }' ||
    { echo "local.sh add: --gpu-memory-fraction must be in (0, 1]" >&2; exit 2; }
  # the share this role's workers were given at start (the smallest share otherwise)
  add_frac=${add_frac:-${role_share[${role%%,*}]:-$min_share}}
  if [[ -z $add_id ]]; then
    # named as at start: encoder-N, prefill-N, decode-N
    prefix=${role%%,*}
    [[ $role == encode ]] && prefix=encoder
    [[ $role == *decode* ]] && prefix=decode
    for ((n = 0; ; n++)); do
      sup_alive "$prefix-$n" || { add_id="$prefix-$n"; break; }
    done
  fi
  [[ $add_id =~ ^[A-Za-z0-9._-]+$ ]] || { echo "local.sh add: --id must be letters, digits, '.', '_' or '-'" >&2; exit 2; }
  sup_alive "$add_id" && { echo "local.sh add: $add_id already runs in $run_dir" >&2; exit 2; }
  add_keys=()
  if [[ -n $keys ]]; then
    # the router reads its worker list once: a new worker takes a spare key made at start, an id
    # that ran before its own (the router binds an id to the key that first registered it)
    if [[ ! -f $keys/$add_id.key ]]; then
      spare=""
      for f in "$keys"/spare-*.key; do [[ -e $f ]] && { spare=$(basename "$f"); break; }; done
      [[ -n $spare ]] || { echo "local.sh add: no spare worker key left in $keys (start with a larger --spare-keys)" >&2; exit 2; }
      mv "$keys/$spare" "$keys/$add_id.key"
      mv "$keys/${spare%.key}.pub" "$keys/$add_id.pub"
    fi
    add_keys=(--curve-secret "$keys/$add_id.key" --router-key "$keys/router.pub" --worker-keys "$keys/workers.list")
  fi
  : >"$run_dir/$add_id.log"
  # its own session: it outlives this command; the cluster's stop finds it by its pid file
  setsid "$supervise" --name "$add_id" --run-dir "$run_dir" -- "$bin/tandem-worker" "${common[@]}" --id "$add_id" \
    --gpu "$add_gpu" --gpu-memory-fraction "$add_frac" --role "$role" "${role_extra[@]}" "${add_keys[@]}" </dev/null >/dev/null 2>&1 &
  for _ in $(seq 600); do
    h=$("$bin/tandem-client" --router "$client_ep" "${client_keys[@]}" --health --timeout-ms 500 2>/dev/null || true)
    if [[ -n $h ]] && jq -e --arg id "$add_id" '.workers | any(.id == $id)' <<<"$h" >/dev/null 2>&1; then
      echo "added $add_id"
      exit 0
    fi
    if grep -q "^supervise: .* exited" "$run_dir/$add_id.log" 2>/dev/null; then
      echo "local.sh add: $add_id exited during start-up (it is being restarted); see $run_dir/$add_id.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "local.sh add: $add_id did not register within 60 s; see $run_dir/$add_id.log" >&2
  exit 1
fi
if [[ ${1:-} == remove ]]; then
  shift
  rm_id=${1:-}; shift || true
  [[ $rm_id =~ ^[A-Za-z0-9._-]+$ ]] || { echo "local.sh remove: WORKER_ID needed" >&2; exit 2; }
  run_dir=""
  while (($#)); do
    case $1 in
      --run-dir) run_dir=$2; shift 2 ;;
      *) echo "local.sh remove: unknown option $1" >&2; exit 2 ;;
    esac
  done
  run_dir=$(cluster_dir "$run_dir")
  [[ $rm_id != router && $rm_id != gateway ]] || { echo "local.sh remove: $rm_id is not a worker" >&2; exit 2; }
  sup_alive "$rm_id" || { echo "local.sh remove: no worker $rm_id runs in $run_dir" >&2; exit 2; }
  spid=$(cat "$run_dir/$rm_id.supervisor.pid")
  kill -TERM "$spid"
  # the worker drains (its supervisor gives it --stop-timeout, then SIGKILL)
  while running "$spid"; do sleep 0.1; done
  echo "removed $rm_id"
  exit 0
fi

model="$root/tests/data/toy-numbers-t5"
tokenizer=""
device=""
port=""
run_dir=""
encoders=1 prefills=1 decodes=1
demo=0
block_size=16
decode_tp=1 decode_pp=1 encoder_tp=1 encoder_pp=1 pp_sets=1 tp_encoder=
kv_transport=auto
cross_mode=auto
cross_transfer=""
router_held=()
max_batch=""
enc_cache=""
decoders_encode=0
local_encode_pct=""
local_encode_margin=""
local_encode_seqs=""
encoder_seqs=""
encode_queue_runs=""
encode_defer=""
mem_fraction=0.9
gateway_port=0
api_keys=""
cross_kv_dtype=bf16
gateway_spin=0
spin=auto
default_spin_us=5000 # covers an engine's time to first token (1,000 us did nothing for BART: docs/latency.md)
local_link=auto
gateway=1
metrics_port=0
metrics=1
auth=0
spare_keys=4
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --encoders) encoders=$2; shift 2 ;;
    --prefills) prefills=$2; shift 2 ;;
    --decodes) decodes=$2; shift 2 ;;
    --block-size) block_size=$2; shift 2 ;;
    --decode-tp) decode_tp=$2; shift 2 ;;
    --encoder-tp) encoder_tp=$2; shift 2 ;;
    --tp-encoder) tp_encoder=$2; shift 2 ;;
    --encoder-pp) encoder_pp=$2; shift 2 ;;
    --decode-pp) decode_pp=$2; shift 2 ;;
    --pp-sets) pp_sets=$2; shift 2 ;;
    --encode-defer) encode_defer=$2; shift 2 ;;
    --decoders-encode) decoders_encode=1; shift ;;
    --local-encode-pct) local_encode_pct=$2; shift 2 ;;
    --local-encode-margin) local_encode_margin=$2; shift 2 ;;
    --local-encode-seqs) local_encode_seqs=$2; shift 2 ;;
    --encoder-seqs) encoder_seqs=$2; shift 2 ;;
    --encode-queue-runs) encode_queue_runs=$2; shift 2 ;;
    --kv-transport) kv_transport=$2; shift 2 ;;
    --cross-states) cross_mode=states; shift ;;
    --cross-mode) cross_mode=$2; shift 2 ;;
    --cross-transfer) cross_transfer=$2; shift 2 ;;
    --max-held-mb) router_held=(--max-held-mb "$2"); shift 2 ;;
    --max-batch) max_batch=$2; shift 2 ;;
    --encoder-cache-fraction) enc_cache=$2; shift 2 ;;
    --gpu-memory-fraction) mem_fraction=$2; shift 2 ;;
    --gateway-port) gateway_port=$2; shift 2 ;;
    --gateway-spin-us) gateway_spin=$2; shift 2 ;;
    --gateway-api-keys) api_keys=$2; shift 2 ;;
    --cross-kv-dtype) cross_kv_dtype=$2; shift 2 ;;
    --spin-us) spin=$2; shift 2 ;;
    --local-link) local_link=$2; shift 2 ;;
    --no-gateway) gateway=0; shift ;;
    --metrics-port) metrics_port=$2; shift 2 ;;
    --no-metrics) metrics=0; shift ;;
    --demo) demo=1; shift ;;
    --auth) auth=1; shift ;;
    --spare-keys) spare_keys=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set/!p}' "$0"; exit 0 ;;
    *) echo "local.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f $model/config.json ]] || { echo "local.sh: no config.json in $model" >&2; exit 2; }
[[ -z $api_keys || -r $api_keys ]] || { echo "local.sh: --gateway-api-keys $api_keys: no such readable file" >&2; exit 2; }
model=$(cd "$model" && pwd)
# the router converts text (and Whisper's audio) with the checkpoint's tokenizer
if [[ -z $tokenizer && ( -f $model/tokenizer.json || -f $model/source.spm ) ]]; then tokenizer=$model; fi
router_tok=()
router_metrics=()
if ((metrics)); then router_metrics=(--metrics-port "$metrics_port"); fi
if [[ -n $tokenizer ]]; then
  [[ -d $tokenizer ]] || { echo "local.sh: --tokenizer $tokenizer is not a folder" >&2; exit 2; }
  router_tok=(--tokenizer "$(cd "$tokenizer" && pwd)")
fi
((decodes >= 1)) || { echo "local.sh: at least one decode worker is needed" >&2; exit 2; }
((decode_tp == 1 || decode_pp == 1)) || { echo "local.sh: a decode group is tensor- or pipeline-parallel" >&2; exit 2; }
[[ $pp_sets == 1 || $pp_sets == 2 ]] || { echo "local.sh: --pp-sets must be 1 or 2" >&2; exit 2; }
((pp_sets == 1 || decode_pp > 1)) || { echo "local.sh: --pp-sets 2 is for a pipeline (--decode-pp N)" >&2; exit 2; }
[[ -z $encode_defer || ( $encode_defer =~ ^-?[0-9]+$ && $pp_sets == 2 ) ]] ||
  { echo "local.sh: --encode-defer takes a number of steps, with --pp-sets 2" >&2; exit 2; }
[[ $encoder_tp =~ ^[1-9][0-9]*$ && $encoder_pp =~ ^[1-9][0-9]*$ ]] ||
  { echo "local.sh: --encoder-tp and --encoder-pp take a rank count" >&2; exit 2; }
((encoder_tp == 1 || encoder_pp == 1)) || { echo "local.sh: an encoder group is tensor- or pipeline-parallel" >&2; exit 2; }
[[ -z $tp_encoder || $tp_encoder == heads || $tp_encoder == rows ]] ||
  { echo "local.sh: --tp-encoder must be heads or rows" >&2; exit 2; }
[[ -z $tp_encoder ]] || ((encoder_tp > 1 || decode_tp > 1)) ||
  { echo "local.sh: --tp-encoder is for tensor-parallel groups (--encoder-tp N or --decode-tp N)" >&2; exit 2; }
[[ $kv_transport == auto || $kv_transport == ucx || $kv_transport == zmq ]] ||
  { echo "local.sh: --kv-transport must be auto, ucx or zmq" >&2; exit 2; }
[[ -z $cross_transfer || $cross_transfer == states || $cross_transfer == kv ]] ||
  { echo "local.sh: --cross-transfer must be states or kv" >&2; exit 2; }
[[ $cross_mode == auto || $cross_mode == kv || $cross_mode == states || $cross_mode == dual ]] ||
  { echo "local.sh: --cross-mode must be auto, kv, states or dual" >&2; exit 2; }
[[ -z $max_batch || $max_batch =~ ^[1-9][0-9]*$ ]] || { echo "local.sh: --max-batch must be a positive integer" >&2; exit 2; }
[[ $spin == auto ]] || { [[ $spin =~ ^[0-9]{1,6}$ ]] && ((spin <= 100000)); } ||
  { echo "local.sh: --spin-us must be 0 to 100000" >&2; exit 2; }
[[ $gateway_spin =~ ^[0-9]{1,6}$ ]] && ((gateway_spin <= 100000)) ||
  { echo "local.sh: --gateway-spin-us must be 0 to 100000" >&2; exit 2; }
[[ $local_link == auto || $local_link == off || $local_link == workers || $local_link == all ]] ||
  { echo "local.sh: --local-link must be auto, off, workers or all" >&2; exit 2; }
[[ $local_link == off || $local_link == auto ]] || ((!auth)) ||
  { echo "local.sh: --local-link has no CURVE: not with --auth" >&2; exit 2; }
[[ $local_link != auto ]] || ((!auth)) || local_link=off
[[ -z $enc_cache ]] || awk -v f="$enc_cache" 'BEGIN { exit !(f ~ /^[0-9.]+$/ && f + 0 >= 0 && f + 0 <= 1) }' ||
  { echo "local.sh: --encoder-cache-fraction must be in [0, 1]" >&2; exit 2; }
[[ -z $local_encode_pct || $local_encode_pct =~ ^[1-9][0-9]*$ ]] ||
  { echo "local.sh: --local-encode-pct must be a positive integer" >&2; exit 2; }
[[ -z $local_encode_margin || $local_encode_margin =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
  { echo "local.sh: --local-encode-margin must be a number of encoder runs (0, 0.5, 2, ...)" >&2; exit 2; }
[[ -z $encode_queue_runs || ( $encode_queue_runs =~ ^[1-9][0-9]{0,3}$ && $encode_queue_runs -le 1000 ) ]] ||
  { echo "local.sh: --encode-queue-runs must be 1 to 1000 runs" >&2; exit 2; }
[[ -z $local_encode_seqs || $local_encode_seqs =~ ^[1-9][0-9]{0,3}$ ]] ||
  { echo "local.sh: --local-encode-seqs must be a number of inputs, 1 to 9999" >&2; exit 2; }
[[ -z $local_encode_seqs ]] || ((decoders_encode)) ||
  { echo "local.sh: --local-encode-seqs is for decode workers that encode (--decoders-encode)" >&2; exit 2; }
[[ -z $encoder_seqs || $encoder_seqs =~ ^[1-9][0-9]{0,3}$ ]] ||
  { echo "local.sh: --encoder-seqs must be a number of inputs, 1 to 9999" >&2; exit 2; }
[[ -z $encoder_seqs ]] || ((encoders > 0)) ||
  { echo "local.sh: --encoder-seqs is for encoder workers (--encoders N)" >&2; exit 2; }
awk -v f="$mem_fraction" 'BEGIN { exit !(f + 0 > 0 && f + 0 <= 1 && f ~ /^[0-9.]+$/) }' ||
  { echo "local.sh: --gpu-memory-fraction must be in (0, 1]" >&2; exit 2; }
[[ $spare_keys =~ ^[0-9]+$ ]] && ((spare_keys <= 256)) || { echo "local.sh: --spare-keys must be 0 to 256" >&2; exit 2; }
if ((auth)); then
  # UCX has no CURVE: with keys KV goes over ZeroMQ
  [[ $kv_transport != ucx ]] || { echo "local.sh: --auth carries KV over ZeroMQ (UCX has no CURVE): use --kv-transport auto" >&2; exit 2; }
fi

bin="${TANDEM_BIN:-$root/build/bin}"
if [[ -z ${TANDEM_BIN:-} ]]; then
  "$root/deploy/setup.sh" release >&2
fi
if [[ -z $device ]]; then
  device=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; fi
fi
[[ $cross_kv_dtype == bf16 || $cross_kv_dtype == int8 ]] ||
  { echo "local.sh: --cross-kv-dtype must be bf16 or int8" >&2; exit 2; }
if [[ $cross_kv_dtype == int8 ]]; then
  # K/V move only between int8 pools: decode workers make them, take them from int8 encoders, or project the
  # encoders' states into them (encoders push states in cross mode auto without --cross-transfer kv)
  [[ $device == cuda ]] || { echo "local.sh: --cross-kv-dtype int8 needs GPU workers (--device cuda)" >&2; exit 2; }
  ((decode_tp == 1 && decode_pp == 1)) ||
    { echo "local.sh: --cross-kv-dtype int8 is for decode workers of one rank" >&2; exit 2; }
  [[ $cross_mode != states ]] ||
    { echo "local.sh: --cross-kv-dtype int8 quantizes the per-layer K/V: not with --cross-mode states" >&2; exit 2; }
  ((encoders == 0 || (encoder_tp == 1 && encoder_pp == 1))) || [[ $cross_transfer != kv && $cross_mode == auto ]] ||
    { echo "local.sh: --cross-kv-dtype int8 with K/V pushes needs encoders of one rank (encoder groups push" \
        "encoder states)" >&2; exit 2; }
fi

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# Ports below the kernel's ephemeral range, which any outgoing connection
# on the machine may take between the probe and the router's bind.
pick_port() {
  local lo=32768 p
  read -r lo _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  ((lo > 12000)) || lo=32768
  for _ in $(seq 200); do
    p=$((10000 + RANDOM % (lo - 10002)))
    if port_free "$p" && port_free $((p + 1)); then port=$p; return 0; fi
  done
  echo "local.sh: no free port found" >&2
  exit 1
}
port_given=$port
[[ -n $port ]] || pick_port
default_run=0
[[ -n $run_dir ]] || default_run=1
run_dir=${run_dir:-"$root/run/local-$(date +%Y%m%d-%H%M%S)-$$"}
mkdir -p "$run_dir"
run_dir=$(cd "$run_dir" && pwd -P)
router_link=()
if [[ $local_link == auto ]]; then
  # Audio requests carry 1.5 MB of features through the router: on a link its one thread copies them in
  # and out, where ZeroMQ's I/O threads share that work (4 x H200 host: 1,650 against 2,400 requests a
  # second, bench/RESULTS.md); the first token of an audio model waits on its encoder, not on the hops.
  if grep -q '"num_mel_bins"' "$model/config.json"; then local_link=off; else local_link=all; fi
fi
if [[ $local_link != off ]]; then
  # a path past a Unix socket's 107 bytes is reached through its directory (proto/link.c)
  router_link=(--client-socket "$run_dir/router-clients.sock" --worker-socket "$run_dir/router-workers.sock")
fi
((default_run)) && ln -sfn "$run_dir" "$root/run/latest"

stopping=0
# SIGTERM through every supervisor of the run directory (those `add` started
# too): the workers first, which drain while the router still serves, then
# the router and the gateway; SIGKILL for what remains.
stop_names() { # seconds to wait, names...
  local t=$1 n p; shift
  for n in "$@"; do
    p=$(cat "$run_dir/$n.supervisor.pid" 2>/dev/null) && kill -TERM "$p" 2>/dev/null || true
  done
  for _ in $(seq $((t * 10))); do
    local alive=0
    for n in "$@"; do
      p=$(cat "$run_dir/$n.supervisor.pid" 2>/dev/null) && running "$p" && alive=1
    done
    ((alive)) || return 0
    sleep 0.1
  done
  for n in "$@"; do
    p=$(cat "$run_dir/$n.pid" 2>/dev/null) && kill -KILL "$p" 2>/dev/null || true
    p=$(cat "$run_dir/$n.supervisor.pid" 2>/dev/null) && kill -KILL "$p" 2>/dev/null || true
  done
}
stop_all() {
  ((stopping)) && return
  stopping=1
  local f n workers=()
  for f in "$run_dir"/*.supervisor.pid; do
    [[ -e $f ]] || continue
    n=$(basename "$f" .supervisor.pid)
    [[ $n == router || $n == gateway ]] || workers+=("$n")
  done
  ((${#workers[@]} == 0)) || stop_names 30 "${workers[@]}"
  stop_names 5 gateway router
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

# each supervisor's pid as started: its pid file may not be written yet when
# the start-up wait first looks (a busy host), and "no file" is not "exited"
declare -A sup_of
start() { # name, command...
  local name=$1; shift
  : >"$run_dir/$name.log"
  "$supervise" --name "$name" --run-dir "$run_dir" -- "$@" </dev/null >/dev/null 2>&1 &
  last_sup=$!
  sup_of[$name]=$last_sup
}
# a process that exited (the supervisor logs it) or whose supervisor is gone
failed_start() { # name, supervisor pid
  ! running "$2" || grep -q "^supervise: .* exited" "$run_dir/$1.log" 2>/dev/null
}

# The plan: each worker's name, GPU (round robin), memory weight and flags;
# the workers on one GPU then share --gpu-memory-fraction by weight.
ngpu=1
[[ $device == cuda ]] && ngpu=$(nvidia-smi -L | wc -l)
group_size=$((decode_tp * decode_pp))
((group_size > 1 && decoders_encode)) && { echo "local.sh: --decoders-encode is for single-process decode workers" >&2; exit 2; }
[[ $group_size -gt 1 && $kv_transport == ucx ]] &&
  { echo "local.sh: decode groups take KV over ZeroMQ (the leader re-slices it): use --kv-transport auto" >&2; exit 2; }
enc_group=$((encoder_tp * encoder_pp))
# a group's ranks take consecutive GPUs of the round robin: one GPU each (NCCL joins distinct devices)
for g in "$group_size" "$enc_group"; do
  [[ $device != cuda || $g -le $ngpu ]] ||
    { echo "local.sh: a group of $g ranks needs $g GPUs, this machine has $ngpu" >&2; exit 2; }
done
((enc_group > 1 && encoders == 0)) && { echo "local.sh: --encoder-tp / --encoder-pp need --encoders 1 or more" >&2; exit 2; }
[[ $enc_group -gt 1 && $cross_transfer == kv ]] &&
  { echo "local.sh: an encoder group pushes encoder states: --cross-transfer kv needs single-rank encoders" >&2; exit 2; }
[[ $enc_group -gt 1 && $kv_transport == ucx ]] &&
  { echo "local.sh: an encoder group pushes over ZeroMQ: use --kv-transport auto" >&2; exit 2; }
w_name=() w_gpu=() w_weight=() w_args=()
gpu=-1
next_gpu() { gpu=$(((gpu + 1) % ngpu)); }
plan() { # name weight flags...
  next_gpu
  w_name+=("$1"); w_gpu+=("$gpu"); w_weight+=("$2"); shift 2; w_args+=("$*")
}
# COUNT workers PREFIX-0 ... of one memory weight, each a group of RANKS ranks
# when RANKS > 1 (one process a rank, one GPU each; rank 0 serves, the NCCL or
# CPU bootstrap goes through the router); PAR: the group's --tp N or --pp N
plan_role() { # prefix count weight ranks par flags...
  local prefix=$1 count=$2 weight=$3 ranks=$4 par=$5 i r name
  shift 5
  for ((i = 0; i < count; i++)); do
    if ((ranks == 1)); then
      plan "$prefix-$i" "$weight" "$@"
      continue
    fi
    for ((r = 0; r < ranks; r++)); do
      name="$prefix-$i"
      ((r > 0)) && name="$prefix-$i-rank$r"
      plan "$name" "$weight" "$@" --group "$prefix-$i" $par --rank "$r"
    done
  done
}
# encoders push encoder states (projected on arrival by every decode worker,
# a group's ranks each its own heads or layers; docs/kvtransfer.md) unless told
# kv; an encoder group's rank 0 takes the jobs and pushes the states
enc_args=(--role encode)
[[ -z $cross_transfer ]] || enc_args+=(--cross-transfer "$cross_transfer")
[[ -z $encoder_seqs ]] || enc_args+=(--max-enc-seqs "$encoder_seqs")
# K/V move only between pools of one dtype: encoders that push K/V keep them in int8 too
if [[ $cross_kv_dtype == int8 && ($cross_transfer == kv || $cross_mode != auto) ]]; then
  enc_args+=(--cross-kv-dtype int8)
fi
epar="--tp $encoder_tp"
((encoder_tp > 1)) && [[ -n $tp_encoder ]] && epar+=" --tp-encoder $tp_encoder"
((encoder_pp > 1)) && epar="--pp $encoder_pp"
plan_role encoder "$encoders" 1 "$enc_group" "$epar" "${enc_args[@]}"
plan_role prefill "$prefills" 1 1 "" --role prefill
# without encoders, decode workers encode for themselves; with them, when
# asked, they take what the encoders' queues cannot (router/placement.c)
roles=decode
((encoders == 0 || decoders_encode)) && roles=encode,decode
par="--tp $decode_tp"
((decode_tp > 1)) && [[ -n $tp_encoder ]] && par+=" --tp-encoder $tp_encoder"
((decode_pp > 1)) && par="--pp $decode_pp --pp-sets $pp_sets${encode_defer:+ --encode-defer $encode_defer}"
dec_args=(--role "$roles")
[[ $cross_kv_dtype == bf16 ]] || dec_args+=(--cross-kv-dtype "$cross_kv_dtype")
[[ -z $local_encode_seqs ]] || dec_args+=(--max-enc-seqs "$local_encode_seqs")
plan_role decode "$decodes" 3 "$group_size" "$par" "${dec_args[@]}"

# CURVE keys: a pair a process (and spares for `add`), the lists the router and workers admit;
# every process gets file paths only, never a key on its command line
keys="" router_keys=() client_keys=() gateway_keys=()
if ((auth)); then
  keys="$run_dir/keys"
  mkdir -p "$keys"
  chmod 700 "$keys"
  for k in router gateway operator client "${w_name[@]}" $(seq -f "spare-%g" 0 $((spare_keys - 1))); do
    "$bin/tandem-keygen" "$keys/$k" >/dev/null || { echo "local.sh: tandem-keygen $keys/$k failed" >&2; exit 1; }
  done
  cat "$keys"/*.pub | grep -v -x -F -f <(cat "$keys"/{router,gateway,operator,client}.pub) >"$keys/workers.list"
  cat "$keys"/{gateway,operator,client}.pub >"$keys/clients.list"
  cat "$keys/operator.pub" >"$keys/admins.list"
  router_keys=(--curve-secret "$keys/router.key" --worker-keys "$keys/workers.list" --client-keys "$keys/clients.list"
               --admin-keys "$keys/admins.list")
  client_keys=(--curve-secret "$keys/client.key" --router-key "$keys/router.pub")
  gateway_keys=(--curve-secret "$keys/gateway.key" --router-key "$keys/router.pub")
  if [[ -z $api_keys ]]; then # the HTTP API keyed too: one key, 32 random bytes
    api_keys="$keys/gateway-api.keys"
    (umask 077 && printf 'tdk-%s\n' "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')" >"$api_keys")
  fi
fi
[[ -z $api_keys ]] || gateway_keys+=(--api-keys "$(cd "$(dirname "$api_keys")" && pwd)/$(basename "$api_keys")")

# Polling before sleeping takes a hop's thread wake-ups off a request's first token (docs/latency.md),
# at a core for each spinning thread (the router's loop, each worker's loop and compute thread) while
# requests come: the default where the cores are idle anyway, a GPU host with two for each; on a CPU
# cluster the spinning threads would take the cores the model computes on.
if [[ $spin == auto ]]; then
  spin=0
  spinners=$((1 + 2 * ${#w_name[@]}))
  cores=$(nproc 2>/dev/null || echo 1)
  if [[ $device == cuda ]] && ((cores >= 2 * spinners)); then
    spin=$default_spin_us
    echo "local.sh: router and workers poll ${spin} us before they sleep ($spinners threads, $cores cores; --spin-us 0: off)"
  fi
fi
# the router first; a port taken since the probe means another pick
for attempt in 1 2 3 4 5; do
  client_ep="tcp://127.0.0.1:$port"
  worker_ep="tcp://127.0.0.1:$((port + 1))"
  start router "$bin/tandem-router" --client-endpoint "$client_ep" --worker-endpoint "$worker_ep" --cross-mode "$cross_mode" \
    ${router_held[@]+"${router_held[@]}"} \
    ${local_encode_pct:+--local-encode-pct "$local_encode_pct"} ${local_encode_margin:+--local-encode-margin "$local_encode_margin"} \
    ${encode_queue_runs:+--encode-queue-runs "$encode_queue_runs"} "${router_tok[@]}" "${router_metrics[@]}" \
    --spin-us "$spin" ${router_link[@]+"${router_link[@]}"} \
    "${router_keys[@]}"
  rsup=$last_sup
  for _ in $(seq 100); do
    grep -q "router serving" "$run_dir/router.log" 2>/dev/null && break
    failed_start router "$rsup" && break
    sleep 0.05
  done
  grep -q "router serving" "$run_dir/router.log" 2>/dev/null && break
  failed_start router "$rsup" || break # still starting: the health wait below decides
  # the supervisor would restart it on the same port: stop it first
  kill -TERM "$rsup" 2>/dev/null; wait "$rsup" 2>/dev/null || true
  if [[ -n $port_given ]] || ! grep -q "Address already in use" "$run_dir/router.log" || ((attempt == 5)); then
    echo "local.sh: the router did not start; logs in $run_dir" >&2
    exit 1
  fi
  pick_port
done
worker_tcp=$worker_ep # a group's ranks rendezvous through the router's endpoint
[[ $local_link == off ]] || worker_ep="local:$run_dir/router-workers.sock"
client_tcp=$client_ep # what any client reaches, on this host or not
[[ $local_link != all ]] || client_ep="local:$run_dir/router-clients.sock"
threads=1
common=(--router "$worker_ep" --model "$model" --device "$device" --block-size "$block_size" --threads "$threads"
        --kv-transport "$kv_transport" --cross-mode "$cross_mode")
[[ -n $max_batch ]] && common+=(--max-batch "$max_batch")
[[ -n $enc_cache ]] && common+=(--encoder-cache-fraction "$enc_cache")
((spin)) && common+=(--spin-us "$spin")
declare -A role_share=()
min_share=""
for ((k = 0; k < ${#w_name[@]}; k++)); do
  total=0
  for ((j = 0; j < ${#w_name[@]}; j++)); do ((w_gpu[j] == w_gpu[k])) && total=$((total + w_weight[j])); done
  share=$(awk -v f="$mem_fraction" -v w="${w_weight[k]}" -v t="$total" 'BEGIN { printf "%.4f", f * w / t }')
  # shellcheck disable=SC2086
  wkeys=()
  [[ -z $keys ]] || wkeys=(--curve-secret "$keys/${w_name[k]}.key" --router-key "$keys/router.pub"
                           --worker-keys "$keys/workers.list")
  grp=()
  [[ " ${w_args[k]} " != *" --group "* ]] || grp=(--router "$worker_tcp")
  start "${w_name[k]}" "$bin/tandem-worker" "${common[@]}" --id "${w_name[k]}" --gpu "${w_gpu[k]}" \
    --gpu-memory-fraction "$share" ${w_args[k]} ${grp[@]+"${grp[@]}"} "${wkeys[@]}"
  r=${w_args[k]#--role }
  r=${r%% *}
  r=${r%%,*}
  role_share[$r]=$share
  [[ -z $min_share ]] || awk -v a="$share" -v b="$min_share" 'BEGIN { exit !(a + 0 < b + 0) }' && min_share=$share
done
# what `local.sh add` needs to start one more worker of this cluster, with its role's options
enc_extra=("${enc_args[@]:2}") dec_extra=("${dec_args[@]:2}")
declare -p bin common client_ep ngpu role_share min_share keys client_keys enc_extra dec_extra >"$run_dir/local.env"

# serving once every worker has registered, in the cross mode asked for
n_enc=$((encoders > 0 && !decoders_encode ? encoders : encoders + decodes))
want="\"cross\": \"$cross_mode\", \"encoders\": $n_enc, \"prefills\": $prefills, \"decoders\": $decodes"
for _ in $(seq 300); do
  for n in router "${w_name[@]}"; do
    failed_start "$n" "${sup_of[$n]}" &&
      { echo "local.sh: $n exited during start-up; logs in $run_dir" >&2; exit 1; }
  done
  h=$("$bin/tandem-client" --router "$client_ep" "${client_keys[@]}" --health --timeout-ms 500 2>/dev/null || true)
  [[ $h == *"$want"* ]] && break
  sleep 0.2
done
[[ $h == *"$want"* ]] || { echo "local.sh: the cluster did not come up; logs in $run_dir" >&2; exit 1; }
echo "router $client_tcp"
[[ $client_ep == "$client_tcp" ]] || echo "router-local $client_ep"
[[ -z $keys ]] || echo "keys $keys"
if ((metrics)); then
  m=$(grep -o "metrics http://[^ ]*" "$run_dir/router.log" 2>/dev/null | head -1 | cut -d' ' -f2)
  [[ -n $m ]] || { echo "local.sh: the router serves no metrics; logs in $run_dir" >&2; exit 1; }
  echo "metrics $m"
fi

# the HTTP gateway, where there is a tokenizer to turn text into ids
tokenizer=${tokenizer:-$model}
if ((gateway)) && [[ -f $tokenizer/tokenizer.json || -f $tokenizer/source.spm ]]; then
  start gateway "$bin/tandem-gateway" --router "$client_ep" --model "$model" --tokenizer "$tokenizer" \
    --port "$gateway_port" --spin-us "$gateway_spin" "${gateway_keys[@]}"
  gsup=$last_sup
  for _ in $(seq 200); do
    grep -q "gateway serving" "$run_dir/gateway.log" 2>/dev/null && break
    failed_start gateway "$gsup" && break
    sleep 0.05
  done
  gw=$(grep -o "gateway serving http://[^ ]*" "$run_dir/gateway.log" 2>/dev/null | head -1 | cut -d' ' -f3)
  [[ -n $gw ]] || { echo "local.sh: the gateway did not start; logs in $run_dir" >&2; exit 1; }
  echo "gateway $gw"
  [[ -z $api_keys ]] || echo "api-keys ${gateway_keys[-1]}"
elif ((gateway)); then
  echo "local.sh: no tokenizer in $tokenizer (--tokenizer DIR): no HTTP gateway" >&2
fi
echo "logs and pid files in $run_dir" >&2

if ((demo)); then
  req="$run_dir/demo.jsonl"
  if grep -q '"num_mel_bins"' "$model/config.json"; then
    # Whisper: the folder's .wav files as audio, the language detected
    wavs=("$model"/*.wav)
    if [[ ! -f ${wavs[0]} || ${#router_tok[@]} -eq 0 ]]; then
      echo "local.sh: --demo with a Whisper model sends the .wav files of its folder (and needs its tokenizer):" \
           "none in $model; try tandem-client --router $client_ep ${client_keys[*]} --audio FILE" >&2
      exit 2
    fi
    for w in "${wavs[@]}"; do echo "{\"id\": \"$(basename "$w")\", \"audio\": \"$w\"}"; done >"$req"
    rc=0
    "$bin/tandem-client" --router "$client_ep" "${client_keys[@]}" --requests "$req" --timeout-ms 60000 >"$run_dir/demo.out" || rc=$?
    cat "$run_dir/demo.out"
    sed -nE 's/^\{"id":"([^"]*)","outputs":\[\{"tokens":\[[^]]*\],"text":"([^"]*)".*/  \1  ->  \2/p' "$run_dir/demo.out"
    exit $rc
  fi
  if ((${#router_tok[@]})); then
    # text in, text out: each id is the question, each result's "text" its answer
    {
      for t in "seven" "forty two" "three hundred five" "four thousand two hundred seven" "ninety thousand one" \
               "seven hundred sixty five thousand four hundred thirty two"; do
        echo "{\"id\": \"$t\", \"text\": \"$t\"}"
      done
      echo '{"id": "twelve thousand (4 beams, 2 answers)", "text": "twelve thousand", "num_beams": 4, "num_return_sequences": 2}'
    } >"$req"
    rc=0
    "$bin/tandem-client" --router "$client_ep" "${client_keys[@]}" --requests "$req" --timeout-ms 60000 >"$run_dir/demo.out" || rc=$?
    cat "$run_dir/demo.out"
    # the same, for a person: question -> first answer
    sed -nE 's/^\{"id":"([^"]*)","outputs":\[\{"tokens":\[[^]]*\],"text":"([^"]*)".*/  \1  ->  \2/p' "$run_dir/demo.out"
    exit $rc
  fi
  eos=$(grep -o '"eos_token_id": *[0-9]*' "$model/config.json" | head -1 | grep -o '[0-9]*$' || echo 1)
  {
    echo "{\"id\": \"demo-greedy\", \"input_ids\": [37, 42, 11, 99, 5, $eos], \"max_new_tokens\": 16}"
    echo "{\"id\": \"demo-beam\", \"input_ids\": [12, 8, 77, 31, $eos], \"num_beams\": 4, \"num_return_sequences\": 2, \"max_new_tokens\": 12}"
    echo "{\"id\": \"demo-sample\", \"input_ids\": [3, 14, 15, 92, 65, $eos], \"temperature\": 0.8, \"top_p\": 0.9, \"seed\": 7, \"n\": 2, \"max_new_tokens\": 12}"
    echo "{\"id\": \"demo-long-prompt\", \"input_ids\": [9, 26, 53, 58, $eos], \"decoder_prompt\": [0, 97, 93, 23, 84, 62, 64, 33, 83, 27, 95, 2, 88, 41, 97, 16, 93, 99, 37, 51], \"max_new_tokens\": 8}"
  } >"$req"
  "$bin/tandem-client" --router "$client_ep" "${client_keys[@]}" --requests "$req" --timeout-ms 60000
  exit $?
fi
# the supervisors keep the processes up; the cluster lasts while the router's does
while kill -0 "$rsup" 2>/dev/null; do
  sleep 1 &
  wait $! || true
done
echo "local.sh: the router's supervisor ended; stopping the cluster (logs in $run_dir)" >&2
exit 1
