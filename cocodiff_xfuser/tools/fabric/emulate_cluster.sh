#!/usr/bin/env bash
# Emulated multi-node cluster in network namespaces (root only).
#
#   emulate_cluster.sh up     --preset P --nodes N --local L [--id ID] [--param k=v]...
#   emulate_cluster.sh run    [--preset P --nodes N --local L] [--id ID] [--timeout S] [--port P]
#                             [--logdir DIR] [--tag-output] -- COMMAND [ARGS...]
#   emulate_cluster.sh status [--id ID] [--quiet]
#   emulate_cluster.sh stats  [--id ID]          # tc tbf counters: ns dev sent_bytes dropped overlimits
#   emulate_cluster.sh down   [--id ID | --all]  # idempotent; also cleans leftovers of crashed runs
#
# Presets: shared-uplink | rail | aurora-like.  Their numbers come from
# `python -m cocodiff_xfuser.tools.fabric --shell-env PRESET` (the same numbers Fabric.bound_s uses).
#
# Design (see cocodiff_xfuser/tools/fabric/__init__.py for the link classes):
#  * one namespace per rank, ccd-<ID>-n<node>r<local>; the rank's single address 10.77.<node>.<10+local>/32
#    sits on its eth0 (GLOO_SOCKET_IFNAME=eth0); eth0 is a veth into an unlimited bridge (the node on
#    shared-uplink/rail, the GPU's tile pair on aurora-like).  Ranks with a per-rank shaped port have a
#    second veth up0 (rail NIC / Xe Link port) without an address.
#  * every path is chosen by host routes in the SENDER's namespace (src = the rank address), so the
#    reply takes the mirror path from the other side: same node/GPU -> eth0; same rail (rail) or other
#    GPU of the node (aurora-like) -> up0, on-link; everything else in 10.77/16 -> a router namespace
#    (node router on shared-uplink/aurora-like, the rail's leaf router on rail).  No default route:
#    traffic to anything outside 10.77/16 fails ("Network is unreachable").
#  * routers/switches are namespaces too (ccd-<ID>-n<node>, -leaf<i>, -spine, -sw); nothing is created
#    in the root namespace, so all test traffic stays inside ccd- namespaces (10.77.x / 10.80.x).
#  * shaping: tc tbf on BOTH ends of each shaped veth (egress of each side = one direction), MTU 9000,
#    TCP reno, tcp_slow_start_after_idle=0 and tcp_wmem max 4 MiB in every namespace (tbf queues hold
#    flows x 4 MiB, so they never tail-drop), IPv6 off.
set -euo pipefail

# The directory that holds the cocodiff_xfuser package (a checkout, or site-packages).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
STATE_DIR=${CCD_STATE_DIR:-/run/ccd}

die() { echo "emulate_cluster: $*" >&2; exit 2; }
log() { ((QUIET)) || echo "emulate_cluster: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

pick_python() {
  if [[ -n ${CCD_PYTHON:-} ]]; then echo "$CCD_PYTHON"
  elif [[ -x $ROOT/.venv/bin/python ]]; then echo "$ROOT/.venv/bin/python"
  else echo python3; fi
}

# ----------------------------------------------------------------------------- arguments
SUB=${1:-}
[[ -n $SUB ]] || { usage; exit 2; }
shift
ID=${CCD_ID:-0}
PRESET="" NODES="" LOCAL="" TIMEOUT=0 PORT=29500 LOGDIR="" TAG=0 QUIET=0 ALL=0
PARAMS=()
CMD=()
while (($#)); do
  case $1 in
    --preset) PRESET=${2:?}; shift 2 ;;
    --nodes) NODES=${2:?}; shift 2 ;;
    --local) LOCAL=${2:?}; shift 2 ;;
    --id) ID=${2:?}; shift 2 ;;
    --param) PARAMS+=("${2:?}"); shift 2 ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    --port) PORT=${2:?}; shift 2 ;;
    --logdir) LOGDIR=${2:?}; shift 2 ;;
    --tag-output) TAG=1; shift ;;
    -q|--quiet) QUIET=1; shift ;;
    --all) ALL=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $ID =~ ^[a-z0-9]{1,12}$ ]] || die "--id must be 1-12 chars [a-z0-9], got '$ID'"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout must be whole seconds"
