"""Flat, flat-p2p, flat-pxn and hierarchical all-to-all (and TAPA as a compiled graph holds it), V-Major's sparse exchange and the ring's
gather on real gloo process groups (torchrun, CPU), with gloo's own rules and with a device
backend's (``COCODIFF_DEVICE_SEMANTICS=1``).

Each process start costs seconds on a small machine, so one launch per world size and mode runs
all cases (tests/workers/collectives_worker.py) and the tests below read its report.
"""

import os
import subprocess
from pathlib import Path

import pytest

from cocodiff_xfuser.comm.transport import DEVICE_SEMANTICS_ENV
from cocodiff_xfuser.tools.launcher import TorchrunError, torchrun

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "collectives_worker.py"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
CASES = [
    "sparse", "v_major_layer", "agreement", "semantics", "layouts", "subgroups", "async", "uneven", "p2p", "p2p_async",
    "pipelined", "ulysses_layout", "same_path", "pxn", "ring", "functional",
]
MODES = {"gloo": {}, "device-semantics": {DEVICE_SEMANTICS_ENV: "1"}}
# 4 ranks (2x2) in both modes; 8 ranks (2x4, 4x2, 2x2x2 and sub-group layouts) under a device
# backend's rules, the stricter of the two (every receive completes in order). Gloo's own order
# inside a batch runs in make test through every other distributed test; its run here is slow tier,
# and so is the 8-rank run (a minute of make test's 20 on two cores; every case still runs there
# under device semantics on 4 ranks).
RUNS = [pytest.param("gloo", 4, marks=pytest.mark.slow), ("device-semantics", 4),
        pytest.param("device-semantics", 8, marks=pytest.mark.slow)]


def run_cases(nproc: int, cases: list[str], env: dict[str, str]) -> str:
    return torchrun(nproc, [str(WORKER), "--cases", ",".join(cases)], env=ENV | env, timeout=240).stdout


@pytest.fixture(scope="module")
def report():
    """``report(mode, nproc)``: that run's output, launched at its first use (as the equivalence
    suite's jobs: a run whose tests are deselected never starts); a failed run is raised again for
    every case, not launched again."""
    outputs: dict[tuple[str, int], str | TorchrunError] = {}

    def output(mode: str, nproc: int) -> str:
        if (mode, nproc) not in outputs:
            try:
                outputs[mode, nproc] = run_cases(nproc, CASES, MODES[mode])
            except TorchrunError as e:
                outputs[mode, nproc] = e
        if isinstance(outputs[mode, nproc], TorchrunError):
            raise outputs[mode, nproc]
        return outputs[mode, nproc]

    return output


@pytest.mark.parametrize("mode, nproc", RUNS)
@pytest.mark.parametrize("case", CASES)
def test_case(report, mode, nproc, case):
    assert f"CASE {case} ok" in report(mode, nproc), report(mode, nproc)


def test_device_semantics_catches_a_misordered_batch():
    """A batch listing its receives before its sends (gloo's order) passes on gloo; under device
    semantics it is replayed as oneCCL would (torchcomms PR #2885) and ends with the one-line fault."""
    assert "CASE misordered ok" in run_cases(2, ["misordered"], {})
    with pytest.raises(TorchrunError) as info:
        run_cases(2, ["misordered"], MODES["device-semantics"])
    output = info.value.result.stdout + info.value.result.stderr
    assert "exchange 'misordered' (flat-p2p over the world) did not complete" in output, output
    assert "(device semantics)" in output and "ending the job" in output, output


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
