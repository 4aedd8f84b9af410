"""Any head and token count (cocodiff_xfuser/padding.py): the padded layout, and a padded job
against one process, with proof that the padded path ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cocodiff_xfuser import commstats, padding
from cocodiff_xfuser.tools import verify


def test_pad_heads_appends_zero_heads_only_when_needed():
    x = torch.randn(2, 8, 5, 4)
    assert padding.pad_heads(x, 4) is x
    padded = padding.pad_heads(x, 3)
    assert padded.shape == (2, 9, 5, 4)
    assert torch.equal(padded[:, :8], x) and not padded[:, 8:].any()


def test_keep_lists_the_real_tokens_of_every_shard():
    # 2 streams over 3 ranks: 4 text tokens padded to 6 (2 per rank), 7 image tokens padded to 9 (3 per rank).
    streams = padding.streams((4, 7), 3)
    assert streams.lengths == ((4, 6), (7, 9)) and streams.local == 5
    # Exchanged order: [text 0-1, image 0-2] [text 2-3, image 3-5] [text 4-5, image 6-8]; pads are
    # text 4-5 and image 7-8, at positions 10-11 and 13-14 of the last shard: kept 0-9 and 12.
    assert streams.kept() == ((0, 10), (12, 1))
    assert padding.streams((6, 9), 3) is None


def test_keep_keys_drops_padded_keys_while_a_padded_forward_runs():
    streams, job = padding.streams((4, 7), 3), padding.Padding()
    key = torch.arange(15.0).view(1, 1, 15, 1)
    assert job.keep_keys(key, key)[0] is key  # no padded forward running
    with job.tokens(streams):
        kept, _ = job.keep_keys(key, key)
        assert kept.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12]
        assert job.required() == "((4, 6), (7, 9)) tokens padded to the degree 3"
    assert job.running is None and job.tokens_were_padded() and job.required() is None
    job.clear_padded()
    assert not job.tokens_were_padded()
    assert padding.Padding().required() is None  # another job's: nothing of this one's


def test_padded_bytes_are_counted():
    commstats.reset_ran()
    job = padding.Padding()
    job.count(900, 8, 9)
    assert commstats.ran()["padded_bytes"] == 100
    with job.tokens(padding.streams((4, 7), 3)):
        job.count(1500, 9, 9)  # 4 of 15 tokens are padding
    assert commstats.ran()["padded_bytes"] == 500


@pytest.mark.distributed
def test_verify_ulysses_3_is_within_tolerance_of_one_process():
    """8 heads, 32 text and 256 image tokens over 3 ranks: stock cannot split any of them."""
    result = subprocess.run(
        [sys.executable, "-m", "cocodiff_xfuser.tools.cli", "verify", "--model", "tiny-flux", "--ulysses-degree", "3", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["reference"] == "single-process" and report["stock"].startswith("cannot run")
    assert report["max_abs_diff_vs_single_process"] <= verify.SINGLE_PROCESS_ATOL, report
    ran = report["ran"]["cocodiff"]
    # The padded path ran: cocodiff's processors on every layer call, zeros counted, no fall-back.
    assert ran["padded_bytes"] > 0 and ran["v_first_calls"] == 48 and ran["fallbacks"] == {}, ran
    assert "stock" not in ran["exchanges"], ran
