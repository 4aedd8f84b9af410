"""The shipped cluster launchers (cocodiff_xfuser/launchers/): Aurora PBS + mpiexec, Slurm srun, torchrun
on every node.

Dry runs with a fake scheduler environment check the exact command lines and environment; fake
``mpiexec``/``srun`` executables (one process per rank, the launcher's rank variables set) check that
every rank gets torch's env:// variables and the command with ``--sp-backend cocodiff`` added. The
torchrun launcher runs a real generation job on the emulated 2-node cluster (network namespaces,
one torchrun per node), when ``cocodiff_xfuser.tools.fabric.available()`` says it can be built here.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The scripts run under bash (dry runs), the emulated cluster under torchrun.
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ROOT / "cocodiff_xfuser" / "launchers"
SCRIPTS = ("aurora.pbs", "slurm.sbatch", "torchrun-multinode.sh")
AURORA_CPU_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"


def _env(**extra: str) -> dict:
    """A clean environment: no scheduler or torch variables from the host running the tests."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8", **extra}


def _run(script: str, *args: str, env: dict, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCHERS / script), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _dry(script: str, *args: str, env: dict) -> tuple[dict, list[list[str]]]:
    """(exported environment, command lines as argv lists) of a dry run."""
    r = _run(script, "--dry-run", *args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    exports, commands = {}, []
    for line in r.stdout.splitlines():
        words = shlex.split(line)
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            exports[name] = value
        else:
            commands.append(words)
    return exports, commands


def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    path.chmod(0o755)
    return bindir


def _nodefile(tmp_path: Path) -> Path:
    f = tmp_path / "nodefile"
    f.write_text("x4102c5s0b0n0\nx4102c5s1b0n0\nx4102c5s1b0n0\n")  # a repeated host counts once
    return f


# =============================================================================== the files
def test_launchers_ship_inside_the_package():
    names = set(SCRIPTS)
    assert names <= {p.name for p in LAUNCHERS.iterdir()}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'packages = ["cocodiff_xfuser"]' in pyproject  # hatch ships every file in the package dir
    for name in names:
        text = (LAUNCHERS / name).read_text()
        assert text.startswith("#!") and "set -euo pipefail" in text
        assert os.access(LAUNCHERS / name, os.X_OK)


@pytest.mark.skipif(__import__("shutil").which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    r = subprocess.run(["shellcheck", "-s", "bash", *(str(p) for p in sorted(LAUNCHERS.iterdir()))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


_SHARED = re.compile(r"^# --- shared: begin ---\n(.*?)^# --- shared: end ---\n", re.S | re.M)
_SHARED_FUNCTIONS = ("die", "quote", "print_line", "setenv", "print_plan", "parse_args", "has_option", "option_value",
                     "with_cocodiff")


def test_shared_helpers_are_identical():
    """Each launcher is one self-contained file (a batch system copies the job script alone), so the
    helpers are copied into all three between ``# --- shared: begin/end ---``: the copies must match."""
    blocks, outside = {}, {}
    for name in SCRIPTS:
        text = (LAUNCHERS / name).read_text()
        assert text.count("# --- shared: begin ---") == 1 and text.count("# --- shared: end ---") == 1, name
        m = _SHARED.search(text)
        assert m, f"{name}: no shared block"
        blocks[name], outside[name] = m.group(1), text[:m.start()] + text[m.end():]
    reference = blocks[SCRIPTS[0]]
    for fn in _SHARED_FUNCTIONS:
        assert re.search(rf"^{fn}\(\) {{", reference, re.M), f"{fn} is not in the shared block"
    for name in SCRIPTS[1:]:
        diff = "".join(difflib.unified_diff(reference.splitlines(True), blocks[name].splitlines(True),
                                            SCRIPTS[0], name))
        assert blocks[name] == reference, diff
    for name, text in outside.items():  # no script redefines a shared helper after the block
        for fn in _SHARED_FUNCTIONS:
            assert not re.search(rf"^\s*{fn}\(\)", text, re.M), f"{name} redefines {fn}"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("args", [[], ["--dry-run"], ["--dry-run", "--"]])
def test_no_command_is_a_usage_error(script, args):
    r = _run(script, *args, env=_env())
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "usage:" in lines[0] and "no command given" in lines[0]


# =============================================================================== Aurora
def test_aurora_dry_run(tmp_path):
    env = _env(PBS_NODEFILE=str(_nodefile(tmp_path)), PBS_O_WORKDIR=str(tmp_path))
    r = _run("aurora.pbs", "--dry-run", "xdit", "--model", "m", "--ulysses_degree", "24", "--nproc_per_node", "12",
             "--prompt", "a cat", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"cd {tmp_path}"
    exports = dict(shlex.split(line)[1].split("=", 1) for line in lines[1:-1])
    assert all(line.startswith("export ") for line in lines[1:-1])
    assert exports == {
        "CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "FI_MR_CACHE_MONITOR": "userfaultfd",
        # oneCCL's own KVS mode: ALCF's `mpi` needs MPI initialised in the process, which xfuser.runner skips.
        "CCL_KVS_MODE": "pmi", "CCL_KVS_USE_MPI_RANKS": "1", "CCL_CONFIGURATION": "cpu_gpu_dpcpp", "CCL_KVS_CONNECTION_TIMEOUT": "600",
        "FI_PROVIDER": "cxi", "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1",
        "OMP_NUM_THREADS": "8", "MASTER_ADDR": "x4102c5s0b0n0", "MASTER_PORT": "29500",
        "WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "12",
    }
    argv = shlex.split(lines[-1])
    assert argv[:6] == ["mpiexec", "-n", "24", "--ppn", "12", "--cpu-bind"] and argv[6] == AURORA_CPU_BIND
    assert argv[7:9] == ["bash", "-c"] and argv[10] == "cocodiff-rank"
    # xdit's own torchrun options are dropped: mpiexec starts the ranks.
    assert argv[11:] == ["python", "-m", "xfuser.runner", "--model", "m", "--ulysses_degree", "24", "--prompt", "a cat",
                         "--sp-backend", "cocodiff", "--cocodiff_topology", "aurora"]


def test_aurora_keeps_the_users_flags_and_settings(tmp_path):
    env = _env(PBS_NODEFILE=str(_nodefile(tmp_path)), COCODIFF_DRY_RUN="1", CCL_KVS_MODE="mpi", MASTER_PORT="1234")
    exports, [argv] = _dry("aurora.pbs", "--", "python", "run.py", "--sp_backend=cocodiff", "--cocodiff-topology", "2x12",
                           env=env)
    assert exports["CCL_KVS_MODE"] == "mpi" and exports["MASTER_PORT"] == "1234"
    assert argv[11:] == ["python", "run.py", "--sp_backend=cocodiff", "--cocodiff-topology", "2x12"]
    _, [argv] = _dry("aurora.pbs", "python", "run.py", env=_env(PBS_NODEFILE=env["PBS_NODEFILE"], COCODIFF_TOPOLOGY=""))
    assert argv[11:] == ["python", "run.py", "--sp-backend", "cocodiff"]  # empty topology: detected
    r = _run("aurora.pbs", "python", "run.py", env=_env())
    assert r.returncode == 2 and "not inside a PBS job" in r.stderr


def test_aurora_other_ranks_per_node_needs_cpu_bind_and_topology(tmp_path):
    nodefile = str(_nodefile(tmp_path))
    bind6 = "list:1-16:17-32:33-48:53-68:69-84:85-100"
    for extra in ({}, {"CPU_BIND": bind6}, {"COCODIFF_TOPOLOGY": "2x6"}):
        r = _run("aurora.pbs", "--dry-run", "python", "run.py", env=_env(PBS_NODEFILE=nodefile, RANKS_PER_NODE="6", **extra))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, (extra, r.stderr)
        assert "RANKS_PER_NODE=6" in lines[0] and "CPU_BIND" in lines[0] and "COCODIFF_TOPOLOGY" in lines[0]
    # Both given (an empty COCODIFF_TOPOLOGY: detect), or the topology in the command: it runs as asked.
    exports, [argv] = _dry("aurora.pbs", "python", "run.py",
                           env=_env(PBS_NODEFILE=nodefile, RANKS_PER_NODE="6", CPU_BIND=bind6, COCODIFF_TOPOLOGY=""))
    assert argv[:7] == ["mpiexec", "-n", "12", "--ppn", "6", "--cpu-bind", bind6]
    assert (exports["WORLD_SIZE"], exports["LOCAL_WORLD_SIZE"]) == ("12", "6")
    assert argv[11:] == ["python", "run.py", "--sp-backend", "cocodiff"]
    _, [argv] = _dry("aurora.pbs", "python", "run.py", "--cocodiff_topology=2x6",
                     env=_env(PBS_NODEFILE=nodefile, RANKS_PER_NODE="6", CPU_BIND=bind6))
    assert argv[11:] == ["python", "run.py", "--cocodiff_topology=2x6", "--sp-backend", "cocodiff"]


_FAKE_MPIEXEC = """n=; ppn=
while [[ $1 == -* ]]; do
  case $1 in -n) n=$2; shift 2 ;; --ppn) ppn=$2; shift 2 ;; --cpu-bind) shift 2 ;; *) exit 9 ;; esac
done
for ((r = 0; r < n; r++)); do PALS_RANKID=$r PALS_LOCAL_RANKID=$((r % ppn)) "$@"; done
"""

_FAKE_SRUN = """n=; ppn=
while [[ $1 == -* ]]; do
  case $1 in --ntasks=*) n=${1#*=} ;; --ntasks-per-node=*) ppn=${1#*=} ;; esac
  shift
done
for ((r = 0; r < n; r++)); do SLURM_PROCID=$r SLURM_LOCALID=$((r % ppn)) SLURM_NODEID=$((r / ppn)) "$@"; done
"""

# What one rank sees: torch's env:// variables and its own argv.
_SHOW = ("import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in "
         "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'CCL_ATL_TRANSPORT')}"
         " | {'argv': sys.argv[1:]}))")


def test_aurora_ranks_get_torch_environment(tmp_path):
    bindir = _fake_bin(tmp_path, "mpiexec", _FAKE_MPIEXEC)
    env = _env(PATH=f"{bindir}:{os.environ['PATH']}", PBS_NODEFILE=str(_nodefile(tmp_path)))
    r = _run("aurora.pbs", sys.executable, "-c", _SHOW, env=env)
    assert r.returncode == 0, r.stderr
    ranks = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["RANK"], x["LOCAL_RANK"]) for x in ranks] == [(str(i), str(i % 12)) for i in range(24)]
    for x in ranks:
        assert (x["WORLD_SIZE"], x["LOCAL_WORLD_SIZE"], x["MASTER_ADDR"], x["MASTER_PORT"], x["CCL_ATL_TRANSPORT"]) == (
            "24", "12", "x4102c5s0b0n0", "29500", "mpi")
        assert x["argv"] == ["--sp-backend", "cocodiff", "--cocodiff_topology", "aurora"]


# =============================================================================== Slurm
def _slurm_env(tmp_path: Path, **extra: str) -> dict:
    bindir = _fake_bin(tmp_path, "scontrol", '[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a01\\ngpu-a02\\n"\n')
    return _env(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_JOB_NUM_NODES="2",
                SLURM_NTASKS_PER_NODE="8", SLURM_GPUS_PER_NODE="h100:8", **extra)


def test_slurm_dry_run(tmp_path):
    exports, [argv] = _dry("slurm.sbatch", "python", "examples/flux_example.py", "--model", "m", "--ulysses_degree", "16",
                           env=_slurm_env(tmp_path))
    assert exports == {"MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29500", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                       "OMP_NUM_THREADS": "1"}
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--gpus-per-node=8",
                        "--kill-on-bad-exit=1"]
    assert argv[6:8] == ["bash", "-c"] and argv[9] == "cocodiff-rank"
    assert argv[10:] == ["python", "examples/flux_example.py", "--model", "m", "--ulysses_degree", "16",
                         "--sp-backend", "cocodiff", "--cocodiff_topology", "dgx-h100"]
    assert argv.count("--sp-backend") == 1


def test_slurm_topology_override_and_xdit(tmp_path):
    env = _slurm_env(tmp_path, COCODIFF_TOPOLOGY="2x8", COCODIFF_DRY_RUN="yes")
    _, [argv] = _dry("slurm.sbatch", "xdit", "--model", "m", "--sp-backend", "cocodiff", "--master_port=1", env=env)
    assert argv[10:] == ["python", "-m", "xfuser.runner", "--model", "m", "--sp-backend", "cocodiff",
                         "--cocodiff_topology", "2x8"]
    r = _run("slurm.sbatch", "python", "x.py", env=_env())
    assert r.returncode == 2 and "not inside a Slurm allocation" in r.stderr


def test_slurm_topology_follows_tasks_per_node(tmp_path):
    """`dgx-h100` is 8 ranks per node: the default only with 8 tasks per node, else detected."""
    env = _slurm_env(tmp_path)
    for ppn in ("4", "4(x2)"):
        exports, [argv] = _dry("slurm.sbatch", "python", "run.py", env={**env, "SLURM_NTASKS_PER_NODE": ppn,
                                                                         "SLURM_GPUS_PER_NODE": "4"})
        assert argv[1:5] == ["--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--gpus-per-node=4"]
        assert exports["LOCAL_WORLD_SIZE"] == "4"
        assert argv[10:] == ["python", "run.py", "--sp-backend", "cocodiff"]  # detected from hostnames + LOCAL_WORLD_SIZE
    # An explicit COCODIFF_TOPOLOGY wins either way (empty: detect, also with 8 tasks per node).
    _, [argv] = _dry("slurm.sbatch", "python", "run.py", env={**env, "SLURM_NTASKS_PER_NODE": "4", "COCODIFF_TOPOLOGY": "2x4"})
    assert argv[10:] == ["python", "run.py", "--sp-backend", "cocodiff", "--cocodiff_topology", "2x4"]
    _, [argv] = _dry("slurm.sbatch", "python", "run.py", env={**env, "COCODIFF_TOPOLOGY": ""})
    assert argv[10:] == ["python", "run.py", "--sp-backend", "cocodiff"]


def test_slurm_tasks_get_torch_environment(tmp_path):
    env = _slurm_env(tmp_path)
    _fake_bin(tmp_path, "srun", _FAKE_SRUN)
    r = _run("slurm.sbatch", sys.executable, "-c", _SHOW, env=env)
    assert r.returncode == 0, r.stderr
    ranks = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["RANK"], x["LOCAL_RANK"]) for x in ranks] == [(str(i), str(i % 8)) for i in range(16)]
    assert {(x["WORLD_SIZE"], x["LOCAL_WORLD_SIZE"], x["MASTER_ADDR"]) for x in ranks} == {("16", "8", "gpu-a01")}
    assert all(x["argv"] == ["--sp-backend", "cocodiff", "--cocodiff_topology", "dgx-h100"] for x in ranks)