[[ $PORT =~ ^[0-9]+$ ]] || die "--port must be a number"
P="ccd-$ID-"
STATE="$STATE_DIR/$ID.env"

need_root() {
  ((EUID == 0)) || die "must run as root (network namespaces)"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
}

lock() { mkdir -p "$STATE_DIR"; exec 9>"$STATE_DIR/.lock"; flock -w 120 9 || die "lock busy"; }  # one lock for all ids
unlock() { flock -u 9 2>/dev/null || true; exec 9>&-; }

load_preset() {  # evaluates the preset numbers from fabric.py
  [[ -n $PRESET ]] || die "--preset is required (shared-uplink | rail | aurora-like)"
  NODES=${NODES:-2} LOCAL=${LOCAL:-2}
  local pargs=() p env
  for p in "${PARAMS[@]}"; do pargs+=(--param "$p"); done
  env=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$(pick_python)" -m cocodiff_xfuser.tools.fabric \
        --shell-env "$PRESET" --nodes "$NODES" --local "$LOCAL" "${pargs[@]}") \
    || die "invalid fabric (preset=$PRESET nodes=$NODES local=$LOCAL)"
  eval "$env"
  FABRIC_ENV=$env
}

addr() { echo "10.77.$1.$((10 + $2))"; }

# ----------------------------------------------------------------------------- building blocks
mkns() {  # ns forward(0|1)
  ip netns add "$1"
  ip -n "$1" link set lo up
  ip netns exec "$1" sh -c "
    echo reno > /proc/sys/net/ipv4/tcp_congestion_control
    echo 0 > /proc/sys/net/ipv4/tcp_slow_start_after_idle
    echo '$CCD_TCP_WMEM' > /proc/sys/net/ipv4/tcp_wmem
    for k in all default; do
      echo 0 > /proc/sys/net/ipv4/conf/\$k/rp_filter
      echo 0 > /proc/sys/net/ipv4/conf/\$k/send_redirects
      { echo 1 > /proc/sys/net/ipv6/conf/\$k/disable_ipv6; } 2>/dev/null || true
    done
    echo $2 > /proc/sys/net/ipv4/ip_forward"
}
mkbridge() {  # ns br
  ip -n "$1" link add "$2" mtu "$CCD_MTU" type bridge forward_delay 0 stp_state 0 mcast_snooping 0
  ip -n "$1" link set "$2" up
}
mkveth() {  # nsA ifA nsB ifB [bridge-in-B]
  ip -n "$1" link add "$2" mtu "$CCD_MTU" type veth peer name "$4" mtu "$CCD_MTU" netns "$3"
  [[ -z ${5:-} ]] || ip -n "$3" link set "$4" master "$5"
  ip -n "$1" link set "$2" up
  ip -n "$3" link set "$4" up
}
shape() {  # ns dev "tbf args"
  # shellcheck disable=SC2086
  tc -n "$1" qdisc replace dev "$2" root tbf $3
}

build_shared_uplink() {  # also the node/uplink part of aurora-like
  local n l m ns nns a
  mkns "${P}sw" 0
  mkbridge "${P}sw" br0
  for ((n = 0; n < CCD_NODES; n++)); do
    nns="${P}n$n"
    mkns "$nns" 1
    mkveth "$nns" uplink "${P}sw" "n$n" br0
    ip -n "$nns" addr add "10.80.200.$((n + 1))/24" dev uplink
    shape "$nns" uplink "$CCD_TBF_UPLINK"
    shape "${P}sw" "n$n" "$CCD_TBF_UPLINK"
    for ((m = 0; m < CCD_NODES; m++)); do
      ((m == n)) || ip -n "$nns" route add "10.77.$m.0/24" via "10.80.200.$((m + 1))" dev uplink
    done
    if [[ $CCD_PRESET == shared-uplink ]]; then
      mkbridge "$nns" br0
      ip -n "$nns" addr add "10.80.$n.1/32" dev br0
    fi
    for ((l = 0; l < CCD_LOCAL; l++)); do
      ns="${P}n${n}r$l"; a=$(addr "$n" "$l")
      mkns "$ns" 0
      if [[ $CCD_PRESET == shared-uplink ]]; then  # aurora-like wires its ranks in build_aurora
        mkveth "$ns" eth0 "$nns" "r$l" br0
        ip -n "$ns" addr add "$a/32" dev eth0
        ip -n "$nns" route add "$a/32" dev br0
      fi
    done
  done
}

