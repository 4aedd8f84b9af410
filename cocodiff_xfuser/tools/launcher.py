"""Start a single-node torchrun job from Python (tests, CLI) without leaving processes behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence


class TorchrunError(RuntimeError):
    """A torchrun job failed or timed out; the message ends with the tail of its output."""

    def __init__(self, message: str, result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(message)
        self.result = result

    def first_line(self) -> str:
        """The job's own error in one line: a ``cocodiff:`` line, else the last exception line."""
        lines = [line.split("]: ", 1)[-1].strip() for line in (self.result.stderr or "").splitlines()]
        ours = [line for line in lines if line.startswith("cocodiff")]
        raised = [line for line in lines if "Error: " in line and not line.startswith("torch.distributed.elastic")]
        found = ours or raised
        return found[-1] if found else str(self).splitlines()[0]


def free_port(host: str = "127.0.0.1") -> int:
    # Another process may take the port before torchrun binds it; rare enough on one machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun(
    nproc: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    tail_chars: int = 6000,
    while_running: Callable[[], None] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc ... *argv`` and wait.

    ``argv`` is what follows torchrun's own options: a script and its arguments, or
    ``["-m", "module", ...]``. ``env`` is added to the current environment (``OMP_NUM_THREADS``
    defaults to 1). ``while_running`` is called about once a second until the job ends (a
    progress bar). ``cwd``: the job's working directory. Returns the completed process with text stdout/stderr; raises
    ``TorchrunError`` on a non-zero exit or on timeout (after killing torchrun and its workers).
    """
    port = master_port or free_port(master_addr)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", master_addr,
        "--master-port", str(port),
        *argv,
    ]
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    # Own session: the terminal's Ctrl-C reaches only us, and we clean up in ``finally``.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True, cwd=cwd
    )
    timed_out = False
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
                if while_running is not None:
                    while_running()
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc.pid)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if timed_out or proc.returncode != 0:
        why = f"timed out after {timeout:g} s" if timed_out else f"exited with code {proc.returncode}"
        raise TorchrunError(
            f"torchrun {why}: {' '.join(cmd)}\n--- stdout tail ---\n{out[-tail_chars:]}"
            f"\n--- stderr tail ---\n{err[-tail_chars:]}",
            result,
        )
    return result


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every process below it.

    torchrun starts each worker in a session of its own, so killing torchrun's process group
    leaves the workers running (and holding our pipes). Stopping torchrun's group first keeps
    it from spawning while its descendants are collected (Linux /proc).
    """
    _signal_group(pid, signal.SIGSTOP)
    for child in [pid, *_descendants(pid)]:
        _signal_group(child, signal.SIGKILL)
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # Field 4 is the parent pid; the command name (field 2) may contain spaces.
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
