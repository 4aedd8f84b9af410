"""xDiT's own test suite, from the installed xfuser wheel, with and without the cocodiff backend.

The xfuser 0.7.0 wheel installs its suite as the top-level ``tests`` package in site-packages, so
the suite run here always matches the pinned xfuser. It runs twice: stock, as every xfuser run on
this host gets it (the plugin installed, no ``--sp-backend``), and with the backend asked for
(``XFUSER_SP_BACKEND=cocodiff``). The check fails on any test whose outcome differs between the two
runs, on any failure or error in either that is not listed, with its reason, in
``xdit_suite/known_failures.txt``, and on any listed test that no longer fails (the list stays
exact; tests whose outcome depends on the host's load are listed as such and exempt). The list is
what catches a platform patch that breaks an xDiT test in both runs.

Stock is not ``COCODIFF_XFUSER_DISABLE=1``: with torch's CPU build xfuser 0.7.0 cannot import
``xfuser.config`` (``envs.get_device_version`` raises), so 31 of the suite's modules could not
even be collected. On a host without CUDA the platform enablement is part of every run (README).

``make test`` runs the suite without :data:`SLOW_MODULES`, which take ~490 s of one run's ~530 s
here (2 cores): they start processes, or read diffusers' source (both runs of the rest: 1.5 min on
a quiet host; the four tests the plugin's device and placement patches once broke are among them).
``make test-all`` (``slow``) runs all of it (17 min).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "xdit_suite"
KNOWN_FAILURES = HERE / "known_failures.txt"

#: Modules left out of ``make test``, with their time in one run on 2 cores.
SLOW_MODULES = {
    "core/test_multirank_load_and_sharding.py": "194 s: two-rank loads in started processes",
    "layers/attention_processor_test.py": "107 s: a multi-process run",
    "core/test_diffusers_floors.py": "78 s: parses diffusers' source",
    "core/test_fp8_quantizer_packaging.py": "75 s: imports in fresh interpreters",
    "core/test_model_replica_group.py": "33 s: a multi-process run",
}


def xdit_suite() -> Path:
    """The ``tests`` directory the xfuser wheel installed next to the ``xfuser`` package."""
    import xfuser

    suite = Path(xfuser.__file__).parent.parent / "tests"
    if not (suite / "core" / "test_envs.py").is_file():
        pytest.fail(f"xDiT's suite is not installed at {suite} (the xfuser 0.7.0 wheel ships it)")
    return suite


def known_failures() -> dict[str, str]:
    """node id -> reason, from ``[reason]`` headers each followed by node ids."""
    reasons, reason = {}, None
    for line in KNOWN_FAILURES.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            reason = line.strip("[]")
        else:
            assert reason is not None, f"{KNOWN_FAILURES.name}: {line} has no [reason] above it"
            reasons[line] = reason
    return reasons


def run_suite(suite: Path, backend: str, ignore: list[str], out: Path) -> dict[str, str]:
    """One run of xDiT's suite; each test's outcome by node id."""
    outcomes = out / f"{backend}.json"
    env = {key: value for key, value in os.environ.items() if key not in ("COCODIFF_XFUSER_DISABLE", "PYTEST_ADDOPTS")}
    env.update(XFUSER_SP_BACKEND=backend, XDIT_OUTCOMES=str(outcomes), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "pytest", str(suite), "-c", os.devnull, "--rootdir", str(suite), "-p", "xdit_outcomes",
        "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", "-o", "timeout=300",
        *(f"--ignore={suite / module}" for module in ignore),
    ]
    log = out / f"{backend}.log"
    with log.open("w") as f:
        subprocess.run(command, cwd=suite, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3000)
    assert outcomes.is_file(), f"xDiT's suite ({backend}) wrote no outcomes; its output: {log}"
    return json.loads(outcomes.read_text())


def disagreements(stock: dict[str, str], plugin: dict[str, str], known: dict[str, str], ignored: list[str]) -> list[str]:
    """Every way the two runs break the rule: outcomes that differ, failures not listed, listed
    tests (of the modules that ran) that do not fail. Tests listed as load-dependent are exempt."""
    exempt = {test for test, reason in known.items() if reason.startswith("load-dependent")}
    found = [
        f"{test}: {stock.get(test, 'not run')} stock, {plugin.get(test, 'not run')} with cocodiff"
        for test in sorted((stock.keys() | plugin.keys()) - exempt)
        if stock.get(test) != plugin.get(test)
    ]
    failing = {test for test, outcome in stock.items() if outcome in ("failed", "error")}
    found += [f"{test}: {stock[test]} (either way), not in {KNOWN_FAILURES.name}" for test in sorted(failing - known.keys())]
    ran = [test for test in known.keys() - exempt if not test.startswith(tuple(ignored))]
    found += [f"{test}: listed in {KNOWN_FAILURES.name} ({known[test]}) but {stock.get(test, 'not run')}"
              for test in sorted(ran) if test not in failing]
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("subset", [pytest.param("fast", marks=pytest.mark.timeout(1200)),
                                    pytest.param("all", marks=[pytest.mark.slow, pytest.mark.timeout(3600)])])
def test_xdit_suite_has_the_same_outcomes_with_and_without_cocodiff(subset, tmp_path):
    suite = xdit_suite()
    ignore = sorted(SLOW_MODULES) if subset == "fast" else []
    stock = run_suite(suite, "ulysses", ignore, tmp_path)
    plugin = run_suite(suite, "cocodiff", ignore, tmp_path)
    assert len(stock) > 500, f"xDiT's suite ran {len(stock)} tests; its output: {tmp_path / 'ulysses.log'}"
    found = disagreements(stock, plugin, known_failures(), ignore)
    assert not found, "xDiT's suite with and without cocodiff:\n" + "\n".join(found)


def test_the_rule_the_suite_is_held_to():
    known = {"a.py::f": "CUDA", "b.py::g": "load-dependent: a deadline", "c.py::h": "CUDA", "slow.py::i": "CUDA"}
    stock = {"a.py::f": "failed", "b.py::g": "passed", "c.py::h": "passed", "d.py::j": "passed", "e.py::k": "error"}
    plugin = {**stock, "b.py::g": "failed", "d.py::j": "failed"}
    assert disagreements(stock, plugin, known, ["slow.py"]) == [
        "d.py::j: passed stock, failed with cocodiff",
        "e.py::k: error (either way), not in known_failures.txt",
        "c.py::h: listed in known_failures.txt (CUDA) but passed",
    ]