route_rank_shared() {  # node local
  local n=$1 l=$2 k ns="${P}n$1r$2" a
  a=$(addr "$n" "$l")
  for ((k = 0; k < CCD_LOCAL; k++)); do
    ((k == l)) || ip -n "$ns" route add "$(addr "$n" "$k")/32" dev eth0 src "$a"
  done
  ip -n "$ns" route add 10.77.0.0/16 via "10.80.$n.1" dev eth0 onlink src "$a"
}

build_rail() {
  local n l k m ns nns lns a
  mkns "${P}spine" 0
  mkbridge "${P}spine" br0
  for ((l = 0; l < CCD_LOCAL; l++)); do
    lns="${P}leaf$l"
    mkns "$lns" 1
    mkbridge "$lns" br0
    ip -n "$lns" addr add "10.80.$((100 + l)).1/32" dev br0
    mkveth "$lns" uplink "${P}spine" "l$l" br0
    ip -n "$lns" addr add "10.80.200.$((l + 1))/24" dev uplink
    shape "$lns" uplink "$CCD_TBF_SPINE"
    shape "${P}spine" "l$l" "$CCD_TBF_SPINE"
  done
  for ((n = 0; n < CCD_NODES; n++)); do
    nns="${P}n$n"
    mkns "$nns" 0
    mkbridge "$nns" br0
    for ((l = 0; l < CCD_LOCAL; l++)); do
      ns="${P}n${n}r$l"; lns="${P}leaf$l"; a=$(addr "$n" "$l")
      mkns "$ns" 0
      mkveth "$ns" eth0 "$nns" "r$l" br0
      ip -n "$ns" addr add "$a/32" dev eth0
      mkveth "$ns" up0 "$lns" "n$n" br0
      shape "$ns" up0 "$CCD_TBF_RAIL"
      shape "$lns" "n$n" "$CCD_TBF_RAIL"
    done
  done
  # routes: ranks
  for ((n = 0; n < CCD_NODES; n++)); do
    for ((l = 0; l < CCD_LOCAL; l++)); do
      ns="${P}n${n}r$l"; a=$(addr "$n" "$l")
      for ((k = 0; k < CCD_LOCAL; k++)); do
        ((k == l)) || ip -n "$ns" route add "$(addr "$n" "$k")/32" dev eth0 src "$a"
      done
      for ((m = 0; m < CCD_NODES; m++)); do
        ((m == n)) || ip -n "$ns" route add "$(addr "$m" "$l")/32" dev up0 src "$a"
      done
      ip -n "$ns" route add 10.77.0.0/16 via "10.80.$((100 + l)).1" dev up0 onlink src "$a"
    done
  done
  # routes: leaves (own rail on the bridge, other rails via their leaf across the spine)
  for ((l = 0; l < CCD_LOCAL; l++)); do
    lns="${P}leaf$l"
    for ((m = 0; m < CCD_NODES; m++)); do
      for ((k = 0; k < CCD_LOCAL; k++)); do
        if ((k == l)); then
          ip -n "$lns" route add "$(addr "$m" "$k")/32" dev br0
        else
          ip -n "$lns" route add "$(addr "$m" "$k")/32" via "10.80.200.$((k + 1))" dev uplink
        fi
      done
    done
  done
}

build_aurora() {
  local n l k g ns nns a
  build_shared_uplink  # switch, node routers + node uplinks (NIC aggregate), rank namespaces
  for ((n = 0; n < CCD_NODES; n++)); do
    nns="${P}n$n"
    for ((g = 0; g < CCD_LOCAL / 2; g++)); do
      mkbridge "$nns" "g$g"
      ip -n "$nns" addr add "10.80.$n.1/32" dev "g$g"
    done
    mkbridge "$nns" xe
    for ((l = 0; l < CCD_LOCAL; l++)); do
      ns="${P}n${n}r$l"; a=$(addr "$n" "$l"); g=$((l / 2))
      mkveth "$ns" eth0 "$nns" "r$l" "g$g"
      ip -n "$ns" addr add "$a/32" dev eth0
      ip -n "$nns" route add "$a/32" dev "g$g"
      mkveth "$ns" up0 "$nns" "x$l" xe
      shape "$ns" up0 "$CCD_TBF_XE"
      shape "$nns" "x$l" "$CCD_TBF_XE"
    done
    for ((l = 0; l < CCD_LOCAL; l++)); do
      ns="${P}n${n}r$l"; a=$(addr "$n" "$l")
      for ((k = 0; k < CCD_LOCAL; k++)); do
        ((k == l)) && continue
        if ((k / 2 == l / 2)); then
          ip -n "$ns" route add "$(addr "$n" "$k")/32" dev eth0 src "$a"
        else
          ip -n "$ns" route add "$(addr "$n" "$k")/32" dev up0 src "$a"
        fi
      done
      ip -n "$ns" route add 10.77.0.0/16 via "10.80.$n.1" dev eth0 onlink src "$a"
    done
  done
}

