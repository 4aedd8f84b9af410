"""What a layout's denoising step and whole run take on a GPU class, fitted on xDiT's published runs.

A run of ``steps`` steps takes ``steps x step + fixed``: ``fixed`` is what runs once per image
outside the denoising loop (text encoders, the VAE's decode), priced as work per output
megapixel-frame (one figure per VAE: the models that share one share it) at the class's eager rate;
a step, per rank:

* **compute**: the model's FLOPs (:func:`.dit_specs.layer_flops`: projections on the rank's tokens,
  attention over the whole sequence) split over the layout's ranks, at the class's datasheet rate
  times its achieved share, one share eager and one compiled;
* **Ulysses**: the input (Q, K, V) and output all-to-alls of every attention layer at the achieved
  share of the group's link (NVLink, PCIe or Xe Link inside a node, the NIC across nodes);
* **ring**: each of the ``R - 1`` passes of K/V blocks per layer costs a fixed time it does not
  hide (its launch, the block attention's merge), and what its bytes take beyond the attention of
  the block it overlaps;
* **PipeFusion**: the layers split over ``P`` stages, ``P`` patches (xDiT's default) pipelined
  across steps (one fill of ``P - 1`` patch slots per run), each patch's activations sent to the
  next stage; eager, each stage runs its layers' host code once per patch. None of xDiT's
  published PipeFusion runs is of a model the planner prices (Sana's linear attention): these
  layouts are priced, not validated (:func:`validated`);
* **CFG parallel**: each branch on half the ranks (its final gather is negligible);
* **host**: eager, xDiT's Python per attention layer (more with ring attention) bounds the step
  from below: ``max(device, host)``. Compiled (CUDA graphs) it is hidden.

What each class achieves (its shares of FLOP rate), each VAE's fixed work per megapixel-frame and
the shared constants (the all-to-all's share of link rate, the host's time per layer, a ring pass's own
cost) are fitted, in log space, on the rows of xDiT's ``docs/performance`` tables the model can
express (:func:`published_rows`), nothing else; a class without published rows takes the shares of
the fitted class its ``like`` names (configs/gpus/classes.yaml). :func:`validate` compares every expressible
row with its prediction and asks, per group of rows that differ only in layout, whether the
published fastest layout is the one predicted fastest.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from cocodiff_xfuser.shipped import CONFIGS, RESULTS
from cocodiff_xfuser.tools.dit_specs import MODELS, ModelSpec, layer_flops

PUBLISHED = "xdit-published.yaml"
MODES = ("eager", "compiled")
#: plan --validate's targets on the published rows: median and worst |predicted / published - 1|,
#: and the share of layout groups whose published fastest layout is predicted fastest.
TARGETS = {"median_abs_error": 0.15, "worst_abs_error": 0.35, "fastest_ranked_first": 0.80}
#: Published model names -> the planner's model (ConsisID is CogVideoX-5B's transformer).
PUBLISHED_MODELS = {"FLUX.1-dev": "flux-dev", "Flux.1-dev": "flux-dev", "FLUX.1 [schnell]": "flux-schnell",
                    "HunyuanVideo": "hunyuan-video", "ConsisID": "cogvideox-5b", "CogVideoX-2b": "cogvideox-2b",
                    "CogVideoX-5b": "cogvideox-5b"}
#: A VAE without published runs takes the fixed work per megapixel-frame of a fitted one of its kind.
VAE_LIKE = {"flux2": "flux", "sd3": "flux", "qwen-image": "flux", "wan2.1": "hunyuan-video"}


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    tflops: float
    memory_gbps: float
    node_link: str
    node_link_gbps: float
    inter_node_gbps: float
    source: str
    like: Optional[str] = None


@functools.lru_cache(maxsize=1)
def gpus() -> Dict[str, GPU]:
    """The GPU classes of configs/gpus/classes.yaml, by key."""
    found = yaml.safe_load((CONFIGS / "gpus" / "classes.yaml").read_text())["gpus"]
    return {key: GPU(key=key, **fields) for key, fields in found.items()}


def gpu(key: str) -> GPU:
    known = gpus()
    if key not in known:
        raise ValueError(f"unknown GPU class {key!r}; known: {', '.join(known)}")
    return known[key]


@dataclass(frozen=True)
class Layout:
    """xDiT's parallel degrees: Ulysses x ring (sequence), CFG branches, PipeFusion stages."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    pipefusion: int = 1

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.pipefusion

    @property
    def name(self) -> str:
        parts = [f"{k}{n}" for k, n in (("U", self.ulysses), ("R", self.ring), ("P", self.pipefusion), ("C", self.cfg))
                 if n > 1]
        return "x".join(parts) or "1"


