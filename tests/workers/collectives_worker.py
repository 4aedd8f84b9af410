"""Distributed test cases for the exchanges of cocodiff_xfuser.comm (flat, tapa, the registry and the autotune), run under torchrun (gloo, CPU).

Usage: torchrun --nproc-per-node N collectives_worker.py --cases a,b,c [--tmpdir DIR]

All cases run in one process start (torchrun start-up dominates on small machines). A failing
check raises, which makes torchrun exit non-zero; rank 0 prints ``CASE <name> ok`` after every
case that passed on all ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dataclasses

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import faults, functional, sparse, timing, transport
from cocodiff_xfuser.comm.agreement import Disagreement, agree, any_rank, from_first
from cocodiff_xfuser.comm.autotune import ALGORITHMS, AutoAllToAll, Registry, dump_decisions, load_decisions, size_bucket
from cocodiff_xfuser.comm.flat import (
    FlatHandle, P2PHandle, flat_all_to_all, p2p_all_to_all, start_flat_all_to_all, start_p2p_all_to_all, wait_collective,
)
from cocodiff_xfuser.comm.ring import Remote, RingGather
from cocodiff_xfuser.comm.tapa import HierarchicalAllToAll, HierarchicalHandle, TwoLevelHandle
from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.ulysses_layout import heads, output_blocks, output_heads, output_stacked, output_unstacked, sequence
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.settings import Options, VMajorSettings
from cocodiff_xfuser.tools import same_bits
from cocodiff_xfuser.xfuser import fault_policy
import cocodiff_xfuser.comm.autotune as autotune

RANK = WORLD = 0
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]



def _agree_counts(active: torch.Tensor, group) -> sparse.Selection:
    """Counts that differ per rank, agreed by one all-gather (the sparse exchange carries them)."""
    counts = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    dist.all_gather_into_tensor(counts, torch.tensor([active.numel()]), group=group)
    return sparse.Selection(active, tuple(counts.tolist()))

def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"rank {RANK}: {msg}")


def rand_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs included): only bitwise comparison is meaningful."""
    gen = torch.Generator().manual_seed(seed * 1000 + RANK)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    return torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def make_groups(groups: list[list[int]]):
    """Create one process group per list (collective); return this rank's group."""
    mine = None
    for g in groups:
        pg = dist.new_group(g)
        if RANK in g:
            mine = pg
    return mine


def check_against_flat(hier: HierarchicalAllToAll, group, size: int, dtypes=DTYPES, tag: str = "") -> None:
    shapes = [(size,), (size * 3,), (size * 257,), (2 * size, 3, 5)]
    for seed, (dtype, shape) in enumerate((d, s) for d in dtypes for s in shapes):
        x = rand_bits(shape, dtype, seed)
        x_before = x.clone()
        ref = flat_all_to_all(x, group)
        check(same_bits(p2p_all_to_all(x, group), ref), f"{tag} {dtype} {shape}: flat-p2p != flat")
        if not hier.levels(group):
            check(hier.reason(x, group) is not None, f"{tag}: a group without a plan must be refused")
            continue
        got = hier(x, group)
        check(same_bits(ref, got), f"{tag} {dtype} {shape}: hierarchical != flat")
        h = hier.start(x, group)
        h.advance()
        check(same_bits(h.wait(), ref), f"{tag} {dtype} {shape}: async != flat")
        check(same_bits(x, x_before), f"{tag} {dtype} {shape}: input modified")


def case_semantics() -> None:
    """The flat exchange itself: out[s] on rank r is chunk r of rank s."""
    c = 5
    x = torch.tensor([RANK * 1000 + d * 10 + i for d in range(WORLD) for i in range(c)], dtype=torch.float32)
    want = torch.tensor([s * 1000 + RANK * 10 + i for s in range(WORLD) for i in range(c)], dtype=torch.float32)
    check(torch.equal(flat_all_to_all(x), want), "flat all-to-all semantics")
    topo = {4: "2x2", 8: "2x2x2"}[WORLD]
    check(torch.equal(HierarchicalAllToAll(Topology.parse(topo), [range(WORLD)])(x), want), "hierarchical semantics")