do_up() {
  need_root
  load_preset
  lock
  if status_ok; then
    if [[ "$(grep -v -e '^CCD_ID=' -e '^CCD_OWNER=' "$STATE")" == "$FABRIC_ENV" ]]; then
      log "fabric '$ID' already up ($CCD_PRESET ${CCD_NODES}x$CCD_LOCAL)"
      unlock; return 0
    fi
    unlock
    die "fabric '$ID' is up with another configuration; run: $0 down --id $ID"
  fi
  remove_namespaces "^${P}"  # leftovers of a crashed run
  UP_IN_PROGRESS=1
  case $CCD_PRESET in
    shared-uplink)
      build_shared_uplink
      local n l
      for ((n = 0; n < CCD_NODES; n++)); do for ((l = 0; l < CCD_LOCAL; l++)); do route_rank_shared "$n" "$l"; done; done ;;
    rail) build_rail ;;
    aurora-like) build_aurora ;;
    *) die "unknown preset $CCD_PRESET" ;;
  esac
  { printf '%s\n' "$FABRIC_ENV"; echo "CCD_ID=$ID"; } > "$STATE.tmp"
  mv "$STATE.tmp" "$STATE"
  UP_IN_PROGRESS=0
  unlock
  if ((!QUIET)); then
    echo "emulate_cluster: fabric '$ID' up: $CCD_PRESET, $CCD_NODES nodes x $CCD_LOCAL ranks ($CCD_PARAMS)" >&2
    local r
    for ((r = 0; r < CCD_WORLD; r++)); do
      echo "  rank $r  ns ${P}n$((r / CCD_LOCAL))r$((r % CCD_LOCAL))  addr $(addr $((r / CCD_LOCAL)) $((r % CCD_LOCAL)))" >&2
    done
  fi
}

fabric_namespaces() {  # regex -> names
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "$1" || true
}

remove_namespaces() {  # regex
  local ns pids any=0
  local list
  list=$(fabric_namespaces "$1")
  [[ -n $list ]] || return 0
  for ns in $list; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [[ -n $pids ]]; then any=1; kill -TERM $pids 2>/dev/null || true; fi
  done
  if ((any)); then
    local i
    for ((i = 0; i < 20; i++)); do
      pids=""
      for ns in $list; do pids+=$(ip netns pids "$ns" 2>/dev/null || true); done
      [[ -z $pids ]] && break
      sleep 0.1
    done
    for ns in $list; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    done
  fi
  for ns in $list; do ip netns del "$ns" 2>/dev/null || true; done
}