# =============================================================================== torchrun
def test_torchrun_dry_run_script_module_and_xdit():
    env = _env(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    exports, [argv] = _dry("torchrun-multinode.sh", "examples/flux_example.py", "--model", "m", "--ulysses_degree", "16",
                           env=env)
    assert exports == {}
    assert argv == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8", "--master-addr", "10.0.0.1",
                    "--master-port", "29500", "examples/flux_example.py", "--model", "m", "--ulysses_degree", "16",
                    "--sp-backend", "cocodiff"]
    # -m MODULE; degrees ulysses 2 x ring 2 x cfg 2 = 8 ranks on 2 nodes; explicit NPROC_PER_NODE wins.
    _, [argv] = _dry("torchrun-multinode.sh", "-m", "pkg.run", "--ulysses-degree=2", "--ring_degree", "2",
                     "--use_cfg_parallel", env=env)
    assert argv[5:7] == ["--nproc-per-node", "4"] and argv[11:] == ["-m", "pkg.run", "--ulysses-degree=2",
                                                                     "--ring_degree", "2", "--use_cfg_parallel",
                                                                     "--sp-backend", "cocodiff"]
    _, [argv] = _dry("torchrun-multinode.sh", "-m", "pkg.run", env={**env, "NPROC_PER_NODE": "3", "COCODIFF_TOPOLOGY": "2x3",
                                                                     "LOCAL_ADDR": "10.0.0.2", "TORCHRUN": "python -m torch.distributed.run"})
    assert argv == ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3",
                    "--master-addr", "10.0.0.1", "--master-port", "29500", "--local-addr", "10.0.0.2", "-m", "pkg.run",
                    "--sp-backend", "cocodiff", "--cocodiff_topology", "2x3"]
    # The stock multi-node xdit command, unchanged: its torchrun options become torchrun's.
    _, [argv] = _dry("torchrun-multinode.sh", "xdit", "--nnodes", "2", "--node_rank=1", "--master_addr", "h0",
                     "--master_port", "2222", "--model", "m", "--ulysses_degree", "16", "--sp-backend", "cocodiff",
                     env=_env())
    assert argv == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8", "--master-addr", "h0",
                    "--master-port", "2222", "-m", "xfuser.runner", "--model", "m", "--ulysses_degree", "16",
                    "--sp-backend", "cocodiff"]
    # The command as one string (COCODIFF_CMD), as in the batch scripts.
    _, [argv2] = _dry("torchrun-multinode.sh", env=_env(COCODIFF_CMD="xdit --nnodes 2 --node_rank=1 --master_addr h0 "
                                                         "--master_port 2222 --model m --ulysses_degree 16 --sp-backend cocodiff"))
    assert argv2 == argv
    # One node, no degrees: torchrun's own "gpu" (one process per GPU), on this host.
    _, [argv] = _dry("torchrun-multinode.sh", "run.py", env=_env())
    assert argv == ["torchrun", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "gpu", "--master-addr",
                    "127.0.0.1", "--master-port", "29500", "run.py", "--sp-backend", "cocodiff"]