@dataclass(frozen=True)
class Run:
    """What is priced: a model at a size on ``gpus_per_node x nodes`` GPUs of a class."""

    model: ModelSpec
    width: int
    height: int
    frames: int
    steps: int
    gpu: GPU
    mode: str
    gpus_per_node: int
    nodes: int = 1
    inter_node_gbps: Optional[float] = None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def megapixel_frames(self) -> float:
        return self.width * self.height * self.frames / 1e6


@dataclass
class Constants:
    """What the fit sets: per fitted GPU class its achieved share of the datasheet FLOP rate per
    mode; per VAE the fixed work of a run (TFLOP at the eager rate) per output megapixel-frame;
    shared, the all-to-all's share of link rate, the eager host's seconds per attention layer (and
    its extra with ring attention), a ring pass's own seconds per layer."""

    share: Dict[Tuple[str, str], float] = field(default_factory=dict)
    fixed_tflop_per_mpx: Dict[str, float] = field(default_factory=dict)
    a2a_share: float = 0.6
    host_layer_s: float = 1e-3
    ring_host_layer_s: float = 3e-4
    ring_pass_s: float = 5e-5

    def rate_share(self, g: GPU, mode: str) -> float:
        key = g.key if (g.key, "eager") in self.share else g.like
        if (key, mode) in self.share:
            return self.share[(key, mode)]
        # A class fitted eagerly only: compiled gains what it gains on the class fitted in both modes.
        both = next(k for k, m in self.share if m == "compiled")
        return self.share[(key, "eager")] * self.share[(both, "compiled")] / self.share[(both, "eager")]

    def fixed_s(self, run: Run) -> float:
        vae = run.model.vae if run.model.vae in self.fixed_tflop_per_mpx else VAE_LIKE[run.model.vae]
        work = self.fixed_tflop_per_mpx[vae] * run.megapixel_frames
        return work / (run.gpu.tflops * self.rate_share(run.gpu, "eager"))


def _link_Bps(run: Run, span: int) -> float:
    """Bytes/s per GPU per direction of a group spanning ``span`` consecutive ranks."""
    if span <= run.gpus_per_node:
        return run.gpu.node_link_gbps * 1e9
    return (run.inter_node_gbps or run.gpu.inter_node_gbps) * 1e9


def step(run: Run, layout: Layout, c: Constants, ring_bytes: float = 1.0) -> dict:
    """One denoising step of ``layout`` (seconds per rank, and its parts); ``ring_bytes``: the
    share of its K/V bytes the ring sends (V-Major's, where the ring crosses nodes)."""
    spec, U, R, C, P = run.model, layout.ulysses, layout.ring, layout.cfg, layout.pipefusion
    img, txt = spec.tokens(run.width, run.frames, run.height)
    batch = (2 if spec.cfg else 1) / C  # the rank's CFG branches
    rate = run.gpu.tflops * 1e12 * c.rate_share(run.gpu, run.mode)
    D = spec.heads * spec.head_dim
    pad = math.ceil(spec.heads / U) * U / spec.heads
    compute = ulysses = ring = 0.0
    for count, joint in spec.attn:
        s = img + (txt if joint else 0)
        compute += count * batch * layer_flops(spec, s, s / (U * R), pad) / rate
        local = batch * s / (U * R) * D * pad * spec.dtype_bytes  # one tensor, this rank's tokens
        if U > 1:
            ulysses += count * 4 * local * (U - 1) / U / (_link_Bps(run, U) * c.a2a_share)
        if R > 1:
            kv = 2 * local / U * ring_bytes  # K and V of this rank's tokens and heads
            attention = batch * 4 * (s / (U * R)) * (s / R) * D * pad / U / rate  # one block pair
            over = max(0.0, kv / (_link_Bps(run, U * R) * c.a2a_share) - attention)
            ring += count * (R - 1) * (c.ring_pass_s + over)
    compute, ulysses, ring = compute / P, ulysses / P, ring / P
    pipe = 0.0
    if P > 1:  # P patches through P stages: one fill per run, and each patch's activations passed on
        pipe = (compute + ulysses + ring) * (P - 1) / (P * run.steps)
        pipe += batch * (img + txt) / (U * R) * D * spec.dtype_bytes / (_link_Bps(run, U * R * P) * c.a2a_share)
    device = compute + ulysses + ring + pipe
    host = 0.0
    if run.mode == "eager":  # a stage's layers, once per patch
        host = spec.layers * (c.host_layer_s + (c.ring_host_layer_s if R > 1 else 0.0))
    return {"step_s": max(device, host), "compute_s": compute, "ulysses_s": ulysses, "ring_s": ring,
            "pipefusion_s": pipe, "host_s": host, "host_bound": host > device}


