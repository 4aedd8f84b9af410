"""``cocodiff bench graphs``: cocodiff's layers inside xDiT's compiled FLUX graph, as one rank of
Ulysses 8 over torch's fake process group."""

import json
import logging
import os
import subprocess
import sys

import pytest

from cocodiff_xfuser.tools import cli
from cocodiff_xfuser.tools.bench import graphs

GENERATED = """
def partition_0(args):
    buf1 = torch.ops.cocodiff.v_first_start.default(buf0, 'flux.double.v', 0)
    assert_alignment(buf1, 16, 'torch.ops.cocodiff.v_first_start.default')

def call(args):
    u0 = torch.ops.aten._local_scalar_dense.default(buf2)
    buf3 = torch.ops.cocodiff.v_first_output.default(buf1)
runner = Runner(partitions=[partition_0, partition_1,])
"""


def test_the_generated_code_gives_partitions_operators_and_host_reads():
    report = graphs._code_report([GENERATED, "runner = Runner(partitions=[partition_0,])", "def call(args):\n    pass"])
    assert report == {
        "graphs": 3, "partitions_per_graph": [2, 1, 0], "partitions": 3,
        "cocodiff_ops": {"v_first_start": 1, "v_first_output": 1},  # calls, not the checks that name them
        "host_reads": ["u0 = torch.ops.aten._local_scalar_dense.default(buf2)"],
    }


def test_inductors_cudagraphs_log_is_counted_and_left_as_it_was():
    from torch._inductor import cudagraph_utils, scheduler

    loggers = [logging.getLogger(name) for name in graphs._CUDAGRAPH_LOGGERS]
    before = [(log.level, log.propagate, list(log.handlers)) for log in loggers]
    with graphs._cudagraphs_log() as counts:
        for _ in range(2):
            cudagraph_utils.cudagraphs_log.warning("skipping cudagraphs due to mutated inputs (1 instances)")
        scheduler.cudagraphs_log.debug("Created %d graph partitions: %d cudagraphable, %d non-cudagraphable", 3, 2, 1)
        scheduler.cudagraphs_log.debug("         %s", 'File "model.py", line 1')  # a node's stack trace
    assert counts == {"skipping cudagraphs due to mutated inputs (1 instances)": 2,
                      "Created 3 graph partitions: 2 cudagraphable, 1 non-cudagraphable": 1}
    assert [(log.level, log.propagate, list(log.handlers)) for log in loggers] == before


def test_an_unknown_configuration_is_one_line(capsys):
    assert cli.main(["bench", "graphs", "--configs", "cocodiff,eager"]) == 2
    assert capsys.readouterr().err.strip() == (
        "cocodiff bench graphs: --configs: eager not among stock, cocodiff, cocodiff+vfirst, cocodiff+vfirst+vmajor, "
        "cocodiff+vfirst+vmajor-budget")


@pytest.mark.slow  # compiles five models
@pytest.mark.distributed  # the fake world and xfuser's groups belong to the process: a process of its own
def test_every_configuration_runs_its_own_path_at_tiny_size(tmp_path):
    out = tmp_path / "graphs.json"
    warmup, reps = 3, 2
    done = subprocess.run(
        [sys.executable, "-m", "cocodiff_xfuser.tools.cli", "bench", "graphs", "--tiny", "--device", "cpu", "--double", "1",
         "--single", "1", "--warmup", str(warmup), "--reps", str(reps), "--json", str(out)],
        capture_output=True, text=True, timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["spec"]["heads"] == graphs.SPECS["tiny"].heads
    assert report["world"] == report["ulysses"] == 8 and report["topology"] == "2x4"
    assert report["versions"]["torch"] and report["versions"]["xfuser"] == "0.7.0"
    rows = {row["name"]: row for row in report["configs"]}
    assert list(rows) == list(graphs.CONFIGS)
    forwards = warmup + reps + 1
    for name, row in rows.items():
        assert row["forwards"] == forwards and len(row["host_s"]) == reps and row["host_s_per_block"] > 0, name
        assert row["device_s"] is None and row["cuda_graph_launches_per_forward"] == 0, name  # no GPU here
        assert row["device_kernels_per_forward"] == [], name
        assert row["graphs"] >= 1 and len(row["partitions_per_graph"]) == row["graphs"], name
        assert row["graph_calls_per_forward"] >= 1 and row["host_reads"] == [], name
        assert all(isinstance(n, int) for n in (*row["cocodiff_ops"].values(), *row["graph_breaks"].values())), name
    ran = {name: row["ran"] for name, row in rows.items()}
    layers = 2 * forwards  # one double and one single block per forward
    assert ran["stock"]["exchanges"] == {} and ran["stock"]["v_first_calls"] == 0
    # xfuser's processors over cocodiff's exact exchange: Q/K/V in one exchange, then the output.
    assert ran["cocodiff"]["labels"] == {"usp": 2 * layers} and ran["cocodiff"]["v_first_calls"] == 0
    assert ran["cocodiff+vfirst"]["v_first_calls"] == layers and ran["cocodiff+vfirst"]["v_major_sparse"] == {}
    assert set(ran["cocodiff+vfirst"]["exchanges"]) == {"flat"}
    per_call = ran["cocodiff+vfirst+vmajor-budget"]
    assert per_call["v_first_calls"] == layers and per_call["v_major_sparse"] == {"qk+v": layers, "o": layers}, per_call
    assert 0 < per_call["v_major_tokens"]["active"] <= per_call["v_major_tokens"]["tokens"], per_call
    # V-Major's static path (the defaults): its exchanges functional collectives, no operator of cocodiff's.
    static = rows["cocodiff+vfirst+vmajor"]
    assert static["cocodiff_ops"] == {} and static["ran"]["v_first_calls"] == layers, static
    assert "v-major one-phase" in static["ran"]["exchanges"] and static["ran"]["v_major_sparse"].get("qk+v", 0) > 0, static["ran"]
    assert "cocodiff bench graphs: tiny" in done.stdout


#: Dynamo as torch before 2.13 runs a function marked to run at trace time (compat.trace_time): its
#: arguments constants only, no object (torch 2.11 refused V-First's and V-Major's traced calls so
#: on an H100, docs/benchmarks.md "On one H100"); the same check here, on this torch.
_OBJECTS_REFUSED = """
import sys
import torch._dynamo.variables.functions as functions
from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

accepted = functions.invoke_and_store_as_constant

def constants_only(tx, fn, name, args, kwargs):
    objects = [type(a.value).__name__ for a in [*args, *kwargs.values()] if isinstance(a, UserDefinedObjectVariable)]
    assert not objects, f"{name} is passed {objects} at trace time"
    return accepted(tx, fn, name, args, kwargs)

functions.invoke_and_store_as_constant = constants_only
from cocodiff_xfuser.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # compiles three models
@pytest.mark.distributed  # the fake world belongs to the process
def test_traced_code_passes_only_constants_to_what_runs_at_trace_time(tmp_path):
    out = tmp_path / "graphs.json"
    done = subprocess.run(
        [sys.executable, "-c", _OBJECTS_REFUSED, "bench", "graphs", "--tiny", "--device", "cpu", "--double", "1", "--single",
         "1", "--warmup", "1", "--reps", "1", "--configs", "cocodiff,cocodiff+vfirst,cocodiff+vfirst+vmajor", "--json", str(out)],
        capture_output=True, text=True, timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]  # it failed before any configuration ran
    rows = json.loads(out.read_text())["configs"]
    assert done.returncode == 0 and all("error" not in row for row in rows), [row.get("error") for row in rows]
