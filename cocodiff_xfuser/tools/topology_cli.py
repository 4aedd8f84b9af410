"""``cocodiff topology``: a topology, the Ulysses groups xfuser builds on it, and TAPA's exchange plan.

Pure computation, no process group: the topology comes from ``--topology`` (``NxL[xT]``, a preset
name or a preset file) or from what this host alone would detect. The groups are those of xfuser
0.7.0 (``initialize_model_parallel``: ``RankGenerator`` in order ``tp-sp-pp-cfg-dp``, so with
tp = pp = dp = 1 every sequence-parallel group is a block of ``ulysses x ring`` consecutive
ranks, and CFG pairs rank ``r`` with ``r + sp``; yunchang's ``set_seq_parallel_pg`` with its
default ``use_ulysses_low=True`` then cuts each SP group into ``ring`` Ulysses groups of
``ulysses`` consecutive ranks, the ring groups taking every ``ulysses``-th rank).

The plan of a Ulysses group is what :class:`cocodiff_xfuser.comm.tapa.HierarchicalAllToAll`
builds for it: the levels the group spans (:func:`cocodiff_xfuser.comm.topology.restrict`), and
for each, innermost (fastest) first, one phase of concurrent exchanges over the sub-groups of
ranks that differ only in that level's coordinate. A group spanning fewer than two levels (or
not a regular sub-grid) uses the flat exchange. Which one runs is chosen at run time by the
autotune (per message size); this is the plan TAPA runs when chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import textwrap
from fractions import Fraction
from typing import Any, Mapping, Sequence

from cocodiff_xfuser.comm import topology as topo
from cocodiff_xfuser.comm.topology import Topology


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``cocodiff topology`` on the subparsers of the ``cocodiff`` command."""
    p = sub.add_parser(
        "topology",
        help="print a topology, the Ulysses groups xfuser builds on it and TAPA's exchange plan",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--topology",
        default=None,
        metavar="SPEC",
        help=f"NxL[xT], a preset ({', '.join(topo.presets())}) or a preset file; default: what this host detects",
    )
    p.add_argument("--world-size", type=int, default=None, help="ranks in the job (needed for presets)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="default: world size / ring degree / CFG degree")
    p.add_argument("--ring-degree", type=int, default=1)
    p.add_argument("--cfg-parallel", action="store_true", help="guidance halves on two rank groups (CFG degree 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_cli(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    rep = report(args.topology, args.world_size, args.ulysses_degree, args.ring_degree, args.cfg_parallel, env)
    print(json.dumps(rep, indent=2) if args.json else format_text(rep))
    return 0


# ---------------------------------------------------------------------------------------------
# The topology


def resolve_topology(
    spec: str | None, world_size: int | None, env: Mapping[str, str] | None = None
) -> tuple[Topology, int, dict[str, Any]]:
    """The topology, the world size and a description of where the topology came from."""
    if world_size is not None and (isinstance(world_size, bool) or world_size < 1):
        raise ValueError(f"--world-size must be a positive integer, got {world_size}")
    if spec is None:
        return detect_local(world_size, env)
    if _is_sizes(spec):
        t = Topology.parse(spec)
        if world_size is not None:
            t.validate(world_size)
        return t, t.world_size, {"kind": "sizes", "spec": spec}
    preset = topo.load_preset(spec)
    if world_size is None:
        raise ValueError(
            f"preset {preset.name!r} needs --world-size (a multiple of its {preset.ranks_per_node} ranks per {preset.levels[0].name})"
        )
    t = preset.topology(world_size)
    return t, world_size, {
        "kind": "preset",
        "preset": preset.name,
        "path": str(preset.path),
        "description": preset.description,
        "source": preset.source,
    }


def detect_local(world_size: int | None = None, env: Mapping[str, str] | None = None) -> tuple[Topology, int, dict[str, Any]]:
    """What this host alone would detect: ``LOCAL_WORLD_SIZE`` (torchrun) or this host's accelerators
    as the ranks per node, ``--world-size`` or ``WORLD_SIZE`` (default: the ranks per node) as the
    world. A run detects from every rank's hostname instead (collective); other hosts are assumed
    to hold as many ranks as this one."""
    env = os.environ if env is None else env
    local, local_from = _env_int(env, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE"
    if local is None:
        local, local_from = _accelerator_count(), "accelerators on this host"
    if world_size is not None:
        world, world_from = world_size, "--world-size"
    elif _env_int(env, "WORLD_SIZE") is not None:
        world, world_from = _env_int(env, "WORLD_SIZE"), "WORLD_SIZE"
    else:
        world, world_from = local, local_from
    if not local:
        if not world:
            raise ValueError("nothing to detect: no accelerator and no LOCAL_WORLD_SIZE/WORLD_SIZE; give --topology or --world-size")
        local, local_from = world, "all ranks on this host: no accelerator counted, no LOCAL_WORLD_SIZE"
    if world % local:
        raise ValueError(f"world size {world} ({world_from}) is not a multiple of the {local} ranks per node ({local_from})")
    tiles = topo.xpu_tiles_per_gpu(env)
    hostnames = [f"node{i // local}" for i in range(world)]
    t = Topology.detect(world, hostnames, local, tiles)
    return t, world, {
        "kind": "detected",
        "host": socket.gethostname(),
        "ranks_per_node": local,
        "ranks_per_node_from": local_from,
        "world_size_from": world_from,
        "tiles_per_gpu": tiles,
        "note": "what this host alone detects; a run detects from every rank's hostname (other hosts assumed alike)",
    }


def _is_sizes(spec: str) -> bool:
    s = spec.strip().lower()
    return bool(s) and all(c.isdigit() or c in "x " for c in s)


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{key}={value!r} is not a positive integer")
    return n


def _accelerator_count() -> int:
    import torch

    for name in ("cuda", "xpu"):
        dev = getattr(torch, name, None)
        if dev is not None and dev.is_available():
            return dev.device_count()
    return 0


# ---------------------------------------------------------------------------------------------
# xfuser 0.7.0's groups


def parallel_groups(world_size: int, ulysses: int, ring: int = 1, cfg: int = 1) -> dict[str, list[list[int]]]:
    """The SP, Ulysses, ring and CFG groups (global ranks) of xfuser 0.7.0 with tp = pp = dp = 1."""
    for name, value in (("ulysses degree", ulysses), ("ring degree", ring), ("CFG degree", cfg)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the {name} must be a positive integer, got {value!r}")
    if ulysses * ring * cfg != world_size:
        raise ValueError(
            f"ulysses degree {ulysses} x ring degree {ring} x CFG degree {cfg} = {ulysses * ring * cfg}, not the world size {world_size}"
        )
    sp = ulysses * ring
    sp_groups = [list(range(o, o + sp)) for o in range(0, world_size, sp)]
    return {
        "sp": sp_groups,
        # yunchang.set_seq_parallel_pg, use_ulysses_low=True (xfuser passes no value).
        "ulysses": [g[i * ulysses : (i + 1) * ulysses] for g in sp_groups for i in range(ring)],
        "ring": [g[i::ulysses] for g in sp_groups for i in range(ulysses)],
        "cfg": [[r + k * sp for k in range(cfg)] for r in range(sp)],
    }


# ---------------------------------------------------------------------------------------------
# The exchange plan


def spanned_levels(topology: Topology, ranks: Sequence[int]) -> list[tuple[str, int]]:
    """(name, size) of the levels a group spans, outermost first (sizes as :func:`topo.restrict`)."""
    sizes = topo.restrict(topology, ranks)  # raises for a group that is not a regular sub-grid
    coords = [topology.coords(r) for r in ranks]
    spans = [(name, len({c[i] for c in coords})) for i, name in enumerate(topology.names)]
    spans = [(name, n) for name, n in spans if n > 1]
    assert [n for _, n in spans] == sizes, (spans, sizes)
    return spans


def flat_fractions(topology: Topology, ranks: Sequence[int]) -> dict[str, Fraction]:
    """Per topology level, the average share of a rank's bytes that the flat exchange sends to
    peers whose outermost differing coordinate is that level (i.e. over that level's links)."""
    ranks = sorted(ranks)
    coords = {r: topology.coords(r) for r in ranks}
    counts = [0] * len(topology.levels)
    for src in ranks:
        for dst in ranks:
            if dst != src:
                counts[next(i for i, (a, b) in enumerate(zip(coords[src], coords[dst])) if a != b)] += 1
    n = len(ranks)
    return {name: Fraction(counts[i], n * n) for i, name in enumerate(topology.names) if counts[i]}


def exchange_plan(topology: Topology, ranks: Sequence[int]) -> dict[str, Any]:
    """The exchange of one Ulysses group: algorithm, levels and phases (innermost first)."""
    ranks = sorted(ranks)
    by_name = {level.name: level for level in topology.levels}
    plan: dict[str, Any] = {"ranks": ranks}
    if len(ranks) < 2:
        return {**plan, "algorithm": "none", "reason": "a group of one rank exchanges nothing", "levels": [], "phases": []}
    flat = {k: _frac(v) for k, v in flat_fractions(topology, ranks).items()}
    try:
        spans = spanned_levels(topology, ranks)
    except ValueError as e:
        return {**plan, "algorithm": "flat", "reason": str(e), "levels": [], "phases": [], "flat_fraction_by_level": flat}
    plan["levels"] = [{"name": n, "size": s} for n, s in spans]
    if len(spans) < 2:
        name, size = spans[0]
        phases = [_phase(by_name[name], size, [ranks])]
        reason = f"the group spans one level ({name}): TAPA has nothing to split"
        return {**plan, "algorithm": "flat", "reason": reason, "phases": phases, "flat_fraction_by_level": flat}
    subgroups = topo.level_subgroups(ranks, [s for _, s in spans])
    phases = [_phase(by_name[name], size, subgroups[j]) for j, (name, size) in reversed(list(enumerate(spans)))]
    return {
        **plan,
        "algorithm": "hierarchical",
        "reason": "TAPA when the autotune picks it for the message size (else stock's flat exchange)",
        "phases": phases,
        "flat_fraction_by_level": flat,
    }


def _phase(level: topo.Level, size: int, subgroups: list[list[int]]) -> dict[str, Any]:
    # Every phase exchanges a rank's whole buffer among `size` ranks: (size - 1) / size leaves it.
    return {
        "level": level.name,
        "size": size,
        "subgroups": subgroups,
        "peers": size - 1,
        "sent_fraction": _frac(Fraction(size - 1, size)),
        "bandwidth_gbps": level.bandwidth_gbps,
        "latency_us": level.latency_us,
    }


def _frac(f: Fraction) -> dict[str, Any]:
    return {"value": float(f), "fraction": f"{f.numerator}/{f.denominator}"}


# ---------------------------------------------------------------------------------------------
# The report


def report(
    spec: str | None,
    world_size: int | None = None,
    ulysses: int | None = None,
    ring: int = 1,
    cfg_parallel: bool = False,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    t, world, origin = resolve_topology(spec, world_size, env)
    cfg = 2 if cfg_parallel else 1
    if ulysses is None:
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise ValueError(f"the ring degree must be a positive integer, got {ring!r}")
        if world % (ring * cfg):
            raise ValueError(f"world size {world} is not a multiple of ring degree {ring} x CFG degree {cfg}")
        ulysses = world // (ring * cfg)
    groups = parallel_groups(world, ulysses, ring, cfg)
    return {
        "topology": {
            "spec": str(t),
            "describe": t.describe(),
            "world_size": world,
            "origin": origin,
            "levels": [
                {
                    "name": level.name,
                    "size": level.size,
                    "bandwidth_gbps": level.bandwidth_gbps,
                    "latency_us": level.latency_us,
                    "source": level.source,
                }
                for level in t.levels
            ],
        },
        "degrees": {"ulysses": ulysses, "ring": ring, "cfg": cfg},
        "groups": {k: v for k, v in groups.items() if k == "ulysses" or k == "sp" or len(v[0]) > 1},
        "plans": [exchange_plan(t, g) for g in groups["ulysses"]],
    }


def _ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}..{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def _groups(groups: Sequence[Sequence[int]], limit: int = 16) -> str:
    shown = " ".join(_ranks(g) for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def _num(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:g} {unit}"


def format_text(rep: dict[str, Any]) -> str:
    t, origin = rep["topology"], rep["topology"]["origin"]
    lines = [f"topology {t['spec']} ({t['describe']}), {t['world_size']} ranks"]
    if origin["kind"] == "preset":
        lines.append(f"  preset {origin['preset']} ({origin['path']})")
        if origin.get("description"):
            lines.append(f"  {origin['description']}")
    elif origin["kind"] == "detected":
        lines.append(
            f"  detected on {origin['host']}: {origin['ranks_per_node']} ranks per node ({origin['ranks_per_node_from']}),"
            f" world size from {origin['world_size_from']}"
        )
        lines.append(f"  ({origin['note']})")
    else:
        lines.append("  given as sizes (no link figures: give a preset for bandwidth and latency)")
    lines.append("  levels, outermost first (bandwidth: per rank, one direction, crossing the level):")
    for level in t["levels"]:
        lines.append(
            f"    {level['name']:<6} size {level['size']:<4} bandwidth {_num(level['bandwidth_gbps'], 'GB/s'):<10}"
            f" latency {_num(level['latency_us'], 'us')}"
        )
        if level["source"]:
            lines.extend(textwrap.wrap(f"source: {level['source']}", 100, initial_indent=" " * 11, subsequent_indent=" " * 13,
                                       break_long_words=False, break_on_hyphens=False))
    d = rep["degrees"]
    lines.append(f"degrees: ulysses {d['ulysses']} x ring {d['ring']} x cfg {d['cfg']} (xfuser 0.7.0 group layout)")
    for key in ("ulysses", "ring", "cfg", "sp"):
        if key in rep["groups"]:
            lines.append(f"  {key + ' groups:':<16} {_groups(rep['groups'][key])}")
    lines.append("exchange plan per Ulysses group (phases innermost first; sent: share of a rank's bytes leaving it in the phase):")
    shown: dict[tuple, list[list[int]]] = {}  # plan shape -> its groups, the first one printed
    for plan in rep["plans"]:
        shape = (
            plan["algorithm"],
            tuple((lv["name"], lv["size"]) for lv in plan["levels"]),
            json.dumps(plan.get("flat_fraction_by_level")),
        )
        shown.setdefault(shape, []).append(plan["ranks"])
        if len(shown[shape]) > 1:
            continue
        levels = " x ".join(f"{lv['size']} {lv['name']}" for lv in plan["levels"]) or "-"
        lines.append(f"  group {_ranks(plan['ranks'])}: spans {levels}; {plan['algorithm']}: {plan['reason']}")
        for i, ph in enumerate(plan["phases"], 1):
            lines.append(
                f"    phase {i} {ph['level']:<6} {ph['size']} ranks, sent {ph['sent_fraction']['fraction']}"
                f" to {ph['peers']} peer{'s' if ph['peers'] != 1 else ''}, over {_num(ph['bandwidth_gbps'], 'GB/s')}:"
                f" sub-groups {_groups(ph['subgroups'], 8)}"
            )
        if plan.get("flat_fraction_by_level"):
            flat = ", ".join(f"{k} {v['fraction']}" for k, v in plan["flat_fraction_by_level"].items())
            lines.append(f"    flat exchange, share of a rank's bytes crossing each level: {flat}")
    for groups in shown.values():
        if len(groups) > 1:
            lines.append(
                f"  {len(groups) - 1} more group(s) with the plan of {_ranks(groups[0])}, on their own ranks:"
                f" {_groups(groups[1:], 8)}"
            )
    return "\n".join(lines)