do_down() {
  need_root
  lock
  if ((ALL)); then
    remove_namespaces '^ccd-'
    rm -f "$STATE_DIR"/*.env "$STATE_DIR"/*.env.tmp
    log "removed all ccd- namespaces"
  else
    remove_namespaces "^${P}"
    rm -f "$STATE" "$STATE.tmp"
    log "fabric '$ID' down"
  fi
  unlock
}

status_ok() {  # state file present and every rank namespace exists
  [[ -f $STATE ]] || return 1
  local W L have r
  W=$(sed -n 's/^CCD_WORLD=//p' "$STATE"); L=$(sed -n 's/^CCD_LOCAL=//p' "$STATE")
  [[ -n $W && -n $L ]] || return 1
  have=$(fabric_namespaces "^${P}")
  for ((r = 0; r < W; r++)); do
    grep -qx "${P}n$((r / L))r$((r % L))" <<<"$have" || return 1
  done
}

do_status() {
  if status_ok; then
    ((QUIET)) || { echo "fabric '$ID' up:"; grep '^CCD_' "$STATE" | sed 's/^/  /'; fabric_namespaces "^${P}" | sed 's/^/  ns /'; }
    return 0
  fi
  ((QUIET)) || { echo "fabric '$ID' not up"; fabric_namespaces "^${P}" | sed 's/^/  leftover ns /'; }
  return 1
}

do_stats() {  # one line per tbf qdisc: ns dev sent_bytes dropped overlimits
  local ns
  for ns in $(fabric_namespaces "^${P}"); do
    tc -n "$ns" -s qdisc show 2>/dev/null | awk -v ns="$ns" '
      /^qdisc tbf/ { for (i = 1; i <= NF; i++) if ($i == "dev") dev = $(i + 1); want = 1; next }
      /^qdisc/ { want = 0; next }
      want && /Sent/ { gsub(/[(),]/, " "); for (i = 1; i <= NF; i++) { if ($i == "Sent") s = $(i + 1);
                        if ($i == "dropped") d = $(i + 1); if ($i == "overlimits") o = $(i + 1) }
                       print ns, dev, s, d, o; want = 0 }'
  done
}

# ----------------------------------------------------------------------------- run
declare -a PIDS=()
BROUGHT_UP=0
UP_IN_PROGRESS=0

kill_ranks() {
  local pid i alive
  for pid in "${PIDS[@]}"; do [[ -n $pid ]] && kill -TERM -- "-$pid" 2>/dev/null || true; done
  for ((i = 0; i < 30; i++)); do
    alive=0
    for pid in "${PIDS[@]}"; do [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do [[ -n $pid ]] && kill -KILL -- "-$pid" 2>/dev/null || true; done
  PIDS=()
}

on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  ((${#PIDS[@]})) && kill_ranks
  if ((BROUGHT_UP || UP_IN_PROGRESS)); then
    QUIET=1 do_down || true
  fi
  exit "$rc"
}

do_run() {
  need_root
  ((${#CMD[@]})) || die "run needs a command after --"
  trap on_exit EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local owner
  owner=$(sed -n 's/^CCD_OWNER=//p' "$STATE" 2>/dev/null || true)
  if [[ -n $owner ]] && ! grep -qs emulate_cluster "/proc/$owner/cmdline"; then
    # brought up by a run that died without tearing it down: rebuild it as ours
    log "fabric '$ID' is a leftover of a crashed run (pid $owner); rebuilding it"
    local sp sn sl spar
    sp=$(sed -n 's/^CCD_PRESET=//p' "$STATE"); sn=$(sed -n 's/^CCD_NODES=//p' "$STATE")
    sl=$(sed -n 's/^CCD_LOCAL=//p' "$STATE"); spar=$(sed -n 's/^CCD_PARAMS=//p' "$STATE")
    PRESET=${PRESET:-$sp} NODES=${NODES:-$sn} LOCAL=${LOCAL:-$sl}
    if ((${#PARAMS[@]} == 0)) && [[ -n $spar ]]; then IFS=, read -r -a PARAMS <<<"$spar"; fi
    QUIET=1 do_down
  fi
  if status_ok; then
    local want_p=$PRESET want_n=$NODES want_l=$LOCAL
    # shellcheck disable=SC1090
    source <(grep '^CCD_' "$STATE")
    [[ -z $want_p || $want_p == "$CCD_PRESET" ]] || die "fabric '$ID' is up as $CCD_PRESET, not $want_p"
    [[ -z $want_n || $want_n == "$CCD_NODES" ]] || die "fabric '$ID' has $CCD_NODES nodes, not $want_n"
    [[ -z $want_l || $want_l == "$CCD_LOCAL" ]] || die "fabric '$ID' has $CCD_LOCAL local ranks, not $want_l"
    if ((${#PARAMS[@]})); then  # explicit parameters must match the running fabric's numbers
      local have_env
      have_env=$(grep -v -e '^CCD_ID=' -e '^CCD_OWNER=' "$STATE")
      PRESET=$CCD_PRESET NODES=$CCD_NODES LOCAL=$CCD_LOCAL
      load_preset
      [[ "$have_env" == "$FABRIC_ENV" ]] || die "fabric '$ID' is up with other parameters ($(sed -n 's/^CCD_PARAMS=//p' "$STATE"))"
    fi
    log "using fabric '$ID' that is already up ($CCD_PRESET ${CCD_NODES}x$CCD_LOCAL)"
  else
    QUIET_SAVE=$QUIET; QUIET=1
    BROUGHT_UP=1
    do_up
    echo "CCD_OWNER=$$" >> "$STATE"
    QUIET=$QUIET_SAVE
    log "fabric '$ID' up for this run ($CCD_PRESET ${CCD_NODES}x$CCD_LOCAL)"
  fi
  local own_logdir=0
  if [[ -z $LOGDIR ]]; then LOGDIR=${TMPDIR:-/tmp}/ccd-$ID-run-$$; own_logdir=1; fi
  mkdir -p "$LOGDIR"
  local W=$CCD_WORLD L=$CCD_LOCAL r n l ns master
  master=$(addr 0 0)
  for ((r = 0; r < W; r++)); do
    n=$((r / L)); l=$((r % L)); ns="${P}n${n}r$l"
    local envs=(RANK="$r" WORLD_SIZE="$W" LOCAL_RANK="$l" LOCAL_WORLD_SIZE="$L"
      GROUP_RANK="$n" GROUP_WORLD_SIZE="$CCD_NODES" ROLE_RANK="$r" ROLE_WORLD_SIZE="$W"
      NODE_RANK="$n" MASTER_ADDR="$master" MASTER_PORT="$PORT"
      GLOO_SOCKET_IFNAME=eth0 TP_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1
      CCD_ID="$ID" CCD_FABRIC_PRESET="$CCD_PRESET" CCD_NODES="$CCD_NODES" CCD_LOCAL="$L"
      CCD_RANK_ADDR="$(addr "$n" "$l")" CCD_FABRIC_PARAMS="$CCD_PARAMS")
    if ((r == 0)); then
      setsid ip netns exec "$ns" env "${envs[@]}" "${CMD[@]}" </dev/null &
    elif ((TAG)); then
      setsid ip netns exec "$ns" env "${envs[@]}" "${CMD[@]}" </dev/null \
        > >(tee "$LOGDIR/rank$r.log" | sed -u "s/^/[rank $r] /" >&2) 2>&1 &
    else
      setsid ip netns exec "$ns" env "${envs[@]}" "${CMD[@]}" </dev/null >"$LOGDIR/rank$r.log" 2>&1 &
    fi
    PIDS[r]=$!
  done
  local start=$SECONDS rc=0 first_bad="" code pid left
  local -A done_=()
  while :; do
    left=0
    for ((r = 0; r < W; r++)); do
      [[ -n ${done_[$r]:-} ]] && continue
      pid=${PIDS[r]}
      if kill -0 "$pid" 2>/dev/null; then left=1; continue; fi
      code=0; wait "$pid" || code=$?
      done_[$r]=$code
      if ((code != 0)) && [[ -z $first_bad ]]; then
        first_bad=$r; rc=$code
        echo "emulate_cluster: rank $r exited with code $code; stopping the other ranks" >&2
        ((r == 0)) || { echo "---- tail of $LOGDIR/rank$r.log" >&2; tail -n 20 "$LOGDIR/rank$r.log" >&2 || true; }
      fi
    done
    ((left)) || break
    [[ -n $first_bad ]] && break
    if ((TIMEOUT > 0 && SECONDS - start >= TIMEOUT)); then
      local running=()
      for ((r = 0; r < W; r++)); do [[ -n ${done_[$r]:-} ]] || running+=("$r"); done
      echo "emulate_cluster: timeout after ${TIMEOUT}s; killing ranks still running: ${running[*]}" >&2
      rc=124
      break
    fi
    sleep 0.1
  done
  kill_ranks
  if ((rc == 0 && own_logdir && !TAG)); then
    rm -rf "$LOGDIR"  # success: drop the default per-rank logs (pass --logdir to keep them)
  elif ((W > 1)); then
    log "logs of ranks 1..$((W - 1)): $LOGDIR"
  fi
  return "$rc"
}

case $SUB in
  up) trap 'rc=$?; ((UP_IN_PROGRESS)) && { echo "emulate_cluster: up failed, cleaning" >&2; QUIET=1 do_down || true; }; exit $rc' EXIT
      trap 'exit 130' INT; trap 'exit 143' TERM
      do_up ;;
  down) do_down ;;
  status) do_status ;;
  stats) do_stats ;;
  run) do_run; exit $? ;;
  -h|--help|help) usage ;;
  *) die "unknown subcommand '$SUB' (up|down|run|status|stats)" ;;
esac
