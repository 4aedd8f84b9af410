"""Tests of the emulated fabric (cocodiff_xfuser.tools.fabric + cocodiff_xfuser/tools/fabric/emulate_cluster.sh).

Unit tests of the bound arithmetic always run; the namespace tests run when
``cocodiff_xfuser.tools.fabric.available()`` says namespaces can be built here (root, ip, tc) and skip
with its reason otherwise.

This file is also the rank worker and a small benchmark driver (not a test):

    python tests/test_fabric.py worker smoke          # run by every rank (see test_smoke_...)
    python tests/test_fabric.py bench [--reps 9] [--sizes-mib 4,16] [--presets rail,shared-uplink]

``bench`` brings each fabric up (2 nodes x 2 ranks), times a flat gloo all_to_all_single against an
inline two-phase exchange (intra-node, then same-rail), alternating A B A B, and prints the
median/min of the max-over-ranks times, their ratio, the physical bounds and the tc drop counters.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20


# =============================================================================== unit tests
def _fabric(*a, **k):
    from cocodiff_xfuser.tools.fabric import Fabric

    return Fabric(*a, **k)


def test_bound_shared_uplink_2x2_hand_computed():
    f = _fabric("shared-uplink", 2, 2)
    # 16 MiB per rank, c = 4 MiB per pair; inter-node pairs: 4 ranks x 2 = 8 -> 32 MiB;
    # 2 uplinks x 2 Gbit/s = 500e6 B/s aggregate.
    assert f.class_bytes("all_to_all", 16 * MiB)["uplink"] == 32 * MiB
    assert abs(f.bound_s("all_to_all", 16 * MiB) - 32 * MiB / 500e6) < 1e-12
    # Every inter-node byte crosses the uplink whatever the algorithm: flat == two-phase == bound.
    assert f.bound_s("flat", 16 * MiB) == f.bound_s("two_phase", 16 * MiB) == f.bound_s("all_to_all", 16 * MiB)


def test_bound_rail_2x2_hand_computed():
    f = _fabric("rail", 2, 2)
    lc = f.link_classes
    assert lc["rail"].count == 4 and lc["rail"].Bps == 125e6
    assert lc["spine"].count == 2 and lc["spine"].Bps == 62.5e6  # 2 nodes x 1 Gbit/s / 4
    # min routing: all 32 MiB inter-node bytes over the 4 rails (500e6 B/s), spine unused.
    assert abs(f.bound_s("all_to_all", 16 * MiB) - 32 * MiB / 500e6) < 1e-12
    assert f.class_bytes("all_to_all", 16 * MiB)["spine"] == 0
    # flat: each rank sends 4 MiB cross-rail -> 16 MiB over 2 leaf uplinks of 62.5e6 B/s.
    assert f.class_bytes("flat", 16 * MiB)["spine"] == 16 * MiB
    assert abs(f.bound_s("flat", 16 * MiB) - 16 * MiB / 125e6) < 1e-12
    assert abs(f.bound_s("flat", 16 * MiB) / f.bound_s("two_phase", 16 * MiB) - 2.0) < 1e-12


def test_bound_rail_4x2_hand_computed():
    f = _fabric("rail", 4, 2)
    # W = 8, c = 2 MiB; inter-node: 8 ranks x 6 peers x 2 MiB = 96 MiB over 8 x 125e6 B/s.
    assert abs(f.bound_s("all_to_all", 16 * MiB) - 96 * MiB / 1e9) < 1e-12
    # flat spine: 8 ranks x 3 cross-rail remote peers x 2 MiB = 48 MiB over 2 x (4 x 1 Gbit/s / 4).
    assert abs(f.bound_s("flat", 16 * MiB) - 48 * MiB / 250e6) < 1e-12


def test_bound_aurora_like_2x4_hand_computed():
    from cocodiff_xfuser.tools.fabric import aurora_emulated_rates

    r = aurora_emulated_rates()
    assert abs(r["xe_to_nic_ratio"] - 4.2) < 1e-9  # (5 x 28 / 2) / (8 x 25 / 12)
    f = _fabric("aurora-like", 2, 4)
    lc = f.link_classes
    assert lc["uplink"].Bps == 4 * 250e6 / 8 and abs(lc["xe"].Bps - 4.2 * 250e6 / 8) < 1e-3
    bd = f.bound_breakdown("all_to_all", 16 * MiB)
    # inter-node: 8 x 4 x 2 MiB = 64 MiB over 2 node uplinks of 125e6 B/s.
    assert abs(bd["uplink"]["seconds"] - 64 * MiB / 250e6) < 1e-12
    # intra-node cross-GPU: 8 ranks x 2 peers x 2 MiB = 32 MiB over 8 Xe ports.
    assert abs(bd["xe"]["seconds"] - 32 * MiB / (8 * 4.2 * 250e6 / 8)) < 1e-9
    assert f.bound_s("all_to_all", 16 * MiB) == bd["uplink"]["seconds"]


def test_bound_single_node_and_matrix():
    assert _fabric("rail", 1, 4).bound_s("all_to_all", 16 * MiB) == 0.0
    f = _fabric("rail", 2, 2)
    m = [[0.0] * 4 for _ in range(4)]
    m[0][3] = 1e6  # one cross-rail inter-node message
    assert f.bound_s(m) == 1e6 / 500e6
    assert f.bound_s(m, routing="direct") == 1e6 / 125e6  # spine
    assert f.bound_s("flat", 0) == 0.0


def test_routes_and_first_hops_are_consistent():
    f = _fabric("rail", 2, 2)
    assert f.route(0, 1) == ("intra",) and f.route(0, 2) == ("rail",) and f.route(0, 3) == ("rail", "spine")
    assert f.first_hop(0, 3) == ("up0", "10.80.100.1") and f.first_hop(1, 2) == ("up0", "10.80.101.1")
    assert f.two_phase_route(0, 3) == ("intra", "rail")
    a = _fabric("aurora-like", 2, 4)
    assert a.route(0, 1) == ("tile",) and a.route(0, 2) == ("xe",) and a.route(0, 5) == ("pcie", "uplink")
    assert a.first_hop(0, 5) == ("eth0", "10.80.0.1") and a.first_hop(0, 3) == ("up0", None)
    s = _fabric("shared-uplink", 2, 2)
    assert s.route(0, 2) == ("uplink",) and s.first_hop(3, 0) == ("eth0", "10.80.1.1")
    for fab in (f, a, s):
        for i in range(fab.world):
            for j in range(fab.world):
                if i != j:
                    assert fab.mandatory(i, j) <= set(fab.route(i, j))


def test_shell_env_and_validation():
    env = dict(line.split("=", 1) for line in _fabric("rail", 2, 2).shell_env().splitlines())
    assert env["CCD_RATE_SPINE"] == "500000000" and env["CCD_WORLD"] == "4"
    limit = int(env["CCD_TBF_RAIL"].strip("'").split("limit ")[1])
    assert limit >= 4_000_000
    with pytest.raises(ValueError):
        _fabric("torus", 2, 2)
    with pytest.raises(ValueError):
        _fabric("aurora-like", 2, 3)
    with pytest.raises(ValueError):
        _fabric("rail", 2, 2, params={"nope": 1})
    assert _fabric("rail", 2, 2, params={"rail_bps": 2e9}).link_classes["rail"].Bps == 250e6


# =============================================================================== namespace tests
def _need_fabric():
    from cocodiff_xfuser.tools.fabric import available

    ok, reason = available()
    if not ok:
        pytest.skip(f"emulated fabric unavailable: {reason}")


def _our_namespaces(prefix: str):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.fabric
@pytest.mark.parametrize("preset,nodes,local", [("shared-uplink", 2, 2), ("rail", 2, 2), ("aurora-like", 2, 4)])
def test_built_routes_and_shaping_match_description(preset, nodes, local):
    _need_fabric()
    f = _fabric(preset, nodes, local, fabric_id=f"r{os.getpid() % 100000}")
    with f:
        # every sender's namespace routes every destination the way the description promises
        for s in range(f.world):
            for d in range(f.world):
                if s == d:
                    continue
                out = subprocess.run(["ip", "-n", f.namespace(s), "route", "get", f.rank_address(d)],
                                     capture_output=True, text=True, check=True).stdout
                dev, gw = f.first_hop(s, d)
                assert f" dev {dev} " in out and f"src {f.rank_address(s)}" in out, (s, d, out)
                assert (f"via {gw} " in out) if gw else (" via " not in out), (s, d, out)
        # nothing outside the emulated ranks is reachable from a rank
        r = subprocess.run(["ip", "-n", f.namespace(0), "route", "get", "8.8.8.8"], capture_output=True, text=True)
        assert r.returncode != 0
        # one tbf per direction of every shaped link
        shaped = sum(2 * lc.count for lc in f.link_classes.values() if lc.shaped)
        assert len(f.qdisc_stats()) == shaped
    assert _our_namespaces(f.prefix) == []


@pytest.mark.fabric
def test_launcher_exit_codes_timeout_and_env():
    _need_fabric()
    f = _fabric("rail", 2, 2, fabric_id=f"u{os.getpid() % 100000}")
    with f:
        r = f.run(["sh", "-c", 'echo "R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK '
                               '$MASTER_ADDR $GLOO_SOCKET_IFNAME OMP=$OMP_NUM_THREADS"'],
                  timeout=20, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "R=0 W=4 L=0 LW=2 G=0 10.77.0.10 eth0 OMP=1" in r.stdout
        r = f.run(["sh", "-c", '[ "$RANK" = 2 ] && exit 3; sleep 20'], timeout=30, capture_output=True, text=True)
        assert r.returncode == 3, r.stderr
        t = time.time()
        r = f.run(["sleep", "30"], timeout=2, capture_output=True, text=True)
        assert r.returncode == 124 and time.time() - t < 10, r.stderr
        assert f.is_up()  # a run on a fabric that was already up leaves it up
    assert _our_namespaces(f.prefix) == []


@pytest.mark.fabric
def test_down_cleans_a_crashed_run():
    _need_fabric()
    import signal

    f = _fabric("shared-uplink", 2, 2, fabric_id=f"k{os.getpid() % 100000}")
    p = subprocess.Popen(["bash", str(f.script), "run", "--preset", f.preset, "--id", f.fabric_id, "--",
                          "sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while time.time() < deadline and not f.is_up():
            time.sleep(0.2)
        assert f.is_up()
        time.sleep(0.5)
    finally:
        p.send_signal(signal.SIGKILL)  # the launcher dies without its trap: fabric and ranks stay
        p.wait()
    pids = subprocess.run(["ip", "netns", "pids", f.namespace(0)], capture_output=True, text=True).stdout.split()
    assert pids, "rank 0 should have survived its launcher"
    f.down()
    f.down()  # idempotent
    assert _our_namespaces(f.prefix) == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "sleep" not in Path(f"/proc/{pid}/cmdline").read_text()


@pytest.mark.fabric
def test_smoke_gloo_all_to_all_through_run():
    """2x2 rail fabric brought up by ``run`` itself; gloo all_to_all_single + two-phase; teardown."""
    _need_fabric()
    f = _fabric("rail", 2, 2, fabric_id=f"s{os.getpid() % 100000}")
    assert not f.is_up()
    t = time.time()
    r = f.run([sys.executable, str(Path(__file__).resolve()), "worker", "smoke"], timeout=50,
              capture_output=True, text=True)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "SMOKE OK world=4" in r.stdout  # printed by rank 0: its stdout reaches the caller
    assert _our_namespaces(f.prefix) == [], "run did not tear down the fabric it brought up"
    assert time.time() - t < 60


# =============================================================================== rank worker
VARIANTS = ("flat", "two_phase", "flat_p2p", "two_phase_p2p")


def _worker(mode: str, argv) -> int:
    """Rank worker.  Variants of one equal-split all-to-all (node-major ranks, N nodes x L local):

    flat           gloo ``all_to_all_single`` over all W ranks (the stock exchange);
    two_phase      gloo ``all_to_all_single`` in the node group, then in the rail group (ranks with
                   the same local index): intra-node first, then same-rail only;
    *_p2p          the same exchanges as isend/irecv with ALL receives posted before any send.
                   gloo's pairwise protocol sends its "ready to receive" notice on the same TCP
                   stream as the data, so in ``all_to_all_single`` (send posted before recv) a late
                   rank's notice can queue behind a whole chunk of its own data and serialise the
                   two directions of a pair (measured: 2x on a 2-rank exchange).  Posting receives
                   first removes that transport artefact; both pairs are reported.
    """
    import argparse
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="4,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    W, rank = dist.get_world_size(), dist.get_rank()
    L = int(os.environ["LOCAL_WORLD_SIZE"])
    N = W // L
    node, local = rank // L, rank % L
    # every rank creates every subgroup, in the same order
    node_groups = [dist.new_group(list(range(n * L, (n + 1) * L))) for n in range(N)]
    rail_groups = [dist.new_group(list(range(k, W, L))) for k in range(L)]
    g_node, g_rail = node_groups[node], rail_groups[local]
    node_peers = list(range(node * L, (node + 1) * L))
    rail_peers = list(range(local, W, L))

    def exchange(recv, send, peers, group, p2p):
        """recv[i] <- what peers[i] sends us; send[i] -> peers[i] (first dim = len(peers))."""
        if not p2p:
            dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
            return
        me = peers.index(rank)
        P = len(peers)
        order = [(me + i) % P for i in range(1, P)]
        reqs = [dist.irecv(recv[(me - i) % P], peers[(me - i) % P]) for i in range(1, P)]
        reqs += [dist.isend(send[j], peers[j]) for j in order]
        recv[me].copy_(send[me])
        for r in reqs:
            r.wait()

    def flat(x, out, t1, t2, p2p):
        exchange(out, x, list(range(W)), None, p2p)

    def two_phase(x, out, t1, t2, p2p):
        # x: [W, c], chunk j goes to rank j = (m, k).  Phase 1 (node group): to local peer k go the
        # chunks for (m, k), all m.  Phase 2 (rail group k): to (m, k) go the L chunks for it.
        c = x.shape[1]
        t1.view(L, N, c).copy_(x.view(N, L, c).transpose(0, 1))            # [k, m, c]
        exchange(t2.view(L, N * c), t1.view(L, N * c), node_peers, g_node, p2p)  # t2: [l_src, m, c]
        t1.view(N, L, c).copy_(t2.view(L, N, c).transpose(0, 1))            # [m, l_src, c]
        exchange(out.view(N, L * c), t1.view(N, L * c), rail_peers, g_rail, p2p)  # out: [n_src, l_src, c]

    ops = {"flat": (flat, False), "two_phase": (two_phase, False),
           "flat_p2p": (flat, True), "two_phase_p2p": (two_phase, True)}

    def make(c):
        x = torch.arange(W * c, dtype=torch.float32).view(W, c) + rank * 1e6
        expect = torch.stack([torch.arange(rank * c, (rank + 1) * c, dtype=torch.float32) + s * 1e6
                              for s in range(W)])
        return x, expect, torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def check(c):
        x, expect, out, t1, t2 = make(c)
        for name, (fn, p2p) in ops.items():
            out.fill_(-1)
            fn(x, out, t1, t2, p2p)
            assert torch.equal(out, expect), f"{name} exchange wrong on rank {rank}"

    check(3)
    if mode == "smoke":
        dist.barrier()
        if rank == 0:
            print(f"SMOKE OK world={W} nodes={N} local={L} preset={os.environ.get('CCD_FABRIC_PRESET')}",
                  flush=True)
        dist.destroy_process_group()
        return 0

    late_starts = [0]

    def timed(fn):
        # All ranks share this machine's CLOCK_MONOTONIC, so instead of "barrier -> op -> max over
        # ranks" (a gloo barrier's exit skew reached ~20 ms here while the previous op's tail was
        # still draining through the shaped queues) rank 0 names a common start instant T and the
        # time is max over ranks of (end - T).  A rank that learns T too late starts late and the
        # lateness is included (counted in late_starts).
        dist.barrier()  # drain: every receiver has completed the previous op
        t = torch.tensor([time.monotonic() + 0.05], dtype=torch.float64)
        dist.broadcast(t, 0)
        start = t.item()
        wait = start - time.monotonic()
        if wait < 0:
            late_starts[0] += 1
        elif wait > 0.003:
            time.sleep(wait - 0.002)
        while time.monotonic() < start:
            pass
        fn()
        dt = torch.tensor([time.monotonic() - start], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    results = {}
    for size_mib in [float(s) for s in a.sizes_mib.split(",")]:
        c = int(size_mib * MiB / 4 / W)
        check(c)
        x, _, out, t1, t2 = make(c)
        times = {k: [] for k in ops}
        for i in range(a.warmup + a.reps):
            order = VARIANTS[i % 4:] + VARIANTS[:i % 4]  # rotate: A B C D, B C D A, ...
            for name in order:
                fn, p2p = ops[name]
                dt = timed(lambda: fn(x, out, t1, t2, p2p))
                if i >= a.warmup:
                    times[name].append(dt)
        results[str(size_mib)] = times

    # one-way bandwidth of the intra-node (unlimited) link: rank 0 -> rank 1, 16 MiB
    intra = []
    if L >= 2:
        buf = torch.empty(4 * MiB, dtype=torch.float32)
        for _ in range(5):
            def one_way():
                if rank == 0:
                    dist.send(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
            intra.append(timed(one_way))
    if rank == 0:
        print("BENCH " + json.dumps({"world": W, "nodes": N, "local": L, "results": results,
                                     "intra_16mib_s": intra, "late_starts_rank0": late_starts[0]}),
              flush=True)
    dist.destroy_process_group()
    return 0


# =============================================================================== bench driver
def _bench(argv) -> int:
    import argparse

    from cocodiff_xfuser.tools.fabric import Fabric, available

    ap = argparse.ArgumentParser(prog="tests/test_fabric.py bench")
    ap.add_argument("--presets", default="rail,shared-uplink")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--local", type=int, default=2)
    ap.add_argument("--sizes-mib", default="4,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    ok, reason = available()
    if not ok:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    report = []
    med = statistics.median
    print(f"load average before: {os.getloadavg()[0]:.2f} (other work on this host skews the figures)")
    for preset in a.presets.split(","):
        fab = Fabric(preset, a.nodes, a.local, fabric_id=f"b{os.getpid() % 100000}")
        with fab:
            r = fab.run([sys.executable, str(Path(__file__).resolve()), "worker", "bench",
                         "--sizes-mib", a.sizes_mib, "--reps", str(a.reps)],
                        timeout=600, capture_output=True, text=True)
            stats = fab.qdisc_stats()
        if r.returncode != 0:
            print(r.stdout, r.stderr, file=sys.stderr)
            return r.returncode
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("BENCH "))
        res = json.loads(line[6:])
        drops = sum(s["dropped"] for s in stats)
        intra = res["intra_16mib_s"]
        intra_txt = f", intra-node one-way 16 MiB: {16 * MiB * 8 / med(intra) / 1e9:.1f} Gbit/s" if intra else ""
        print(f"\n== {preset} {a.nodes}x{a.local}: tc tbf drops {drops} on {len(stats)} shaped qdiscs{intra_txt}"
              f", late starts (rank 0) {res['late_starts_rank0']}")
        for s in stats:
            if s["dropped"]:
                print(f"   drops: {s['ns']} {s['dev']} {s['dropped']} ({s['sent_bytes'] / MiB:.0f} MiB sent)")
        print(f"   {'MiB/rank':>8} {'variant':>14} {'median':>8} {'min':>8}   bound: any algorithm / flat routes")
        for size, times in res["results"].items():
            size_b = float(size) * MiB
            b, bf = fab.bound_s("all_to_all", size_b), fab.bound_s("flat", size_b)
            for k, v in times.items():
                print(f"   {float(size):8.0f} {k:>14} {med(v) * 1e3:6.1f}ms {min(v) * 1e3:6.1f}ms")
            print(f"   {'':8} {'ratios':>14} two_phase/flat {med(times['two_phase']) / med(times['flat']):.2f}  "
                  f"two_phase_p2p/flat_p2p {med(times['two_phase_p2p']) / med(times['flat_p2p']):.2f}  "
                  f"(medians)   bound {b * 1e3:.1f}ms / {bf * 1e3:.1f}ms")
            report.append({"preset": preset, "nodes": a.nodes, "local": a.local, "size_mib": float(size),
                           "times_s": times, "bound_s": b, "flat_route_bound_s": bf, "tbf_drops": drops,
                           "intra_16mib_s": intra})
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3:]))
    if len(sys.argv) >= 2 and sys.argv[1] == "bench":
        sys.exit(_bench(sys.argv[2:]))
    print(__doc__)
    sys.exit(2)
