"""``cocodiff bench kernels``: one rank's layer and V-Major's work on it, at a model's size."""

import json

import pytest

from cocodiff_xfuser.tools.bench import kernels
from cocodiff_xfuser.tools.cli import main


@pytest.mark.slow  # a benchmark run; make test checks the kernels' bytes against the reference (comm/test_residuals.py)
@pytest.mark.distributed  # the interpreted Triton kernels run in a process of their own
def test_reports_the_layer_and_v_major_per_degree(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--model", "tiny-flux", "--size", "64", "--ulysses", "1,2", "--device", "cpu",
                 "--reps", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["ulysses"] for r in rep["rows"]] == [1, 2] and not any(r["graph"] for r in rep["rows"])
    one, two = rep["rows"]
    assert two["tokens_local"] * 2 == one["tokens_local"] == one["tokens"] and two["heads_local"] * 2 == one["heads_local"]
    assert one["gated_tensors"] == 4  # the default scope gates Q, K, V and the output
    assert all(r["compute_s"] > 0 and r["v_major_s"] > 0 and r["v_first_window_s"] > 0 for r in rep["rows"])
    # The floor: what the work moves over the memory bandwidth (a timed copy on a CPU); half the
    # chunks cross nodes at U=2, so the encode and apply move half as much as at U=1's ring peer.
    assert all(0 < r["v_major_floor_s"] < r["v_major_s"] for r in rep["rows"])
    assert rep["memory_bps"] > 0 and rep["memory_bps_source"].startswith("measured")
    assert rep["triton_matches_reference"] is True
    assert "V-Major ms" in capsys.readouterr().out
    assert main(["bench", "kernels", "--model", "tiny-flux", "--size", "64", "--ulysses", "2", "--device", "cpu",
                 "--reps", "1", "--json", "--residual-dtype", "int4"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["v_major_s"] > row["v_major_floor_s"] > 0


def test_a_degree_that_does_not_divide_is_one_line(capsys):
    assert kernels.main(["--model", "tiny-flux", "--size", "64", "--ulysses", "3", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("cocodiff bench kernels: tiny-flux at 64px")
