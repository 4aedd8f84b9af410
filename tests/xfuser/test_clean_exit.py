"""User jobs let go of cocodiff's process groups before the interpreter tears down.

xfuser's clean-up (``RuntimeState.destroy_distributed_env``: the ``xdit`` runner's, and that of
``cocodiff verify/quality/check/demo``, which run the same runner) first releases the sub-groups
cocodiff created and the backend that holds them. Left to the interpreter's teardown, gloo ended
ranks with SIGABRT ("terminate called without an active exception") under load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from cocodiff_xfuser.comm import subgroups
from cocodiff_xfuser.xfuser import activation

RUNS = 20


def test_release_destroys_the_sub_groups_and_forgets_them(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = subgroups.member_of([[0]])
        assert dist.get_backend(group) == "gloo"
        activation.release()
        with pytest.raises(ValueError, match="not initialized"):  # destroyed
            dist.get_backend(group)
        assert subgroups.member_of([[0]]) is not group  # created anew, not a destroyed one reused
        activation.release()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUNS * 900)
def test_consecutive_xdit_jobs_exit_cleanly(tmp_path):
    xdit = Path(sys.executable).parent / "xdit"
    command = [str(xdit), "--model", "cocodiff/digits-flux", "--ulysses_degree", "4", "--sp-backend", "cocodiff",
               "--cocodiff-topology", "2x2", "--cocodiff-v-first", "--prompt", "digit 3"]
    for run in range(1, RUNS + 1):
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        output = result.stdout + result.stderr
        assert result.returncode == 0 and "terminate called" not in output, f"run {run} of {RUNS}:\n{output[-3000:]}"