def total_s(run: Run, layout: Layout, c: Constants) -> float:
    return run.steps * step(run, layout, c)["step_s"] + c.fixed_s(run)


def layouts(run: Run, stock: bool = True) -> List[Layout]:
    """Every Ulysses x ring x CFG x PipeFusion factorization of the run's GPUs xDiT runs (stock:
    Ulysses degrees that divide the heads; PipeFusion where xfuser's runner takes it for the model,
    with no more stages than layers)."""
    out = []
    for C in ((1, 2) if run.model.cfg else (1,)):
        for P in divisors(run.world // C if run.world % C == 0 else 0):
            for U in divisors(run.world // C // P):
                R = run.world // C // P // U
                if (stock and run.model.heads % U) or P > run.model.layers or (P > 1 and not run.model.pipefusion):
                    continue
                out.append(Layout(U, R, C, P))
    return out


def validated(layout: Layout) -> bool:
    """Whether xDiT's published runs the constants are fitted on hold layouts of this kind."""
    return layout.pipefusion == 1


def divisors(n: int) -> List[int]:
    """The divisors of ``n``, ascending (none of 0): the degrees a world of ``n`` ranks splits into."""
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ the published rows and the fit
@dataclass(frozen=True)
class Published:
    run: Run
    layout: Layout
    seconds: float
    line: str  # where it is printed: file:line

    @property
    def group(self) -> tuple:
        """Rows that differ only in layout: one comparison of layouts."""
        r = self.run
        return (r.model.name, r.gpu.key, r.world, r.mode, r.width, r.height, r.frames, r.steps)


def published_rows(path: Optional[Path] = None) -> Tuple[List[Published], List[dict]]:
    """The rows of xDiT's performance tables the model can express, and the others with why not:
    table rows with exact figures of a known model and GPU class, resolution, steps and GPU count
    stated, in Ulysses, ring, CFG and PipeFusion degrees. A mode the doc does not state is eager
    (xDiT's examples compile only when asked)."""
    rows = yaml.safe_load(Path(path or RESULTS / PUBLISHED).read_text())
    found, left = [], []
    for row in rows:
        why = _inexpressible(row)
        if why:
            left.append({"line": f"{row['source']}:{row['line']}", "model": row["model"], "why": why})
            continue
        width, height = (int(x) for x in row["resolution"].split("x"))
        layout = row["layout"]
        found.append(Published(
            Run(MODELS[PUBLISHED_MODELS[row["model"]]], width, height, row["frames"] or 1, row["steps"],
                gpu(_gpu_key(row["gpu"])), "compiled" if row["mode"] == "compiled" else "eager",
                row["gpus_per_node"] or row["gpus_total"], row["nodes"] or 1),
            Layout(layout["ulysses"], layout["ring"], layout["cfg"], layout["pipefusion"]),
            row["latency_s"], f"{row['source']}:{row['line']}"))
    return found, left


def _gpu_key(text: str) -> Optional[str]:
    """The class a doc's GPU column names (its first word: 'H100 (Nvidia)', 'L40 (PCIe)')."""
    word = re.split(r"[\s(]", text.strip())[0].lower()
    return word if word in gpus() else None


def _inexpressible(row: dict) -> Optional[str]:
    if row["kind"] != "table" or row["qualifier"] != "exact":
        return f"a {row['qualifier']} figure in prose, not a table's"
    if row["model"] not in PUBLISHED_MODELS:
        return "model not in the planner"
    if _gpu_key(row["gpu"]) is None:
        return f"GPU {row['gpu']!r} not a class"
    if not row["resolution"] or not re.fullmatch(r"\d+x\d+", row["resolution"]) or not row["steps"]:
        return "resolution or steps not stated"
    if not row["gpus_total"] or row["per_step"]:
        return "GPU count not stated, or a per-step figure"
    layout = row["layout"] or {}
    if layout.get("data", 1) > 1 or layout.get("tensor", 1) > 1:
        return "data or tensor parallel"
    return None


#: The fit's parameters, in log space: shared ones, then per fitted class its shares and fixed time.
_SHARED = ("a2a_share", "host_layer_s", "ring_host_layer_s", "ring_pass_s")


def _unpack(x: Sequence[float], classes: Sequence[str], compiled: Sequence[str], vaes: Sequence[str]) -> Constants:
    values = iter(math.exp(v) for v in x)
    c = Constants(**{name: next(values) for name in _SHARED})
    c.share.update({(key, "eager"): next(values) for key in classes})
    c.share.update({(key, "compiled"): next(values) for key in compiled})
    c.fixed_tflop_per_mpx.update({vae: next(values) for vae in vaes})
    return c


def _start(classes: Sequence[str], compiled: Sequence[str], vaes: Sequence[str]) -> List[float]:
    base = Constants()
    return [math.log(v) for v in [getattr(base, n) for n in _SHARED] + [0.4] * len(classes) + [0.6] * len(compiled)
            + [200.0] * len(vaes)]


@functools.lru_cache(maxsize=1)
def fitted() -> Constants:
    """The constants that fit the expressible published rows best (least squares of the log
    ratio of predicted to published)."""
    rows, _ = published_rows()
    return fit(rows)


def fit(rows: Sequence[Published]) -> Constants:
    classes = sorted({r.run.gpu.key for r in rows})
    compiled = sorted({r.run.gpu.key for r in rows if r.run.mode == "compiled"})
    vaes = sorted({r.run.model.vae for r in rows})

    def loss(x: Sequence[float]) -> float:
        c = _unpack(x, classes, compiled, vaes)
        if not 0 < c.a2a_share <= 1 or any(not 0 < v <= 1 for v in c.share.values()):
            return math.inf
        return sum(math.log(total_s(r.run, r.layout, c) / r.seconds) ** 2 for r in rows)

    return _unpack(_nelder_mead(loss, _start(classes, compiled, vaes)), classes, compiled, vaes)


def _nelder_mead(f, x0: Sequence[float], scale: float = 0.5, rounds: int = 4, iters: int = 3000) -> List[float]:
    """A minimum of ``f`` near ``x0`` (Nelder-Mead, restarted ``rounds`` times around its last best)."""
    best = list(x0)
    for _ in range(rounds):
        n = len(best)
        simplex = [best] + [[v + (scale if j == i else 0.0) for j, v in enumerate(best)] for i in range(n)]
        values = [f(p) for p in simplex]
        for _ in range(iters):
            order = sorted(range(n + 1), key=values.__getitem__)
            simplex, values = [simplex[i] for i in order], [values[i] for i in order]
            if values[-1] - values[0] < 1e-10:
                break
            centre = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
            worst = simplex[-1]
            reflected = [2 * centre[j] - worst[j] for j in range(n)]
            fr = f(reflected)
            if fr < values[0]:
                expanded = [3 * centre[j] - 2 * worst[j] for j in range(n)]
                fe = f(expanded)
                simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
            elif fr < values[-2]:
                simplex[-1], values[-1] = reflected, fr
            else:
                contracted = [(centre[j] + worst[j]) / 2 for j in range(n)]
                fc = f(contracted)
                if fc < values[-1]:
                    simplex[-1], values[-1] = contracted, fc
                else:  # shrink towards the best
                    simplex = [simplex[0]] + [[(simplex[0][j] + p[j]) / 2 for j in range(n)] for p in simplex[1:]]
                    values = [values[0]] + [f(p) for p in simplex[1:]]
        best = simplex[min(range(n + 1), key=values.__getitem__)]
        scale /= 2
    return best


def validate() -> dict:
    """Every expressible published row against its prediction, and per layout group whether the
    published fastest layout is predicted fastest; the targets (:data:`TARGETS`) met or not. Then
    held out: each layout group predicted by constants fitted on every other row."""
    rows, left = published_rows()
    c = fitted()
    points = [_point(r, c) for r in rows]
    groups: Dict[tuple, List[Published]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    ranked = [_ranking(members, c) for members in groups.values() if len(members) > 1]
    held_points, held_ranked = [], []
    for key, members in groups.items():
        if len(members) > 1:
            others = fit([r for r in rows if r.group != key])
            held_points += [_point(r, others) for r in members]
            held_ranked.append(_ranking(members, others))
    found = _summary(points, ranked)
    met = {k: found[k] is not None and (found[k] >= v if k == "fastest_ranked_first" else found[k] <= v)
           for k, v in TARGETS.items()}
    return {"method": ("in-sample: every constant fitted on these rows (least squares of log(predicted / "
                       "published)), no other project's figures; held out: the rows of each layout group "
                       "predicted from a fit on every other row"),
            "rows": len(points), "constants": describe(c), **found, "targets": TARGETS, "met": met,
            "groups": ranked, "held_out": {**_summary(held_points, held_ranked), "groups": held_ranked,
                                           "per_row": held_points},
            "per_row": points, "not_expressible": left}


def _point(r: Published, c: Constants) -> dict:
    predicted = total_s(r.run, r.layout, c)
    return {"line": r.line, "model": r.run.model.name, "gpu": r.run.gpu.key, "gpus": r.run.world,
            "mode": r.run.mode, "size": f"{r.run.width}x{r.run.height}", "frames": r.run.frames,
            "steps": r.run.steps, "layout": r.layout.name, "published_s": r.seconds,
            "predicted_s": predicted, "error": predicted / r.seconds - 1}


def _ranking(members: Sequence[Published], c: Constants) -> dict:
    fastest = min(members, key=lambda r: r.seconds)
    predicted = min(members, key=lambda r: total_s(r.run, r.layout, c))
    return {"group": " ".join(str(k) for k in members[0].group), "layouts": [m.layout.name for m in members],
            "published_fastest": fastest.layout.name, "predicted_fastest": predicted.layout.name,
            "ranked_first": fastest is predicted}


def _summary(points: Sequence[dict], ranked: Sequence[dict]) -> dict:
    errors = [abs(p["error"]) for p in points]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "fastest_ranked_first": sum(g["ranked_first"] for g in ranked) / len(ranked) if ranked else None}


def describe(c: Constants) -> dict:
    """The constants as plain numbers: per class its achieved TFLOP/s per mode, per VAE the fixed
    work per megapixel-frame, and the shared ones."""
    classes = {key: {"achieved_tflops": {m: g.tflops * c.rate_share(g, m) for m in MODES},
                     "fitted": (key, "eager") in c.share, "like": None if (key, "eager") in c.share else g.like}
               for key, g in gpus().items()}
    vaes = {vae: {"fixed_tflop_per_megapixel_frame": c.fixed_tflop_per_mpx[VAE_LIKE.get(vae, vae)],
                  "fitted": vae in c.fixed_tflop_per_mpx, "like": None if vae in c.fixed_tflop_per_mpx else VAE_LIKE[vae]}
            for vae in sorted({m.vae for m in MODELS.values() if m.vae})}
    return {"gpus": classes, "vaes": vaes, **{n: getattr(c, n) for n in _SHARED}}