def case_layouts() -> None:
    """World-wide Ulysses group on every topology of this world size."""
    expected = {4: {"2x2": (2, 2)}, 8: {"2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}}[WORLD]
    for spec, levels in expected.items():
        hier = HierarchicalAllToAll(Topology.parse(spec), [list(range(WORLD))])
        check(hier.levels() == levels, f"{spec}: levels {hier.levels()} != {levels}")
        check_against_flat(hier, dist.group.WORLD, WORLD, tag=spec)


def _topologies() -> dict[str, tuple[int, ...]]:
    return {4: {"2x2": (2, 2)}, 8: {"2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}}[WORLD]


def case_pipelined() -> None:
    """TAPA in 2 and 4 parts: bitwise the flat exchange in every mode, several in flight, and no
    more local copies than one part on gloo (the parts write straight into the output)."""
    for spec in _topologies():
        hier = HierarchicalAllToAll(Topology.parse(spec), [list(range(WORLD))])
        for parts in (2, 4):
            for seed, dtype in enumerate(DTYPES):
                x = rand_bits((WORLD * parts * 6,), dtype, 900 + seed)
                x_before, ref = x.clone(), flat_all_to_all(x)
                check(same_bits(hier(x, parts=parts), ref), f"{spec} x{parts} {dtype}: != flat")
                h = hier.start(x, parts=parts)
                h.advance()
                check(same_bits(h.wait(), ref), f"{spec} x{parts} {dtype}: advanced != flat")
                check(same_bits(x, x_before), f"{spec} x{parts} {dtype}: input modified")
            xs = [rand_bits((WORLD * parts * 64,), torch.float32, 950 + i) for i in range(3)]
            handles = [hier.start(xs[0], parts=parts), hier.start(xs[1]), hier.start(xs[2], parts=parts)]
            for i in (2, 0, 1):  # waited out of start order
                check(same_bits(handles[i].wait(), flat_all_to_all(xs[i])), f"{spec} x{parts}: in flight #{i}")
            copied = []
            for n in (1, parts):
                before = commstats.ran()["copied_bytes"]
                hier(xs[0], parts=n)
                copied.append(commstats.ran()["copied_bytes"] - before)
            check(copied[0] == copied[1], f"{spec} x{parts}: pipelining copied {copied[1]} bytes, one part {copied[0]}")
        check(hier.reason(torch.zeros(WORLD * 3), None, parts=2) is not None, f"{spec}: indivisible parts refused")
    # One program order: with the audit on, every rank launches the same sequence, whatever
    # completes first (several pipelined exchanges in flight, advanced and waited out of order).
    hier = HierarchicalAllToAll(Topology.parse(next(iter(_topologies()))), [list(range(WORLD))])
    saved, transport._launches = transport._launches, []
    try:
        xs = [rand_bits((WORLD * 4 * 256,), torch.float32, 990 + i) for i in range(3)]
        handles = [hier.start(xs[0], parts=4), hier.start(xs[1], parts=2), hier.start(xs[2])]
        if RANK % 2:
            time.sleep(0.05)  # completion timing differs between ranks; the launches must not
        for h in handles:
            h.advance()
        for i in (1, 2, 0):
            check(same_bits(handles[i].wait(), flat_all_to_all(xs[i])), f"audited pipeline #{i}")
        sequences = [None] * WORLD
        dist.all_gather_object(sequences, transport.launches())
        check(len(sequences[0]) > 10 and all(q == sequences[0] for q in sequences), "ranks launched in different orders")
    finally:
        transport._launches = saved


def case_pxn() -> None:
    """The PXN-like flat exchange (``flat-pxn``): bitwise flat's on every node x local layout of this
    world size, several in flight with different completion timing, only the own chunk copied, the
    same launches on every rank; refused with a reason where the group has no node x local split."""
    runs = {4: [("2x2", [list(range(4))])], 8: [("2x4", [list(range(8))]), ("4x2", [list(range(8))]),
                                                 ("2x2x2", [[0, 1, 4, 5], [2, 3, 6, 7]])]}[WORLD]  # last: node x tile
    for spec, groups in runs:
        group = make_groups(groups) if len(groups) > 1 else dist.group.WORLD
        hier = HierarchicalAllToAll(Topology.parse(spec), groups)
        pxn = Registry(hier)["flat-pxn"]
        size = len(groups[0])
        # A 4-, a 2- and a 1-byte type (fp8 travels as integers); flat, long, multi-dim and empty chunks.
        for seed, (dtype, shape) in enumerate((d, s) for d in DTYPES[::2] for s in [(size,), (size * 257,), (2 * size, 3, 5), (0, 4)]):
            x = rand_bits(shape, dtype, 1100 + seed)
            check(pxn.reason(x, group) is None, f"{spec}: flat-pxn refused {shape}: {pxn.reason(x, group)}")
            check(same_bits(pxn.run(x, group), flat_all_to_all(x, group)), f"{spec} {dtype} {shape}: flat-pxn != flat")
        x = rand_bits((size * 64,), torch.float32, 1190)
        x_before, ref = x.clone(), flat_all_to_all(x, group)
        h = pxn.start(x, group)
        check(h.advance(), "flat-pxn: every phase launched after one advance")
        check(same_bits(h.wait(), ref) and same_bits(x, x_before), f"{spec}: advanced != flat, or input modified")
        before = commstats.ran()["copied_bytes"]
        pxn.run(x, group)
        copied = commstats.ran()["copied_bytes"] - before
        check(copied == x.numel() * 4 // size, f"{spec}: flat-pxn copied {copied} bytes, not only the own chunk")
        check(pxn.reason(torch.zeros(size + 1), group) is not None, f"{spec}: an indivisible input must be refused")
    # One program order: every rank launches the same sequence whatever completes first (several
    # exchanges in flight, advanced and waited out of start order, some ranks late).
    hier = HierarchicalAllToAll(Topology.parse(runs[0][0]), [list(range(WORLD))])
    registry = Registry(hier)
    saved, transport._launches = transport._launches, []
    try:
        xs = [rand_bits((WORLD * 512,), torch.float32, 1200 + i) for i in range(3)]
        handles = [registry["flat-pxn"].start(xs[0], None), hier.start(xs[1]), registry["flat-pxn"].start(xs[2], None)]
        if RANK % 2:
            time.sleep(0.05)  # completion timing differs between ranks; the launches must not
        handles[2].advance()
        for i in (2, 1, 0):
            check(same_bits(handles[i].wait(), flat_all_to_all(xs[i])), f"audited flat-pxn #{i}")
        sequences = [None] * WORLD
        dist.all_gather_object(sequences, transport.launches())
        check(len(sequences[0]) >= 8 and all(q == sequences[0] for q in sequences), "ranks launched in different orders")
        check(("level 0 of " + str(hier.levels()), "relayed chunks") in sequences[0], f"the relay runs on the rails: {sequences[0]}")
    finally:
        transport._launches = saved
    # Forced where it cannot run: flat, with the reason, counted (as every algorithm).
    refused = {4: [("2x2", [[0, 1], [2, 3]], "fewer than two"), ("2x2", [[0, 2], [1, 3]], "fewer than two")],
               8: [("2x2x2", [list(range(8))], "3 levels"), ("2x2x2", [[0, 1, 2, 3], [4, 5, 6, 7]], "inside one node")]}[WORLD]
    for spec, groups, why in refused:
        group = make_groups(groups) if len(groups) > 1 else dist.group.WORLD
        registry = Registry(HierarchicalAllToAll(Topology.parse(spec), groups))
        x = torch.zeros(len(groups[0]) * 4)
        reason = registry.reason("flat-pxn", x, group) or ""
        check(why in reason and "flat-pxn" not in registry.eligible(x, group), f"{spec} {groups}: reason {reason!r}")
        fallbacks = sum(commstats.ran()["fallbacks"].values())
        check(AutoAllToAll(registry, a2a="flat-pxn").choose(x, group) == "flat", f"{spec} {groups}: forced flat-pxn must fall back")
        check(sum(commstats.ran()["fallbacks"].values()) == fallbacks + 1, "the fall-back is counted")
    check(Registry(None).reason("flat-pxn", torch.zeros(WORLD), None) == "no topology levels to exchange over", "no topology")


def case_ulysses_layout() -> None:
    """Head blocks written once in the first phase's order: the exchange equals xfuser's layout
    (stack, permute, contiguous) through flat, read back as xfuser reads it; the output's layouts
    are xfuser's ``_ft_c_output_all_to_all``'s and V-Major's destination-major one, each a round trip."""
    b, h, s, d = 2, WORLD * 3, 5, 4
    q, k = rand_bits((b, h, s, d), torch.bfloat16, 970), rand_bits((b, h, s, d), torch.bfloat16, 971)
    stacked = torch.stack((q, k)).view(2, b, WORLD, 3, s, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    canonical = heads((q, k), (WORLD,), (0,))
    check(same_bits(canonical, stacked), "destination-major layout != xfuser's")
    ref = flat_all_to_all(stacked.view(-1)).view(stacked.shape)
    want = ref.permute(1, 2, 3, 0, 4, 5).reshape(2, b, 3, WORLD * s, d)
    check(all(same_bits(g, w) for g, w in zip(sequence(ref), want)), "sequence layout")
    out = rand_bits((b, 3, WORLD * s, d), torch.bfloat16, 972)  # head-sharded, as attention returns it
    blocks = output_blocks(out)
    check(same_bits(blocks, out.permute(2, 0, 1, 3).contiguous()), "output blocks != xfuser's")
    back = flat_all_to_all(blocks.view(-1)).view(blocks.shape)
    xfuser = back.reshape(WORLD, s, b, 3, d).permute(2, 0, 3, 1, 4).reshape(b, WORLD * 3, s, d)
    check(same_bits(output_heads(back, WORLD, WORLD * 3), xfuser), "output read back != xfuser's")
    check(same_bits(output_heads(back, WORLD, WORLD * 3 - 1), xfuser[:, :-1]), "padded output heads kept")
    unstacked = output_unstacked(flat_all_to_all(output_stacked(out, WORLD).view(-1)).view(WORLD, 1, b, 3, s, d), WORLD * 3)
    check(same_bits(unstacked, xfuser), "V-Major's output layout != xfuser's")
    nbytes = stacked.numel() * stacked.element_size()
    for spec, levels in _topologies().items():
        hier = HierarchicalAllToAll(Topology.parse(spec), [list(range(WORLD))])
        canonical, inner_first = tuple(range(len(levels))), (len(levels) - 1, *range(len(levels) - 1))
        order_ = hier.input_layout()
        check(order_ == (canonical if len(levels) == 2 else inner_first), f"{spec}: {order_}")
        data = heads((q, k), levels, order_)
        got = hier.start(data.view(-1), layout=order_).wait()
        check(same_bits(got.view(ref.shape), ref), f"{spec}: layout {order_} != flat")
        copied = []
        for x, given in ((data, order_), (stacked, None)):
            before = commstats.ran()["copied_bytes"]
            hier.start(x.view(-1), layout=given).wait()
            copied.append(commstats.ran()["copied_bytes"] - before)
        if order_ != canonical:
            check(copied[0] < copied[1], f"{spec}: the layout {order_} saves the first re-blocking: {copied}")
        if len(levels) == 2:  # chunks sent in place: only the own chunk is copied
            check(copied == [nbytes // WORLD] * 2, f"{spec}: two-level copies {copied}, own chunk {nbytes // WORLD}")


def case_subgroups() -> None:
    """Ulysses groups that are sub-groups of the world (ring / CFG degrees > 1)."""
    layouts = {
        4: [
            ("2x2", [[0, 1], [2, 3]], ()),  # ulysses 2 x ring 2: inside a node, one level
            ("2x2", [[0, 2], [1, 3]], ()),  # strided ulysses: across nodes, one level
        ],
        8: [
            ("4x2", [[0, 1, 2, 3], [4, 5, 6, 7]], (2, 2)),  # ulysses 4 x ring 2, or cfg 2 x ulysses 4
            ("2x2x2", [[0, 2, 4, 6], [1, 3, 5, 7]], (2, 2)),  # strided: spans node and gpu
            ("2x2x2", [[0, 1, 4, 5], [2, 3, 6, 7]], (2, 2)),  # spans node and tile
            ("4x2", [[0, 2, 4, 6], [1, 3, 5, 7]], ()),  # one level (4 nodes)
            ("2x2x2", [[0, 1], [2, 3], [4, 5], [6, 7]], ()),  # ulysses 2: tiles only
            ("2x4", [[0, 1, 3, 6], [2, 4, 5, 7]], ()),  # irregular: flat fallback
        ],
    }[WORLD]
    for spec, groups, levels in layouts:
        group = make_groups(groups)
        hier = HierarchicalAllToAll(Topology.parse(spec), groups)
        check(hier.levels(group) == levels, f"{spec} {groups}: levels {hier.levels(group)} != {levels}")
        check(hier.levels() == (), f"{spec} {groups}: world group must have no plan")
        size = len(next(g for g in groups if RANK in g))
        check_against_flat(hier, group, size, [torch.float32, torch.bfloat16], tag=f"{spec} {groups}")
        if not levels:
            try:
                hier.start(torch.zeros(size), group)
                check(False, "a group without a plan must not start a hierarchical exchange")
            except ValueError:
                pass


def case_async() -> None:
    """Several exchanges in flight, advanced and waited out of start order, the same program on every
    rank but different completion timing: the results are bitwise flat's."""
    spec = {4: "2x2", 8: "2x2x2"}[WORLD]
    topo = Topology.parse(spec)
    hier = HierarchicalAllToAll(topo, [list(range(WORLD))])
    n = WORLD * 4096
    xs = [rand_bits((n,), torch.float32, 100 + i) for i in range(5)]
    refs = [flat_all_to_all(x) for x in xs]
    slow = topo.coords(RANK)[-2] == 1  # these ranks reach every program point late
    a = hier.start(xs[0])
    check(isinstance(a, TwoLevelHandle if WORLD == 4 else HierarchicalHandle), f"{spec}: handle {type(a).__name__}")
    if slow:
        time.sleep(0.05)
    a.advance()
    b = hier.start(xs[1])
    c = start_flat_all_to_all(xs[2])
    e = hier.start(xs[4], parts=2)
    d = hier(xs[3])  # blocking call while others are in flight (as the autotune would do)
    b.advance()
    got_b = b.wait()  # waited before a, which started first
    got = [a.wait(), got_b, c.wait(), d, e.wait()]
    for i, (g, r) in enumerate(zip(got, refs)):
        check(same_bits(g, r), f"in-flight exchange {i} differs from flat")
    check(all(h.advance() for h in (a, b, c, e)), "advance after wait")
    check(a.wait() is got[0], "wait must be idempotent")
    # Results must not alias reusable buffers: later exchanges must not change them. A fresh
    # plan starts with an empty buffer pool, which makes reuse patterns deterministic.
    fresh = HierarchicalAllToAll(topo, [list(range(WORLD))])
    got = []
    for i in range(6):
        x = rand_bits((n,), torch.float32, 200 + i)
        got.append(fresh.start(x).wait() if i % 2 else fresh(x))
    kept = [g.clone() for g in got]
    for i in range(6):
        fresh.start(rand_bits((n,), torch.float32, 300 + i)).wait()
        fresh(rand_bits((n,), torch.float32, 400 + i))
    for g, k in zip(got, kept):
        check(same_bits(g, k), "a returned tensor was overwritten by a later exchange")


def case_uneven() -> None:
    """Uneven splits: the flat exchange; the others refuse what they cannot exchange (no silent flat)."""
    ins = [(RANK + d) % 3 + 1 for d in range(WORLD)]
    outs = [(s + RANK) % 3 + 1 for s in range(WORLD)]
    x = torch.tensor([[RANK * 100 + d * 10 + i] * 2 for d in range(WORLD) for i in range(ins[d])], dtype=torch.float32)
    want = torch.tensor([[s * 100 + RANK * 10 + i] * 2 for s in range(WORLD) for i in range(outs[s])], dtype=torch.float32)
    check(torch.equal(flat_all_to_all(x, None, outs, ins), want), "uneven flat")
    hier = HierarchicalAllToAll(Topology.parse({4: "2x2", 8: "2x2x2"}[WORLD]), [list(range(WORLD))])
    registry = Registry(hier)
    odd = torch.zeros(WORLD + 1)
    for name in ("flat-p2p", "hierarchical"):
        check(registry.reason(name, odd, None) is not None, f"{name} must refuse an indivisible input")
        try:
            registry[name].start(odd, None)
            check(False, f"{name} started an exchange it cannot do")
        except ValueError:
            pass
    check(registry.eligible(odd, None) == ("flat",), f"eligible {registry.eligible(odd, None)}")


def case_p2p() -> None:
    """The fair flat exchange (one batch): bitwise all_to_all_single for every dtype and layout."""
    check(transport.backend_name() == "gloo", f"world backend {transport.backend_name()!r} should be gloo")
    check(transport.backend_name(None, "cuda") == "gloo", "device lookup in 'cpu:gloo,cuda:gloo'")
    for dtype in DTYPES:
        for numel in (WORLD, WORLD * 7, WORLD * 65536):
            x = rand_bits((numel,), dtype, 7).view(-1)
            ref = torch.empty_like(x.view(torch.uint8) if dtype.itemsize == 1 else x)
            dist.all_to_all_single(ref, x.view(ref.dtype))
            out = torch.empty_like(ref)
            with transport.tracing() as trace:
                transport.exchange_chunks(out, x.view(ref.dtype), dist.group.WORLD, "test").wait()
            check(same_bits(out, ref), f"exchange_chunks {dtype} {numel} != all_to_all_single")
            check(len(trace) == 1 and len(trace[0][1]) == 2 * (WORLD - 1), f"one batch of {2 * (WORLD - 1)} operations: {trace}")
    try:
        transport.exchange_chunks(torch.zeros(WORLD + 1), torch.zeros(WORLD + 1), dist.group.WORLD, "test")
        check(False, "indivisible size accepted")
    except ValueError:
        pass
    # Handles: every dtype and layout, multi-dim, non-contiguous input, empty chunks.
    shapes = [(WORLD,), (WORLD * 3,), (WORLD * 257,), (2 * WORLD, 3, 5), (0, 4)]
    for seed, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in shapes):
        x = rand_bits(shape, dtype, 50 + seed)
        x_before = x.clone()
        ref = flat_all_to_all(x)
        handle = start_p2p_all_to_all(x)
        check(isinstance(handle, P2PHandle), "equal splits use the p2p handle")
        check(handle.advance(), "flat-p2p has a single phase: advance is True at once")
        got = handle.wait()
        check(same_bits(got, ref), f"flat-p2p {dtype} {shape} != flat")
        check(handle.wait() is got, "wait must be idempotent")
        check(same_bits(x, x_before), f"flat-p2p {dtype} {shape}: input modified")
    xt = rand_bits((8, WORLD * 2), torch.bfloat16, 9).t()  # non-contiguous, dim 0 divisible
    check(same_bits(p2p_all_to_all(xt), flat_all_to_all(xt)), "flat-p2p non-contiguous input")
    start_flat_all_to_all(torch.zeros(WORLD)).wait()  # keep every rank's collective sequence equal


def case_p2p_async() -> None:
    """Batches of several exchanges in flight on the same groups and sizes (flat-p2p, two- and
    k-level, pipelined, collectives), waited out of order: messages match by issue order alone."""
    spec = {4: "2x2", 8: "2x2x2"}[WORLD]
    topo = Topology.parse(spec)
    hier = HierarchicalAllToAll(topo, [list(range(WORLD))])
    n = WORLD * 8192
    xs = [rand_bits((n,), torch.bfloat16, 500 + i) for i in range(7)]
    refs = [flat_all_to_all(x) for x in xs]
    a = hier.start(xs[0])
    b = start_p2p_all_to_all(xs[1])
    c = hier.start(xs[2])
    a.advance()
    d = start_p2p_all_to_all(xs[3])  # same size and group as b: matched in issue order
    e = hier.start(xs[4], parts=4)
    f = hier(xs[5])  # blocking while others are in flight
    g = start_flat_all_to_all(xs[6])
    c.advance()
    got_c = c.wait()
    got = [a.wait(), b.wait(), got_c, d.wait(), e.wait(), f, g.wait()]
    for i, (gt, r) in enumerate(zip(got, refs)):
        check(same_bits(gt, r), f"in-flight exchange {i} differs from flat")
    # Results never alias pool buffers, and inputs may be reused once waited.
    fresh = HierarchicalAllToAll(topo, [list(range(WORLD))])
    x = rand_bits((n,), torch.float32, 600)
    kept, results = [], []
    for i in range(6):
        y = (fresh.start(x) if i % 2 else start_p2p_all_to_all(x)).wait()
        results.append(y)
        kept.append(y.clone())
        x.copy_(rand_bits((n,), torch.float32, 601 + i))  # reuse the input buffer
    for i in range(4):
        fresh(rand_bits((n,), torch.float32, 700 + i))
        fresh.start(rand_bits((n,), torch.float32, 710 + i)).wait()
    for y, k in zip(results, kept):
        check(same_bits(y, k), "a returned tensor was overwritten by a later exchange")
    # A flat-p2p handle dropped without wait() still completes and does not steal the next
    # exchange's messages on the same pairs.
    start_p2p_all_to_all(rand_bits((n,), torch.float32, 800))
    x = rand_bits((n,), torch.float32, 801)
    check(same_bits(p2p_all_to_all(x), flat_all_to_all(x)), "exchange after a dropped handle")


class _CountingTimer:
    """Wraps timing.paired (what the autotune measures with) to count measurements."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = timing.paired

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._orig(*args, **kwargs)


def _slowed(hier: HierarchicalAllToAll, **slow_rank: int) -> Registry:
    """A registry whose blocking exchanges are slow on one rank each (``flat_p2p=2``: flat-p2p on rank 2)."""
    registry = Registry(hier)
    for key, rank in slow_rank.items():
        name = key.replace("_", "-")
        run = registry[name].run

        def slow(x, group=None, run=run, rank=rank):
            if RANK == rank:
                time.sleep(0.01)  # several times a small exchange here, flat-pxn and hierarchical (2+ phases) included
            return run(x, group)

        registry._entries[name] = dataclasses.replace(registry[name], run=slow)
    return registry


class _LogCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _all_counts(k: int) -> list[int]:
    """``k`` of every rank, in rank order (collective over the world)."""
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, k)
    return everyone


def _agreed(value) -> bool:
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, value)
    return all(v == everyone[0] for v in everyone)


def case_autotune(tmpdir: str) -> None:
    hier = HierarchicalAllToAll(Topology.parse("2x2"), [list(range(WORLD))])
    timer = _CountingTimer()
    timing.paired = timer
    log = _LogCounter()
    logger = logging.getLogger("cocodiff_xfuser")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        xs = [torch.randn(WORLD * 4096), torch.randn(WORLD * 4000), torch.randn(WORLD * 65536)]
        tuner = AutoAllToAll(Registry(hier))
        choices = [tuner.choose(x) for x in xs]
        check(timer.calls == 2, f"first two sizes share a bucket: expected 2 measurements, got {timer.calls}")
        check(_agreed([(k, d.algorithm) for k, d in sorted(tuner.decisions.items())]), "ranks disagree")
        # (xs[1] again would be its bucket's 4th use: the run-time re-check, tested below.)
        check([tuner.choose(x) for x in xs[::2]] == choices[::2] and timer.calls == 2, "cached decision re-measured")
        check(sum("bucket" in m for m in log.messages) == 2, f"expected 2 decision logs: {log.messages}")
        for x in xs:
            ref = flat_all_to_all(x)
            chosen = tuner.registry[tuner.choose(x)]
            check(same_bits(chosen.run(x, None), ref) and same_bits(chosen.start(x, None).wait(), ref), "tuned exchange != flat")

        # Every candidate of a gloo group with a plan is measured; the cache keeps all timings.
        eligible = tuner.registry.eligible(xs[0], None)
        check(eligible == ("flat", "flat-p2p", "flat-pxn", "hierarchical"), f"candidates {eligible}")
        for d in tuner.decisions.values():
            check(d.algorithm in ALGORITHMS, f"decision {d}")
            check(all(t is not None and t > 0 for t in (d.flat_s, d.flat_p2p_s, d.flat_pxn_s, d.hierarchical_s)), f"timings {d}")

        # MAX over ranks: one slow rank decides for everyone.
        check(AutoAllToAll(_slowed(hier, hierarchical=0)).choose(xs[0]) != "hierarchical", "hierarchical slow on rank 0: no rank may pick it")
        pick = AutoAllToAll(_slowed(hier, flat=1, flat_p2p=2, flat_pxn=3)).choose(xs[0])
        check(pick == "hierarchical", f"flat/p2p/pxn slow on ranks 1/2/3: all must pick hierarchical, got {pick}")
        pick = AutoAllToAll(_slowed(hier, flat=1, flat_pxn=0, hierarchical=3)).choose(xs[0])
        check(pick == "flat-p2p", f"flat slow on rank 1, flat-pxn on 0, hierarchical on 3: all must pick flat-p2p, got {pick}")
        pick = AutoAllToAll(_slowed(hier, flat=1, flat_p2p=2, hierarchical=3)).choose(xs[0])
        check(pick == "flat-pxn", f"all but flat-pxn slow: all must pick flat-pxn, got {pick}")

        # gloo's fair flat exchange is flat-p2p: every measured decision was timed against it.
        check(all(d.reference == "flat-p2p" for d in tuner.decisions.values()), f"references {tuner.decisions}")

        # The run-time re-check, at the same use on every rank: a choice that turned slower than
        # its reference reverts to it (counted), one that did not stays.
        bucket = {"group": list(range(WORLD)), "bucket_bytes": size_bucket(xs[0].numel() * 4), "algorithm": "hierarchical",
                  "reference": "flat-p2p"}
        for slow_rank, expect in ((dict(hierarchical=1), "flat-p2p"), (dict(flat_p2p=2), "hierarchical")):
            tuner2 = AutoAllToAll(_slowed(hier, **slow_rank))
            load_decisions(tuner2, {"decisions": [bucket]})
            reverted = commstats.ran()["reverted"].get("hierarchical", 0)
            picks = [tuner2.choose(xs[0]) for _ in range(autotune.RECHECK_USES - 1)]
            check(tuner2.measures(xs[0]) and picks == ["hierarchical"] * len(picks), f"before the re-check: {picks}")
            check(not tuner2.settled(xs[0]), "a choice awaiting its re-check is not final")
            picks = [tuner2.choose(xs[0]) for _ in range(3)]
            check(picks == [expect] * 3 and _agreed(picks), f"re-check with {slow_rank}: {picks}, expected {expect}")
            check(not tuner2.measures(xs[0]) and tuner2.settled(xs[0]), "a bucket is re-checked once, then final")
            count = commstats.ran()["reverted"].get("hierarchical", 0) - reverted
            check(count == (expect == "flat-p2p"), f"reverts counted: {count}")
            d = next(iter(tuner2.decisions.values()))
            check(d.reverted_from == ("hierarchical" if expect == "flat-p2p" else None), f"decision {d}")

        # Overrides and single-candidate groups never measure.
        calls = timer.calls
        registry = Registry(hier)
        check(AutoAllToAll(registry, a2a="flat").choose(xs[0]) == "flat", "flat override")
        check(AutoAllToAll(registry, a2a="hierarchical").choose(xs[0]) == "hierarchical", "hierarchical override")
        check(AutoAllToAll(registry, a2a="flat-p2p").choose(xs[0]) == "flat-p2p", "flat-p2p override")
        check(AutoAllToAll(registry, a2a="flat-pxn").choose(xs[0]) == "flat-pxn", "flat-pxn override")
        forced = AutoAllToAll(registry, a2a="flat-p2p")
        ref = flat_all_to_all(xs[0])
        p2p = forced.registry[forced.choose(xs[0])]
        check(isinstance(p2p.start(xs[0], None), P2PHandle), "flat-p2p override must start a p2p handle")
        check(same_bits(p2p.run(xs[0], None), ref) and same_bits(p2p.start(xs[0], None).wait(), ref), "flat-p2p override != flat")
        flat = AutoAllToAll(registry, a2a="flat")
        check(isinstance(flat.registry[flat.choose(xs[0])].start(xs[0], None), FlatHandle), "flat override: stock handle")
        pairs = [[0, 1], [2, 3]]
        pair = make_groups(pairs)
        one_level = AutoAllToAll(Registry(HierarchicalAllToAll(Topology.parse("2x2"), pairs)), a2a="hierarchical")
        check(one_level.choose(xs[0], pair) == "flat", "a one-level group must use flat")
        fallbacks = commstats.ran()["fallbacks"]
        check(sum(fallbacks.values()) == 1, f"the forced fall-back is counted: {fallbacks}")
        no_tapa = AutoAllToAll(Registry(None), a2a="hierarchical")
        check(no_tapa.choose(xs[0]) == "flat" and sum(commstats.ran()["fallbacks"].values()) == 2, "no plan: flat, counted")
        check(not no_tapa.settled(xs[0]) and forced.settled(xs[0]), "a forced fall-back counts on every use: never final")
        check(AutoAllToAll(Registry(None), a2a="flat-p2p").choose(xs[0]) == "flat-p2p", "no plan, gloo: flat-p2p")
        check(timer.calls == calls, "overrides must not measure")
        # auto without a plan on gloo: flat vs flat-p2p only.
        no_plan = AutoAllToAll(Registry(None))
        check(no_plan.registry.eligible(xs[0], None) == ("flat", "flat-p2p"), "no plan: two candidates")
        check(no_plan.choose(xs[0]) in ("flat", "flat-p2p") and timer.calls == calls + 1, "no plan: one measurement")
        d = next(iter(no_plan.decisions.values()))
        check(d.hierarchical_s is None and d.flat_p2p_s > 0, f"no plan: decision {d}")

        # Decisions written before flat-p2p existed (and unknown future fields) still load.
        old = {"version": 1, "topology": "2x2", "decisions": [
            {"group": list(range(WORLD)), "bucket_bytes": 1 << 30, "algorithm": "hierarchical",
             "flat_s": 0.2, "hierarchical_s": 0.1, "some_future_field": 1}]}
        legacy = AutoAllToAll(registry)
        load_decisions(legacy, old)
        legacy_d = legacy.decisions[(tuple(range(WORLD)), 1 << 30, False)]
        check(legacy_d.flat_p2p_s is None and legacy_d.reference == "flat", f"legacy decision {legacy_d}")
        try:
            load_decisions(AutoAllToAll(registry), {"decisions": [dict(old["decisions"][0], algorithm="fast")]})
            check(False, "invalid algorithm accepted")
        except ValueError:
            pass
        # An unknown --cocodiff-a2a is refused once, by the settings (tests/xfuser/test_hooks.py).

        # JSON round trip: rank 0 writes, every rank imports, nothing is re-measured (the decisions
        # as they stand after the re-check of xs[0]'s bucket in the loop above).
        final = [tuner.choose(x) for x in xs]
        path = os.path.join(tmpdir, "a2a_decisions.json")
        if RANK == 0:
            with open(path, "w") as f:
                json.dump(dump_decisions(tuner), f)
        dist.barrier()
        loaded = AutoAllToAll(registry)
        with open(path) as f:
            load_decisions(loaded, json.load(f))
        check(loaded.decisions == tuner.decisions, "JSON round trip changed decisions")
        check(dump_decisions(loaded) == json.loads(json.dumps(dump_decisions(tuner))), "dump_decisions round trip")
        calls = timer.calls
        check([loaded.choose(x) for x in xs] == final and timer.calls == calls, "imported decisions re-measured")
        if RANK == 0:
            print("DECISIONS " + json.dumps(dump_decisions(tuner)), flush=True)
    finally:
        timing.paired = timer._orig
        logger.removeHandler(log)


def case_agreement() -> None:
    """Rank-local facts: the same everywhere passes; one rank differing is an error on every rank
    that names it; from_first hands rank 0's value to all."""
    check(agree("same", "a fact") == "same", "agreement on equal values")
    odd = WORLD - 1
    try:
        agree("b" if RANK == odd else "a", "a fact")
        check(False, "a disagreement was accepted")
    except Disagreement as e:
        check(f"rank {odd} has 'b'" in str(e), f"the error must name rank {odd}: {e}")
    check(from_first(RANK * 10) == 0, "from_first gives rank 0's value")
    check(any_rank(RANK == odd, None, torch.device("cpu")) and not any_rank(False, None, torch.device("cpu")), "any_rank")


def _every_mask(mask: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``[s]`` mask (what the test compares against; the exchange never gathers them)."""
    out = torch.empty(dist.get_world_size(group) * mask.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(out, mask.to(torch.uint8), group=group)
    return out.view(-1, mask.numel()).bool()


def _sparse_expected(x: torch.Tensor, prev: torch.Tensor, masks: torch.Tensor, level: sparse.SlowLevel, group) -> torch.Tensor:
    """What the sparse exchange must give: the exact result, except rows from other nodes that
    their sender left out, which keep the previous result."""
    w = x.shape[0]
    full = flat_all_to_all(x.flatten(), group).view(x.shape)
    keep = torch.stack([~masks[j] if not level.fast(j) else torch.zeros_like(masks[j]) for j in range(w)])
    return torch.where(keep[:, None, :, None], prev, full)


#: The sparse exchange's routings: one phase as a point-to-point batch or as the backend's
#: all-to-all with split sizes, and two phases composed with TAPA.
ROUTINGS = ((False, False), (False, True), (True, False))


def case_sparse() -> None:
    """V-Major's sparse exchange: one- and two-phase, uneven counts (empty and full included, agreed)
    and fixed counts (rows in any order), several in flight, bitwise the exact exchange where every
    row is active; same launches on every rank."""
    layouts = {4: ["2x2", "4x1"], 8: ["2x4", "4x2", "2x2x2"]}[WORLD]
    groups = [list(range(WORLD))]
    for spec in layouts:
        topo = Topology.parse(spec)
        level = sparse.build_slow_levels(groups, topo.nodes_and_lanes)[tuple(range(WORLD))]
        check(level.exists and level.regular, f"{spec}: the world spans nodes evenly")
        group = dist.group.WORLD
        # (1, 7, 3) in bf16: relayed pieces start off the alignment of their indices and rows.
        for seed, (p, s, d, dtype) in enumerate([(3, 16, 4, torch.float32), (1, 9, 2, torch.float32),
                                                 (2, 40, 8, torch.float32), (1, 7, 3, torch.bfloat16)]):
            x = torch.randn(WORLD, p, s, d, generator=torch.Generator().manual_seed(seed * 100 + RANK)).to(dtype)
            prev = torch.randn(WORLD, p, s, d, generator=torch.Generator().manual_seed(seed * 100 + 50 + RANK)).to(dtype)
            # Rank 0 sends nothing over slow links, rank 1 everything, the others a random share.
            mask = torch.rand(s, generator=torch.Generator().manual_seed(seed * 7 + RANK)) < 0.4
            mask = torch.zeros(s, dtype=torch.bool) if RANK == 0 else torch.ones(s, dtype=torch.bool) if RANK == 1 else mask
            sel = _agree_counts(mask.nonzero().flatten(), group)
            masks = _every_mask(mask, group)
            check(list(sel.counts) == masks.sum(1).tolist(), f"{spec}: the agreed counts")
            want = _sparse_expected(x, prev, masks, level, group)
            rows = x.index_select(2, sel.active)
            for two_phase, collective in ROUTINGS:
                into = prev.clone()
                handle = sparse.SparseHandle(x, rows, sel, level, group, two_phase, into, collective=collective, learn_peers=True)
                got, peers = handle.wait(), handle.peers
                check(got is into and same_bits(got, want), f"{spec} {p, s, d} two_phase={two_phase} collective={collective}: wrong rows")
                remote = [j for j in range(WORLD) if not level.fast(j)]
                check(sorted(peers) == remote and all(same_bits(peers[j], masks[j].nonzero().flatten()) for j in remote),
                      f"{spec} two_phase={two_phase} collective={collective}: the senders' indices recorded")
                # Chosen by the receiver (the output exchange): each rank on another node gets the
                # rows at its own active tokens, as the indices it sent; no index travels.
                by_receiver = {j: x[j].index_select(1, peers[j]) for j in remote}
                got = sparse.SparseHandle(x, by_receiver, sel, level, group, two_phase, prev.clone(), collective=collective,
                                          by_receiver=True).wait()
                mine = masks[RANK].expand(WORLD, s)
                check(same_bits(got, _sparse_expected(x, prev, mine, level, group)),
                      f"{spec} {p, s, d} two_phase={two_phase} collective={collective}: rows chosen by the receiver")
            # Fixed counts (what top-k, schedule and budget send): no agreement, rows ascending.
            k = (s + 2) // 3
            active = torch.randperm(s, generator=torch.Generator().manual_seed(seed * 11 + RANK))[:k].sort().values  # ascending
            fixed = sparse.Selection.fixed(active, WORLD)
            picked = torch.zeros(s, dtype=torch.bool)
            picked[active] = True
            want_fixed = _sparse_expected(x, prev, _every_mask(picked, group), level, group)
            for two_phase, collective in ROUTINGS:
                got = sparse.SparseHandle(x, x.index_select(2, active), fixed, level, group, two_phase, prev.clone(), collective=collective).wait()
                check(same_bits(got, want_fixed), f"{spec} {p, s, d} fixed count, two_phase={two_phase} collective={collective}: wrong rows")
            # Two in flight (V, then Q/K with the same selection), V's slow phase launched by
            # advance, some ranks late.
            into_v, into_qk = prev.clone(), prev.clone()
            hv = sparse.SparseHandle(x, rows, sel, level, group, True, into_v)
            hqk = sparse.SparseHandle(x * 2, rows * 2, sel, level, group, True, into_qk)
            if RANK % 2:
                time.sleep(0.05)
            hv.advance()
            check(same_bits(hqk.wait(), _sparse_expected(x * 2, prev, masks, level, group)), f"{spec}: second in flight")
            check(same_bits(hv.wait(), want), f"{spec}: first in flight, waited last")
            # Every row decoded on arrival (fp8-slow's packed rows): node-mates get the values.
            from cocodiff_xfuser.comm import compress
            if dtype == torch.float32:
                every = sparse.Selection.fixed(torch.arange(s), WORLD)
                packed = {j: compress.pack_rows(x[j]) for j in range(WORLD) if not level.fast(j)}
                fast = torch.tensor([level.fast(j) for j in range(WORLD)])[:, None, None, None]
                decoded = compress.unpack_rows(compress.pack_rows(x), dtype)
                want_packed = torch.where(fast, flat_all_to_all(x.flatten(), group).view(x.shape),
                                          flat_all_to_all(decoded.flatten(), group).view(x.shape))
                for two_phase, collective in ROUTINGS:
                    got = sparse.SparseHandle(x, packed, every, level, group, two_phase, torch.empty_like(x), collective=collective,
                                              decode=lambda r: compress.unpack_rows(r, dtype)).wait()
                    check(same_bits(got, want_packed), f"{spec} {p, s, d} packed rows, two_phase={two_phase} collective={collective}")
            # Everything active: the exact exchange, bitwise.
            every = sparse.Selection.fixed(torch.arange(s), WORLD)
            check(same_bits(sparse.SparseHandle(x, x, every, level, group, True, prev.clone()).wait(),
                            flat_all_to_all(x.flatten(), group).view(x.shape)), f"{spec}: all active != exact")
        handle = sparse.SparseHandle(x, rows, sel, level, group, False, prev.clone(), collective=True)
        handle.wait()
        remote = level.remote
        k = int(mask.sum())
        size = x.element_size()
        mask_bytes = (s + 31) // 32 * 4 if 0 < k < s else 0  # every row (or none): in order, no mask
        check(handle.exact_bytes == len(remote) * s * p * d * size and handle.slow_bytes == len(remote) * (k * p * d * size + mask_bytes),
              f"{spec}: sent bytes")
        handle = sparse.SparseHandle(x, {j: x[j].index_select(1, masks[j].nonzero().flatten()) for j in remote}, sel, level, group,
                                     False, prev.clone(), collective=True, by_receiver=True)
        handle.wait()
        check(handle.slow_bytes == sum(sel.counts[j] for j in remote) * p * d * size, f"{spec}: sent bytes without indices")
    flat = sparse.build_slow_levels(groups, Topology.parse(f"1x{WORLD}").nodes_and_lanes)[tuple(range(WORLD))]
    check(not flat.exists, "one node: no slow level")


def case_v_major_layer() -> None:
    """One V-Major layer over denoising steps on 2x2: what the receivers hold is the exact exchange of
    the senders' references (last-sent values) from other nodes and of fresh V from node-mates;
    threshold and budget send the agreed share their measurements asked for; a new pipeline call
    starts over; the budget holds."""
    from cocodiff_xfuser.vmajor.clock import Clock
    from cocodiff_xfuser.vmajor.policy import Layer

    level = sparse.build_slow_levels([list(range(WORLD))], Topology.parse(f"2x{WORLD // 2}").nodes_and_lanes)[tuple(range(WORLD))]
    group = dist.group.WORLD
    shape = (WORLD, 1, 2, 2, 24, 8)  # [W, n, b, h/W, s, d]
    planes = shape[1] * shape[2] * shape[3]
    cases = (("v", "threshold", False, "none"), ("qkv", "top-k", True, "none"), ("v", "threshold", True, "bfloat16"),
             ("qkv", "budget", True, "bfloat16"), ("qkvo", "threshold", False, "none"), ("qkvo", "budget", True, "bfloat16"))
    for scope, policy, two_phase, residual in cases:
        settings = VMajorSettings.load(policy=policy, threshold=0.1, fraction=0.25, error=0.2, warmup_steps=1, scope=scope,
                                        residual_dtype=residual)
        clock = Clock()
        layer = Layer(clock, settings, level.remote)
        crossing = torch.tensor([not level.fast(j) for j in range(WORLD)])
        budget_counts: list[int] = []
        gen = torch.Generator().manual_seed(RANK)
        v = torch.randn(shape, generator=gen)
        for call in range(2):
            clock.open()
            for t in range(6):
                clock.tick(torch.tensor([1.0 - t / 8]))
                # Tokens drift at different speeds, so some stay cached and some are sent.
                v = v + torch.randn(shape, generator=gen) * torch.linspace(0.0, 0.3, shape[4])[:, None]
                step = layer.begin(v)
                cache = step.caches
                exact = flat_all_to_all(v.flatten(), group).view(shape)
                o = v * 3 + 1  # the attention output, destination-major like V
                exact_o = flat_all_to_all(o.flatten(), group).view(shape)
                if step.active is None:
                    # Exact: the first step; as values also the warm-up and, for budget, until the
                    # first step's measurement is agreed, at the next tick (with residuals those
                    # send every token as its residual).
                    last_full = 1 if residual != "none" else max(settings.warmup_steps, 1) + (policy in ("budget", "threshold"))
                    check(t < last_full, f"an exact exchange at step {t}: only the first, warm-up and unmeasured steps")
                    step.rows("v", v)
                    check(same_bits(cache.reference["v"], v), "a full exchange sends V itself")
                    cache.received["v"] = exact
                    if step.covers("o", o):
                        step.rows("o", o)
                        cache.received["o"] = exact_o
                    continue
                every = step.active.numel() == shape[4]
                check(t >= settings.warmup_steps or every, "every token in warm-up")
                if every and residual != "none":
                    check(same_bits(step.active, torch.arange(shape[4])), "every token in order (no index travels)")
                shares = clock.current.shares
                if policy in ("budget", "threshold") and shares is None:
                    check(every, f"{policy}: every token until the first measurement is agreed")
                elif policy in ("budget", "threshold"):
                    k = math.ceil(shares[0] * shape[4])
                    if sparse.whole_is_smaller(k, shape[4], planes * shape[5] * 2):  # bf16 residual rows
                        k = shape[4]
                    check(_agreed(shares) and step.active.numel() == k, f"{policy}: the agreed share of the tokens {shares}")
                    budget_counts.append(step.active.numel())
                if policy == "top-k":
                    check(step.active.numel() == 6, "top-k sends its fraction of the tokens")
                sel = step.selection  # fixed by the policy and the step, or by shares agreed before
                check(list(sel.counts) == _all_counts(step.active.numel()), "every rank's count, as each rank sent")
                sent = torch.zeros(shape[4], dtype=torch.bool)
                sent[step.active] = True
                rows, is_residual = step.rows("v", v)
                check(sorted(rows) == list(level.remote), "rows are encoded for the ranks on other nodes only")
                check(is_residual == (residual != "none") and all(r.dtype == (v.dtype if residual == "none" else torch.bfloat16)
                                                                  for r in rows.values()), "rows travel as the residual dtype says")
                into = cache.received["v"].view(WORLD, -1, shape[4], shape[5])
                handle = sparse.SparseHandle(v.view(WORLD, -1, shape[4], shape[5]),
                                             {j: r.reshape(planes, r.shape[3], shape[5]) for j, r in rows.items()},
                                             sel, level, group, two_phase, into, is_residual, learn_peers=True)
                got = handle.wait()
                cache.peers = handle.peers  # what V's exchange learned; the output's rows follow them
                from_refs = flat_all_to_all(cache.reference["v"].flatten(), group).view(shape)
                fast = torch.tensor([level.fast(j) for j in range(WORLD)])[:, None, None, None, None, None]
                check(same_bits(got.view(shape), torch.where(fast, exact, from_refs)), f"{scope} step {t}: receivers' cache")
                if step.covers("o", o):
                    # The output: each rank on another node gets its own active tokens.
                    rows_o, _ = step.rows("o", o)  # (with residuals, a first step holds zeros from here)
                    before = cache.received["o"]
                    check(sorted(rows_o) == [j for j in range(WORLD) if not level.fast(j)], "the output's rows go to other nodes")
                    got_o = sparse.SparseHandle(o.view(WORLD, planes, shape[4], shape[5]),
                                                {j: r.reshape(planes, -1, shape[5]) for j, r in rows_o.items()}, sel, level, group,
                                                two_phase, before.clone().view(WORLD, planes, shape[4], shape[5]), is_residual,
                                                by_receiver=True).wait().view(shape)
                    if residual == "none":  # my active tokens are fresh, the others what I held
                        want_o = torch.where(sent[:, None], exact_o, before)
                    else:  # what the senders' references say I hold
                        want_o = flat_all_to_all(cache.reference["o"].flatten(), group).view(shape)
                    check(same_bits(got_o, torch.where(fast, exact_o, want_o)), f"{scope} step {t}: the output's cache")
                    cache.received["o"] = got_o
                # The chunks that cross nodes: sent tokens are fresh there (residuals leave their
                # rounding error behind); node-mates' chunks are not kept.
                ref, now = cache.reference["v"][crossing], v[crossing]
                change = torch.linalg.vector_norm(now - ref, dim=(0, 1, 3, 5)) / torch.linalg.vector_norm(ref, dim=(0, 1, 3, 5))
                sent_error = 0.0 if residual == "none" else 0.01
                check(bool((change[:, sent] <= sent_error).all()), "active tokens are sent (up to the residual's rounding)")
            check(step.covers("qk", v) == (scope != "v") and step.covers("o", v) == (scope == "qkvo"),
                  "scope decides whether Q/K and the output follow V")
        if policy == "budget":
            check(any(0 < k < shape[4] for k in budget_counts), f"budget: some tokens sent, some cached: {budget_counts}")
    tiny = VMajorSettings.load(budget_mib=0.001)
    over = Layer(Clock(), tiny, level.remote)
    over.clock.open()
    over.clock.tick(1.0)
    before = commstats.ran()["fallbacks"].get("v-major: cache budget", 0)
    check(over.begin(torch.zeros(shape)).caches is None, "a layer over the budget keeps no cache")
    check(commstats.ran()["fallbacks"]["v-major: cache budget"] == before + 1, "the budget fall-back is counted")


def _every_exchange(spec: str) -> list[torch.Tensor]:
    """One exchange of every kind on the world: flat-p2p, flat-pxn (node x local only), TAPA (plain,
    advanced, pipelined), and the sparse one- and two-phase exchanges with uneven and empty masks,
    rows chosen by the receivers, and packed rows (fp8-slow)."""
    topo = Topology.parse(spec)
    hier = HierarchicalAllToAll(topo, [list(range(WORLD))])
    x = rand_bits((WORLD * 4 * 64,), torch.float32, 31)
    h = hier.start(x)
    h.advance()
    out = [p2p_all_to_all(x), hier(x), h.wait(), hier(x, parts=2)]
    if len(topo.sizes) == 2:
        out.append(Registry(hier)["flat-pxn"].run(x, None))
    level = sparse.build_slow_levels([list(range(WORLD))], topo.nodes_and_lanes)[tuple(range(WORLD))]
    v = torch.randn(WORLD, 2, 12, 4, generator=torch.Generator().manual_seed(RANK))
    mask = torch.arange(12) % (RANK + 2) == 0 if RANK else torch.zeros(12, dtype=torch.bool)
    sel = _agree_counts(mask.nonzero().flatten(), dist.group.WORLD)
    rows = v.index_select(2, sel.active)
    from cocodiff_xfuser.comm import compress

    remote = [j for j in range(WORLD) if not level.fast(j)]
    for two_phase in (False, True):
        handle = sparse.SparseHandle(v, rows, sel, level, dist.group.WORLD, two_phase, torch.zeros_like(v), learn_peers=True)
        out.append(handle.wait())
        peers = handle.peers
        # The output exchange's rows (chosen by the receivers) and fp8-slow's packed rows.
        back = {j: v[j].index_select(1, peers[j]) for j in remote}
        out.append(sparse.SparseHandle(v, back, sel, level, dist.group.WORLD, two_phase, torch.zeros_like(v), by_receiver=True).wait())
        every = sparse.Selection.fixed(torch.arange(v.shape[2]), WORLD)
        packed = {j: compress.pack_rows(v[j]) for j in remote}
        out.append(sparse.SparseHandle(v, packed, every, level, dist.group.WORLD, two_phase, torch.zeros_like(v),
                                       decode=lambda r: compress.unpack_rows(r, v.dtype)).wait())
    return out


@contextlib.contextmanager
def _reported_as(backend: str):
    """The transport sees ``backend`` for every group (gloo underneath runs the batches); counts the
    calls of ``dist.batch_isend_irecv``."""
    calls = [0]
    saved_name, saved_batch = transport.backend_name, dist.batch_isend_irecv

    def batch(ops):
        calls[0] += 1
        return saved_batch(ops)

    transport.backend_name = lambda group=None, device="cpu": backend
    dist.batch_isend_irecv = batch
    try:
        yield calls
    finally:
        transport.backend_name, dist.batch_isend_irecv = saved_name, saved_batch


def _per_peer(ops: list[tuple[str, int, int]]) -> dict[tuple[str, int], list[int]]:
    pieces: dict[tuple[str, int], list[int]] = {}
    for op, peer, nbytes in ops:
        pieces.setdefault((op, peer), []).append(nbytes)
    return pieces


def case_same_path() -> None:
    """Every exchange posts the same batches with the backend reported as gloo, nccl and xccl: the
    same operations in the same batches in the same sequence, only their order inside a batch
    differs (gloo receives first, XCCL sends first, NCCL as listed); and the same results."""
    for spec in {4: ["2x2"], 8: ["2x4", "2x2x2"]}[WORLD]:
        traces, calls, outs = {}, {}, {}
        for backend in ("gloo", "nccl", "xccl"):
            with _reported_as(backend) as count, transport.tracing() as trace:
                outs[backend] = _every_exchange(spec)
            traces[backend], calls[backend] = trace, count[0]
        gloo = traces["gloo"]
        check(len(gloo) > 10, f"{spec}: {len(gloo)} batches traced")
        roles = {role for role, _ in gloo}
        check(any("sparse phase 2" in r for r in roles) and any("forwarded halves" in r or "phase 3" in r for r in roles), f"{spec}: {roles}")
        check(spec == "2x2x2" or any("relayed chunks" in r for r in roles), f"{spec}: flat-pxn traced: {roles}")
        for backend, trace in traces.items():
            check([r for r, _ in trace] == [r for r, _ in gloo], f"{spec}: {backend} posts other batches than gloo")
            # The same pieces per (operation, peer), in the same order: what matching by issue order needs.
            check(all(_per_peer(a) == _per_peer(b) for (_, a), (_, b) in zip(trace, gloo)), f"{spec}: {backend} batches differ")
            check(all(same_bits(a, b) for a, b in zip(outs[backend], outs["gloo"])), f"{spec}: {backend} results differ")
        sends_first = {"gloo": transport.device_semantics(), "nccl": False, "xccl": True}
        for backend, trace in traces.items():
            for role, ops in trace:
                kinds = [op for op, _, _ in ops]
                want = sorted(kinds, key=lambda k: (k == "recv") == sends_first[backend])
                check(kinds == want, f"{spec}: {backend} order inside '{role}': {kinds}")
        check(calls["nccl"] == calls["xccl"] == len(gloo), f"{spec}: one batch_isend_irecv per batch: {calls}")
        check(calls["gloo"] == (0 if transport.device_semantics() else len(gloo)), f"{spec}: gloo calls {calls['gloo']}")


def case_functional() -> None:
    """TAPA as a compiled graph holds it (:mod:`cocodiff_xfuser.comm.functional`): one all_to_all_single
    per level, bitwise the flat exchange, eagerly and compiled; and the exchanger's route for a traced
    exchange: TAPA's levels where asked for, one answer on every rank where measured, counted once."""
    for spec, levels in _topologies().items():
        hier = HierarchicalAllToAll(Topology.parse(spec), [list(range(WORLD))])
        groups = tuple(g.group_name for g in hier.plan(dist.group.WORLD).level_groups)
        for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.uint8)):
            x = rand_bits((WORLD * 6, 5), dtype, seed)
            got = wait_collective(functional.levels_all_to_all(x, levels, groups))
            check(same_bits(got, flat_all_to_all(x)), f"{spec} {dtype}: TAPA's functional levels != flat")
        torch._dynamo.reset()
        x = torch.randn(WORLD * 4, 3, generator=torch.Generator().manual_seed(RANK))
        compiled = torch.compile(lambda t: functional.levels_all_to_all(t * 2, levels, groups))(x)
        check(same_bits(compiled, flat_all_to_all(x * 2)), f"{spec}: compiled TAPA's functional levels != flat")
        for a2a, expected in (("hierarchical", (levels, groups)), ("flat", ((), (dist.group.WORLD.group_name,))), ("auto", None)):
            exchanger = Exchanger(dist.group.WORLD, Options(topology=spec, a2a=a2a))
            route = exchanger.router.traced("v", (WORLD * 4, 8), "torch.float32", "cpu", WORLD * 4 * 8 * 4)
            check(expected is None or route[1:3] == expected, f"{spec} {a2a}: traced route {route}")
            check(route[0] == ("hierarchical" if route[1] else "flat"), f"{spec} {a2a}: route named {route[0]}")
            everyone = [None] * WORLD
            dist.all_gather_object(everyone, route[1])
            check(len(set(everyone)) == 1, f"{spec} {a2a}: the ranks chose {everyone}")
            again = exchanger.router.traced("v", (WORLD * 4, 8), "torch.float32", "cpu", WORLD * 4 * 8 * 4)
            check(again == route, f"{spec} {a2a}: route changed")


def case_ring() -> None:
    """The ring attention's K/V gather (:mod:`cocodiff_xfuser.comm.ring`): bitwise torch's all-gather on
    the world and on strided ring groups (ranks one node apart, as xfuser builds them), for every
    dtype (fp8 travels as its bytes); several in flight, waited out of order, one launch order."""
    strided = [[r for r in range(WORLD) if r % 2 == i] for i in range(2)]
    for groups in ([list(range(WORLD))], strided):
        group = make_groups(groups) if len(groups) > 1 else dist.group.WORLD
        size = len(groups[0])
        for seed, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in [(7,), (2, 3, 5)]):
            x = rand_bits(shape, dtype, 1300 + seed)
            want = torch.empty(size * x.numel(), dtype=torch.uint8 if dtype == torch.float8_e4m3fn else dtype)
            dist.all_gather_into_tensor(want, x.view(want.dtype).flatten(), group=group)
            got = RingGather(x, group).wait()
            check(got.shape == (size, x.numel()) and got.dtype == dtype, f"ring gather shape {got.shape} {got.dtype}")
            check(same_bits(got.view(-1), want.view(dtype)), f"ring gather {groups} {dtype} {shape} != all_gather")
    # Peers on the other node (ranks // 2 differ) exchange messages instead: pieces of every rank's
    # own sizes (an empty one included), fp8 as its bytes; node-mates still get the buffer.
    def own(r: int) -> torch.Tensor:
        return torch.arange(6, dtype=torch.float32) + 10 * r

    x = own(RANK)
    remote = tuple(j for j in range(WORLD) if j // 2 != RANK // 2)

    def pieces(r: int) -> tuple[torch.Tensor, ...]:
        return (torch.arange(r, dtype=torch.int32), (torch.arange(r + 3, dtype=torch.uint8) + r).view(torch.float8_e4m3fn))

    sizes = {j: tuple(p.numel() * p.element_size() for p in pieces(j)) for j in remote}
    gather = RingGather(x, dist.group.WORLD, Remote(remote, pieces(RANK), sizes))
    got = gather.wait()
    for j in range(WORLD):
        if j in remote:
            want = [transport.comm_view(p).view(-1).view(torch.uint8) for p in pieces(j)]
            check(all(torch.equal(a, b) for a, b in zip(gather.received[j], want)), f"ring message from {j}")
        else:
            check(same_bits(got[j], own(j)), f"ring row from node-mate {j}")
    saved, transport._launches = transport._launches, []
    try:
        xs = [rand_bits((64,), torch.bfloat16, 1390 + i) for i in range(3)]
        gathers = [RingGather(x, dist.group.WORLD) for x in xs]
        if RANK % 2:
            time.sleep(0.05)
        for i in (2, 0, 1):
            check(same_bits(gathers[i].wait()[RANK], xs[i]), f"ring gather #{i}: own row")
        sequences = [None] * WORLD
        dist.all_gather_object(sequences, transport.launches())
        check(sequences[0] == [("ring", "ring K/V")] * 3 and all(q == sequences[0] for q in sequences), f"launches {sequences}")
    finally:
        transport._launches = saved


def case_misordered() -> None:
    """A batch that lists every receive before its send (gloo's order) where the backend replays a
    batch in order, as oneCCL does: correct on gloo, a hang under device semantics that ends with
    the one-line fault message."""
    saved = transport._order
    transport._order = lambda backend: "receives first"
    x = rand_bits((WORLD * 1024,), torch.float32, 41)
    try:
        faults.set_timeout(5.0)
        got = p2p_all_to_all(x)
    except faults.ExchangeFailed as e:
        faults.set_handler(fault_policy.end_rank)  # as in a job: the rank ends with the one line
        faults.failed_exchange(RANK, "misordered", "flat-p2p over the world", 5.0, e)
    finally:
        transport._order = saved
    check(same_bits(got, flat_all_to_all(x)), "a receives-first batch on gloo")


CASES = {
    "same_path": case_same_path,
    "misordered": case_misordered,
    "v_major_layer": case_v_major_layer,
    "sparse": case_sparse,
    "agreement": case_agreement,
    "semantics": case_semantics,
    "layouts": case_layouts,
    "subgroups": case_subgroups,
    "async": case_async,
    "uneven": case_uneven,
    "p2p": case_p2p,
    "p2p_async": case_p2p_async,
    "autotune": case_autotune,
    "pipelined": case_pipelined,
    "pxn": case_pxn,
    "ring": case_ring,
    "functional": case_functional,
    "ulysses_layout": case_ulysses_layout,
}


def main() -> None:
    global RANK, WORLD
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--tmpdir", default=".")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    try:
        # Every case reports on its own: a failed check is printed and the ranks agree on it, then
        # the next case runs (an exception that leaves ranks in different collectives ends the job).
        for name in args.cases.split(","):
            t0 = time.perf_counter()
            fn = CASES[name]
            failed = torch.zeros(1, dtype=torch.int32)
            try:
                fn(args.tmpdir) if name == "autotune" else fn()
            except AssertionError as e:
                print(f"CASE {name} FAILED {e}", flush=True)
                failed.fill_(1)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if RANK == 0 and not failed.item():
                print(f"CASE {name} ok {time.perf_counter() - t0:.2f}s", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: process groups still referenced by module caches
    # are destroyed there, and under load that has ended ranks with std::terminate ("terminate
    # called without an active exception") after every case had reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
