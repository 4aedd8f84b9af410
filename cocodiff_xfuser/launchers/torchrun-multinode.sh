#!/usr/bin/env bash
# torchrun on every node: an xDiT (xfuser) command on NNODES nodes with `--sp-backend cocodiff` added.
# Run it once per node (ssh, pdsh, `srun --ntasks-per-node=1`, a Kubernetes pod per node, ...).
#
# Replaces the stock per-node launch:
#     torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --master-addr HEAD --master-port 29500 \
#         examples/flux_example.py --model M --ulysses_degree 16 ...
# with
#     NNODES=2 NODE_RANK=R MASTER_ADDR=HEAD torchrun-multinode.sh examples/flux_example.py --model M --ulysses_degree 16 ...
# The command is what stock torchrun takes after its options: a script and its arguments, or
# `-m MODULE ARGS`. `xdit ARGS` (which starts torchrun itself, xfuser/cli.py) is accepted too and runs as
# `-m xfuser.runner ARGS`; xdit's own --nnodes/--node_rank/--master_addr/--master_port/--nproc_per_node
# are taken as the values below.
#
# Environment (defaults): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1; required with NNODES > 1),
# MASTER_PORT (29500), NPROC_PER_NODE (the product of the command's parallel degrees --ulysses_degree,
# --ring_degree, ... divided by NNODES, as xdit infers it; `gpu` when it gives none), LOCAL_ADDR
# (torchrun --local-addr, unset), TORCHRUN (torchrun), COCODIFF_TOPOLOGY (unset: cocodiff detects the
# topology from hostnames and LOCAL_WORLD_SIZE = NPROC_PER_NODE; e.g. 4x8 or dgx-h100 to force one).
#
# The command may also come as one string, COCODIFF_CMD='xdit ...', when there are no arguments.
# `--dry-run` as the first argument, or COCODIFF_DRY_RUN=1, prints the command line and exits 0.
# Where to find this file after `pip install`:
#     python -c "import cocodiff_xfuser, pathlib; print(pathlib.Path(cocodiff_xfuser.__file__).parent / 'launchers')"
set -euo pipefail

NAME=torchrun-multinode.sh
USAGE='SCRIPT [ARGS...] | -m MODULE [ARGS...] | xdit [ARGS...]'

# --- shared: begin ---
# The same in aurora.pbs, slurm.sbatch and torchrun-multinode.sh: each script stays one self-contained
# file (a batch system copies the job script alone), and tests/launchers/test_launchers.py checks that
# the three copies are identical. Set NAME and USAGE before this block.

die() { printf '%s: %s\n' "$NAME" "$*" >&2; exit 2; }