@pytest.mark.parametrize("env,why", [
    ({"NNODES": "2"}, "MASTER_ADDR is required"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK must be in 0..1"),
    ({"NNODES": "3", "MASTER_ADDR": "h"}, "not a multiple of NNODES=3"),
])
def test_torchrun_bad_settings(env, why):
    r = _run("torchrun-multinode.sh", "--dry-run", "run.py", "--ulysses_degree", "4", env=_env(**env))
    assert r.returncode == 2 and why in r.stderr and r.stdout == ""


# =============================================================================== emulated cluster
@pytest.mark.fabric
@pytest.mark.timeout(300)
def test_torchrun_multinode_on_the_emulated_cluster(tmp_path):
    """One torchrun per emulated node, each in the network namespace of its node's first rank.

    The fabric gives every rank a namespace of its own (``ccd-<id>-n<node>r<local>``, address
    10.77.<node>.<10+local>); a per-node torchrun starts all of its node's workers in one namespace, so
    each node's agent and both its workers run in the namespace of the node's local rank 0 and use that
    address (10.77.0.10 is node 0 and the rendezvous host; 10.77.1.10 is node 1). Node 0 reaches node 1
    only over the emulated rail (tc-shaped), checked through the qdisc counters. Both namespaces share
    the host's name, so the topology comes from LOCAL_WORLD_SIZE (= NPROC_PER_NODE), as
    ``Topology.detect`` splits one host into nodes of that size.
    """
    from cocodiff_xfuser.tools.fabric import Fabric, available
    from cocodiff_xfuser.tools.models import tiny

    ok, reason = available()
    if not ok:
        pytest.skip(f"emulated fabric unavailable: {reason}")
    tiny.ensure_fixture("tiny-flux")  # built once here, not raced by the ranks
    fab = Fabric("rail", nodes=2, local=2, fabric_id=f"l{os.getpid() % 100000}")
    out = tmp_path / "out"
    started = time.monotonic()
    with fab:
        procs, logs = [], []
        for node in range(fab.nodes):
            first = node * fab.local
            env = _env(
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                NNODES=str(fab.nodes), NODE_RANK=str(node), NPROC_PER_NODE=str(fab.local),
                MASTER_ADDR=fab.rank_address(0), MASTER_PORT="29511", LOCAL_ADDR=fab.rank_address(first),
                GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
            )
            log = tmp_path / f"node{node}.log"
            logs.append(log)
            argv = ["ip", "netns", "exec", fab.namespace(first), "bash", str(LAUNCHERS / "torchrun-multinode.sh"),
                    "-m", "cocodiff_xfuser.tools.generate", "--out", str(out), "--backends", "cocodiff",
                    "--model", "cocodiff/tiny-flux", "--ulysses_degree", "4", "--prompt", "p", "--seed", "1",
                    "--cocodiff_a2a", "hierarchical"]
            with open(log, "w") as f:
                procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        try:
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        uplinks = {row["ns"]: row["sent_bytes"] for row in fab.qdisc_stats() if row["dev"] == "up0"}
    elapsed = time.monotonic() - started
    text = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    assert codes == [0, 0], text

    result = json.loads((out / "cocodiff--tiny-flux" / "cocodiff" / "result.json").read_text())
    assert result["sp_backend"] == "cocodiff" and result["world_size"] == 4
    ran = result["ran"]
    assert ran["fallbacks"] == {} and "stock" not in ran["exchanges"], ran
    assert ran["exchanges"].get("hierarchical", 0) > 0, ran  # TAPA's two levels, node then rail
    assert ran["slow_link_bytes"] > 0, ran  # some of every exchange went to the other node
    # Both nodes' ranks saw 2 nodes x 2: the backend logs its topology on every rank.
    for log in logs:
        assert "ulysses group of 4 on topology 2x2 (2 node x 2 gpu)" in log.read_text(), text
    # Inter-node bytes left each node through its first rank's shaped rail NIC.
    sent = uplinks[fab.namespace(0)] + uplinks[fab.namespace(2)]
    assert sent >= ran["slow_link_bytes"], (uplinks, ran["slow_link_bytes"])
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(fab.prefix)]
    print(f"2 nodes x 2 ranks via torchrun-multinode.sh: {elapsed:.1f} s, inter-node {sent} bytes "
          f"(exchanges' share {ran['slow_link_bytes']})")
