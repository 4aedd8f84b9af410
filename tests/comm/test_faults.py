"""Faults end the job: a stalled (SIGSTOP) or killed (SIGKILL) rank of a 4-rank ``xdit`` job ends
it within the timeout plus 60 s, non-zero, with one line that names a rank, the exchange and the
timeout, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cocodiff_xfuser.tools.launcher import _descendants, _kill_tree

TIMEOUT_S = 10
XDIT = Path(sys.executable).with_name("xdit")


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"xfuser.runner" in cmdline:
            return pid
    return None


def _fault_rank_2(cmd, log: Path, started: str, find_rank_2, fault, **popen) -> tuple[subprocess.Popen, float, int | None, list[int]]:
    """Start ``cmd``, wait for ``started`` in its log, send ``fault`` to rank 2 and wait for the job:
    the job, the seconds from the fault to its end, rank 2's pid, and the pids it left behind."""
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    victim, ended = None, float("inf")
    try:
        deadline = time.monotonic() + 300
        while started not in log.read_text() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.5)
        time.sleep(3)  # well inside the denoising loop: every rank is exchanging
        victim = find_rank_2(job.pid)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, fault)
        faulted = time.monotonic()
        job.wait(timeout=TIMEOUT_S + 60)
        ended = time.monotonic() - faulted
    finally:
        if job.poll() is None:
            _kill_tree(job.pid)
            job.wait()
        time.sleep(2)
        left = [pid for pid in (victim,) if pid and Path(f"/proc/{pid}").exists() and _alive(pid)]
        for pid in left:  # a SIGSTOPped rank that the launcher could not end
            os.kill(pid, signal.SIGKILL)
    return job, ended, victim, left


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _check_one_line_per_rank(job: subprocess.Popen, ended: float, text: str) -> None:
    lines = [line for line in text.splitlines() if line.startswith("cocodiff: rank")]
    assert job.returncode != 0 and ended <= TIMEOUT_S + 60, (job.returncode, ended, text[-3000:])
    assert lines and all(f"timeout {TIMEOUT_S} s" in line and "exchange '" in line for line in lines), text[-3000:]


@pytest.mark.distributed
# A stalled rank ends the job through the timeout, the harder path; a killed one (slow tier) through
# its peers' failed exchanges.
@pytest.mark.parametrize("fault", [signal.SIGSTOP, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)], ids=["stalled", "killed"])
def test_a_failed_rank_ends_the_xdit_job(tmp_path, fault):
    log = tmp_path / "job.log"
    cmd = [
        str(XDIT), "--model", "cocodiff/tiny-flux", "--ulysses_degree", "4", "--sp-backend", "cocodiff",
        "--cocodiff-topology", "2x2", "--cocodiff-timeout", str(TIMEOUT_S), "--num_inference_steps", "2000",
        "--prompt", "a cat", "--output_directory", str(tmp_path),
    ]
    job, ended, victim, left = _fault_rank_2(
        cmd, log, "Running iteration", lambda root: _rank_pid(root, 2), fault,
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _check_one_line_per_rank(job, ended, log.read_text())
    assert not left, f"rank 2 ({victim}) outlived the job"


@pytest.mark.fabric
@pytest.mark.slow  # the xdit job above takes the same path over loopback in make test
@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["stalled", "killed"])
def test_a_failed_rank_ends_an_emulated_multi_node_job(tmp_path, fault):
    """The same on the emulated 2 nodes x 2 cluster (network namespaces, rail fabric): the job ends,
    and neither a process nor a namespace is left behind."""
    from cocodiff_xfuser.tools.fabric import Fabric, available

    ok, why = available()
    if not ok:
        pytest.skip(f"no emulated fabric here: {why}")
    fab = Fabric("rail", 2, 2, fabric_id=f"f{os.getpid() % 100000}")
    log = tmp_path / "job.log"
    cmd = [
        "bash", str(fab.script), "run", "--preset", "rail", "--nodes", "2", "--local", "2", "--id", fab.fabric_id,
        "--logdir", str(tmp_path / "ranks"), "--", sys.executable, "-m", "cocodiff_xfuser.tools.generate",
        "--out", str(tmp_path / "out"), "--model", "cocodiff/tiny-flux", "--ulysses_degree", "4",
        "--sp-backend", "cocodiff", "--cocodiff-topology", "2x2", "--cocodiff-timeout", str(TIMEOUT_S),
        "--num_inference_steps", "2000", "--prompt", "a cat",
    ]

    def rank_2_in_its_namespace(_root: int) -> int | None:
        pids = subprocess.run(["ip", "netns", "pids", fab.namespace(2)], capture_output=True, text=True).stdout.split()
        return next((int(p) for p in pids if b"generate" in Path(f"/proc/{p}/cmdline").read_bytes()), None)

    try:
        # Rank 0's progress bar: the denoising loop has started.
        job, ended, victim, left = _fault_rank_2(
            cmd, log, "/2000 [", rank_2_in_its_namespace, fault, env={**os.environ, "CCD_PYTHON": sys.executable}
        )
    finally:
        fab.down()
    _check_one_line_per_rank(job, ended, log.read_text() + "".join(p.read_text() for p in (tmp_path / "ranks").glob("rank*.log")))
    assert not left, f"rank 2 ({victim}) outlived the job"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert fab.prefix not in namespaces, namespaces


def test_a_failed_exchange_is_one_line_that_the_fault_policy_acts_on(monkeypatch):
    from cocodiff_xfuser import errors
    from cocodiff_xfuser.comm import faults

    # Outside a job (no fault policy installed) the line is raised, for the caller to handle.
    with pytest.raises(faults.ExchangeFailed, match=r"^cocodiff: rank 1: exchange 'q' \(flat over 0-3\) did not complete: "
                                                   r"peer gone; timeout 5 s"):
        faults.failed_exchange(1, "q", "flat over 0-3", 5.0, RuntimeError("peer gone\nstack..."))
    with pytest.raises(errors.UserError, match="^cocodiff: 5 heads"):
        errors.user_error("5 heads")
    # A job's fault policy (xfuser/fault_policy.py) takes the line instead: it ends the rank there.
    seen = []
    monkeypatch.setattr(faults._policy, "handler", seen.append)
    monkeypatch.setattr(errors, "_handler", seen.append)
    faults.failed_exchange(0, "o", "tapa", 1.0, RuntimeError("timed out"))
    errors.user_error("cocodiff: bad")
    assert seen[0].startswith("cocodiff: rank 0: exchange 'o' (tapa) did not complete: timed out") and seen[1] == "cocodiff: bad"


def test_a_compilers_error_is_not_taken_for_a_failed_collective(monkeypatch):
    # dynamo's errors name what it traced (c10d, process groups): its traceback, not an exchange's line.
    import torch._dynamo.exc

    from cocodiff_xfuser.comm import faults
    from cocodiff_xfuser.xfuser import fault_policy

    lines, shown = [], []
    monkeypatch.setattr(faults._policy, "handler", lines.append)
    hook = fault_policy._ending_on_collective_failures(lambda kind, error, tb: shown.append(kind), 5.0)
    traced = torch._dynamo.exc.InternalTorchDynamoError("all_gather_object in distributed_c10d: unregistered member of ProcessGroup")
    hook(type(traced), traced, None)
    assert lines == [] and shown == [type(traced)]
    hook(RuntimeError, RuntimeError("[gloo] connection closed by peer"), None)
    assert len(lines) == 1 and lines[0].startswith("cocodiff: rank -1: exchange 'xfuser'"), lines