quote() {  # one word as the shell reads it back (quoted only when needed)
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
print_line() { local out="" w; for w in "$@"; do out+="${out:+ }$(quote "$w")"; done; printf '%s\n' "$out"; }

ENV_NAMES=()
setenv() {  # NAME DEFAULT: export NAME (its current value if set and non-empty)
  local name=$1 value=${!1:-$2}
  export "$name=$value"
  ENV_NAMES+=("$name")
}

# What --dry-run prints: the exported settings (`export NAME=value` lines), then the command line.
print_plan() {
  local name
  for name in "${ENV_NAMES[@]}"; do print_line export "$name=${!name}"; done
  print_line "$@"
}

# ARGS: [--dry-run] [--] COMMAND [ARGS...], or COCODIFF_CMD (the command as one string of shell words:
# qsub passes no arguments to a job script). Sets DRY (also on with COCODIFF_DRY_RUN=1) and CMD.
parse_args() {
  DRY=0
  case ${COCODIFF_DRY_RUN:-0} in 1|true|yes) DRY=1 ;; esac
  if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
  if [[ ${1:-} == -- ]]; then shift; fi
  CMD=("$@")
  if ((${#CMD[@]} == 0)) && [[ -n ${COCODIFF_CMD:-} ]]; then
    eval "CMD=($COCODIFF_CMD)"
  fi
  ((${#CMD[@]})) || die "usage: $NAME [--dry-run] [--] $USAGE (or COCODIFF_CMD='COMMAND ARGS'): no command given"
}

has_option() {  # OPTION...: whether CMD has one of them (as `OPTION` or `OPTION=VALUE`)
  local a o
  for a in "${CMD[@]}"; do
    for o in "$@"; do [[ $a == "$o" || $a == "$o"=* ]] && return 0; done
  done
  return 1
}

option_value() {  # OPTION: its value in CMD (`OPTION VALUE` or `OPTION=VALUE`, the last wins), or ""
  local i value=""
  for ((i = 0; i < ${#CMD[@]}; i++)); do
    case ${CMD[i]} in
      "$1") value=${CMD[i + 1]:-} ;;
      "$1"=*) value=${CMD[i]#*=} ;;
    esac
  done
  printf '%s\n' "$value"
}

# with_cocodiff TOPOLOGY RUNNER...: CMD with `--sp-backend cocodiff` and `--cocodiff_topology TOPOLOGY`
# added unless the command has them (TOPOLOGY empty: none added, cocodiff detects the topology).
# `xdit ARGS` runs `torchrun ... -m xfuser.runner ARGS` (xfuser/cli.py): it becomes `RUNNER... ARGS`
# without xdit's torchrun options (--nnodes, --node_rank, --master_addr, --master_port,
# --nproc_per_node), which the launch provides.
XDIT_LAUNCH_OPTIONS=(--nnodes --node_rank --master_addr --master_port --nproc_per_node)
with_cocodiff() {
  local topology=$1 i=0 a o
  shift
  local -a out=()
  if [[ ${CMD[0]##*/} == xdit ]]; then
    out=("$@")
    for ((i = 1; i < ${#CMD[@]}; i++)); do
      a=${CMD[i]}
      for o in "${XDIT_LAUNCH_OPTIONS[@]}"; do
        if [[ $a == "$o" ]]; then i=$((i + 1)); continue 2; fi
        if [[ $a == "$o"=* ]]; then continue 2; fi
      done
      out+=("$a")
    done
    CMD=("${out[@]}")
  fi
  has_option --sp-backend --sp_backend || CMD+=(--sp-backend cocodiff)
  has_option --cocodiff_topology --cocodiff-topology || [[ -z $topology ]] || CMD+=(--cocodiff_topology "$topology")
}
# --- shared: end ---

# ----------------------------------------------------------------------------- arguments
parse_args "$@"
# xdit's own torchrun options are the values below.
X_NNODES="" X_NODE_RANK="" X_MASTER_ADDR="" X_MASTER_PORT="" X_NPROC=""
if [[ ${CMD[0]##*/} == xdit ]]; then
  X_NNODES=$(option_value --nnodes)
  X_NODE_RANK=$(option_value --node_rank)
  X_MASTER_ADDR=$(option_value --master_addr)
  X_MASTER_PORT=$(option_value --master_port)
  X_NPROC=$(option_value --nproc_per_node)
fi
# torchrun runs `-m xfuser.runner` in each worker; the topology is detected unless COCODIFF_TOPOLOGY.
with_cocodiff "${COCODIFF_TOPOLOGY:-}" -m xfuser.runner

# The world size the command's parallel degrees ask for (xfuser/cli.py get_nproc_from_args), or "".
degrees_product() {
  local i=0 a n=${#CMD[@]} product=1 found=0
  while ((i < n)); do
    a=${CMD[i]}
    case $a in
      --ulysses_degree|--ulysses-degree|--ring_degree|--ring-degree|--tensor_parallel_degree|--tensor-parallel-degree|\
      --pipefusion_parallel_degree|--pipefusion-parallel-degree|--data_parallel_degree|--data-parallel-degree)
        [[ ${CMD[i + 1]:-} =~ ^[0-9]+$ ]] && { product=$((product * CMD[i + 1])); found=1; i=$((i + 1)); } ;;
      --ulysses_degree=*|--ulysses-degree=*|--ring_degree=*|--ring-degree=*|--tensor_parallel_degree=*|\
      --tensor-parallel-degree=*|--pipefusion_parallel_degree=*|--pipefusion-parallel-degree=*|\
      --data_parallel_degree=*|--data-parallel-degree=*)
        [[ ${a#*=} =~ ^[0-9]+$ ]] && { product=$((product * ${a#*=})); found=1; } ;;
      --use_cfg_parallel|--use_cfg_parallel=True|--use-cfg-parallel) product=$((product * 2)); found=1 ;;
    esac
    i=$((i + 1))
  done
  if ((found)); then echo "$product"; fi
}

NNODES=${X_NNODES:-${NNODES:-1}}
NODE_RANK=${X_NODE_RANK:-${NODE_RANK:-0}}
MASTER_PORT=${X_MASTER_PORT:-${MASTER_PORT:-29500}}
MASTER_ADDR=${X_MASTER_ADDR:-${MASTER_ADDR:-}}
[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
if ! [[ $NODE_RANK =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
  die "NODE_RANK must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
if [[ -z $MASTER_ADDR ]]; then
  ((NNODES == 1)) || die "MASTER_ADDR is required with NNODES=$NNODES (the address of node 0)"
  MASTER_ADDR=127.0.0.1
fi
NPROC=${X_NPROC:-${NPROC_PER_NODE:-}}
if [[ -z $NPROC ]]; then
  world=$(degrees_product)
  if [[ -z $world ]]; then
    NPROC=gpu
  else
    ((world % NNODES == 0)) || die "the parallel degrees ask for $world ranks, not a multiple of NNODES=$NNODES; set NPROC_PER_NODE"
    NPROC=$((world / NNODES))
  fi
fi

read -r -a TORCHRUN_CMD <<<"${TORCHRUN:-torchrun}"
LAUNCH=("${TORCHRUN_CMD[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
[[ -z ${LOCAL_ADDR:-} ]] || LAUNCH+=(--local-addr "$LOCAL_ADDR")
LAUNCH+=("${CMD[@]}")

if ((DRY)); then
  print_plan "${LAUNCH[@]}"
  exit 0
fi
exec "${LAUNCH[@]}"
