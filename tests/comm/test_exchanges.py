"""Flat, flat-p2p (receives-first) and hierarchical all-to-all on real gloo process groups (torchrun, CPU).

Each process start costs seconds on a small machine, so one launch per world size runs all
cases (tests/workers/collectives_worker.py) and the tests below read its report.
"""

import os
import subprocess
from pathlib import Path

import pytest

from cocodiff_xfuser.tools.launcher import TorchrunError, torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "collectives_worker.py"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
CASES = [
    "sparse", "v_major_layer", "agreement", "semantics", "layouts", "subgroups", "async", "uneven", "p2p", "p2p_async",
    "pipelined", "ulysses_layout",
]


def run_cases(nproc: int) -> str:
    return torchrun(nproc, [str(WORKER), "--cases", ",".join(CASES)], env=ENV, timeout=240).stdout


@pytest.fixture(scope="module")
def reports() -> dict[int, str]:
    # 4 ranks: 2x2; 8 ranks: 2x4, 4x2, 2x2x2 and sub-group layouts.
    return {n: run_cases(n) for n in (4, 8)}


@pytest.mark.parametrize("nproc", [4, 8])
@pytest.mark.parametrize("case", CASES)
def test_case(reports, nproc, case):
    assert f"CASE {case} ok" in reports[nproc], reports[nproc]


def test_launcher_reports_failures(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nprint('worker says hello', flush=True)\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(TorchrunError, match=r"exited with code 1(.|\n)*worker says hello") as info:
        torchrun(2, [str(script)], timeout=60)
    assert info.value.result.returncode != 0


def test_launcher_kills_on_timeout(tmp_path):
    script = tmp_path / "hang_forever.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(TorchrunError, match="timed out after 5 s"):
        torchrun(2, [str(script)], timeout=5)
    leftover = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert leftover.stdout == "", f"processes left behind: {leftover.stdout}"
