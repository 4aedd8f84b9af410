"""The one way to time: samples between device synchronizations, paired ratios and their bound."""

import time

import torch

from cocodiff_xfuser.comm.timing import elapsed, median_upper_bound, paired_ratios


def test_median_upper_bound_is_a_distribution_free_order_statistic():
    # n=7: only the maximum bounds the median at 95% (P(Bin(7, 1/2) <= 5) = 0.9375).
    assert median_upper_bound([0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.2]) == 1.2
    # n=9: the 8th smallest (P(Bin(9, 1/2) <= 7) = 0.98).
    assert median_upper_bound([float(i) for i in range(9)]) == 7.0
    assert median_upper_bound([2.0]) == 2.0


def test_paired_ratios_divide_sample_by_sample():
    times = {"flat": [1.0, 2.0, 4.0], "hierarchical": [0.5, 3.0, 2.0], "flat-p2p": [1.0, 1.0, 1.0]}
    assert paired_ratios(times, "flat") == {"hierarchical": [0.5, 1.5, 0.5], "flat-p2p": [1.0, 0.5, 0.25]}


def test_elapsed_is_per_call_over_a_burst():
    calls = []

    def op():
        calls.append(1)
        time.sleep(0.01)

    per_call = elapsed(op, torch.device("cpu"), burst=3)
    assert len(calls) == 3 and 0.009 <= per_call < 0.1
