"""The test tiers, by what a test costs.

* ``unit``: one process, nothing launched (``make test-fast``, under two minutes);
* ``distributed``: starts processes on this host (torchrun jobs, the ``cocodiff``/``xdit`` commands);
* ``fabric``: brings up an emulated cluster (root, network namespaces; skipped where unavailable);
* ``slow``: benchmark-style checks, left out of ``make test``.

A test marked neither ``distributed`` nor ``fabric`` is ``unit``, and a unit test that starts a
process fails, so the tier cannot drift from what the test does.
"""

from __future__ import annotations

import importlib
import subprocess

import pytest

LAUNCHING = ("distributed", "fabric")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in LAUNCHING):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="module")
def at_first_use(tmp_path_factory: pytest.TempPathFactory):
    """``at_first_use(make)``: a function of a name that returns ``make(name, a fresh directory)``,
    made at the name's first use in the module and kept (a job runs only where a selected test uses it)."""

    def outputs_of(make):
        outputs = {}

        def output(name: str):
            if name not in outputs:
                outputs[name] = make(name, tmp_path_factory.mktemp(name))
            return outputs[name]

        return output

    return outputs_of


@pytest.fixture(scope="session", autouse=True)
def _matplotlib_font_cache() -> None:
    """matplotlib runs ``fc-list`` the first time it loads on a machine (its font cache): loaded once
    here, so that a unit test drawing a figure starts no process on a fresh machine either."""
    try:
        importlib.import_module("matplotlib.font_manager")
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _unit_tests_launch_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} started a process: mark it distributed (or fabric)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
