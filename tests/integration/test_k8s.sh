#!/usr/bin/env bash
# The Kubernetes manifests of deploy/k8s, parsed by a YAML parser (Debian's
# yq, with jq): every container's command names a binary the build produces and only
# flags that binary's --help lists; an env reference $(VAR) in a command is
# defined in the container; ports agree between the flags, the container
# ports, the probes and the Services; workers reach the router's Service on
# its worker port; every volume claim is defined.
#   test_k8s.sh BIN_DIR
set -euo pipefail
bin=$1
dir=$(cd "$(dirname "$0")/../../deploy/k8s" && pwd)
for t in yq jq; do command -v $t >/dev/null || { echo "test_k8s: $t is missing (deploy/setup.sh installs it)" >&2; exit 1; }; done
errors=0
err() { echo "test_k8s: $*" >&2; errors=$((errors + 1)); }

all=$(for f in "$dir"/*.yaml; do yq -c --arg f "$(basename "$f")" '. + {_file: $f}' "$f"; done)
[[ -n $all ]] || { echo "test_k8s: no manifests in $dir" >&2; exit 1; }
services=$(jq -c 'select(.kind == "Service")' <<<"$all")
claims=$(jq -r 'select(.kind == "PersistentVolumeClaim") | .metadata.name' <<<"$all")
workloads=$(jq -c 'select(.kind == "Deployment" or .kind == "StatefulSet")' <<<"$all")
[[ -n $workloads ]] || { echo "test_k8s: no workloads" >&2; exit 1; }
n_containers=0
while IFS= read -r w; do
  wname=$(jq -r '.metadata.name' <<<"$w")
  file=$(jq -r '._file' <<<"$w")
  kind=$(jq -r '.kind' <<<"$w")
  if [[ $kind == StatefulSet ]]; then
    svc=$(jq -r '.spec.serviceName' <<<"$w")
    jq -e -s --arg s "$svc" 'any(.[]; .metadata.name == $s)' <<<"$services" >/dev/null || err "$file: $wname: no Service $svc"
  fi
  # the selector matches the pod template's labels
  jq -e '.spec.selector.matchLabels as $m | .spec.template.metadata.labels | contains($m)' <<<"$w" >/dev/null ||
    err "$file: $wname: the selector does not match the pod labels"
  for c in $(jq -r '.spec.template.spec.volumes[]?.persistentVolumeClaim.claimName // empty' <<<"$w"); do
    grep -qx "$c" <<<"$claims" || err "$file: $wname: no PersistentVolumeClaim $c"
  done
  while IFS= read -r c; do
    n_containers=$((n_containers + 1))
    cname="$wname/$(jq -r '.name' <<<"$c")"
    mapfile -t cmd < <(jq -r '(.command // []) + (.args // []) | .[]' <<<"$c")
    ((${#cmd[@]})) || { err "$file: $cname: no command"; continue; }
    exe=$(basename "${cmd[0]}")
    if [[ ! -x $bin/$exe ]]; then
      err "$file: $cname: $exe is not a binary the build produces"
      continue
    fi
    help=$("$bin/$exe" --help 2>&1 || true)
    for a in "${cmd[@]:1}"; do
      if [[ $a == --* ]]; then
        flag=${a%%=*}
        grep -qE -- "(^|[^a-z-])${flag}([^a-z-]|$)" <<<"$help" || err "$file: $cname: $exe takes no $flag"
      fi
      for v in $(grep -oE '\$\([A-Z_]+\)' <<<"$a" | tr -d '$()'); do
        jq -e --arg v "$v" '[.env[]?.name] | index($v)' <<<"$c" >/dev/null || err "$file: $cname: \$($v) is not in its env"
      done
    done
    # the port a flag names (a number, or tcp://HOST:PORT's) is a container port of that name
    flag_port() {  # flag
      local i
      for ((i = 1; i < ${#cmd[@]} - 1; i++)); do
        [[ ${cmd[i]} == "$1" ]] && { echo "${cmd[i + 1]##*:}"; return; }
      done
    }
    port_named() { jq -r --arg n "$1" '.ports[]? | select(.name == $n) | .containerPort' <<<"$c"; }
    if [[ $exe == tandem-router ]]; then
      for pair in --client-endpoint:client --worker-endpoint:worker --metrics-port:metrics; do
        f=${pair%%:*} n=${pair##*:}
        [[ -n $(flag_port "$f") && $(flag_port "$f") == "$(port_named "$n")" ]] ||
          err "$file: $cname: $f gives port '$(flag_port "$f")', its container port $n is '$(port_named "$n")'"
      done
      for probe in readinessProbe livenessProbe; do
        p=$(jq -r --arg p "$probe" '.[$p].httpGet.port // empty' <<<"$c")
        path=$(jq -r --arg p "$probe" '.[$p].httpGet.path // empty' <<<"$c")
        [[ -n $p ]] || { err "$file: $cname: no $probe"; continue; }
        [[ $p =~ ^[0-9]+$ ]] || p=$(port_named "$p")
        [[ $p == "$(port_named metrics)" && $path == /health ]] ||
          err "$file: $cname: $probe reads $path on port $p, not /health on the metrics port"
      done
      # the Service in front of it forwards each of its ports to the container port of that name
      labels=$(jq -c '.spec.template.metadata.labels' <<<"$w")
      s=$(jq -c --argjson l "$labels" 'select(.spec.clusterIP != "None" and (.spec.selector as $s | $l | contains($s)))' <<<"$services")
      [[ -n $s ]] || { err "$file: $cname: no Service selects the router"; continue; }
      while IFS= read -r sp; do
        t=$(jq -r '.targetPort' <<<"$sp")
        [[ $t =~ ^[0-9]+$ ]] || t=$(port_named "$t")
        [[ $t == "$(jq -r '.port' <<<"$sp")" && -n $t ]] || err "$file: Service port $(jq -c . <<<"$sp") does not reach the router's"
      done < <(jq -c '.spec.ports[]' <<<"$s")
    fi
    if [[ $exe == tandem-worker ]]; then
      ep=""
      for ((i = 1; i < ${#cmd[@]} - 1; i++)); do [[ ${cmd[i]} == --router ]] && ep=${cmd[i + 1]}; done
      host=${ep#tcp://}; host=${host%%:*}; port=${ep##*:}
      jq -e -s --arg h "$host" --argjson p "${port:-0}" \
        'any(.[]; .metadata.name == $h and any(.spec.ports[]; .name == "worker" and .port == $p))' <<<"$services" >/dev/null ||
        err "$file: $cname: --router $ep is not the router Service's worker port"
    fi
  done < <(jq -c '.spec.template.spec.containers[]' <<<"$w")
done <<<"$workloads"
((n_containers >= 4)) || err "only $n_containers containers checked"
((errors == 0)) || { echo "test_k8s: $errors problems" >&2; exit 1; }
echo "test_k8s: OK ($n_containers containers in $(ls "$dir"/*.yaml | wc -l) manifests)"
