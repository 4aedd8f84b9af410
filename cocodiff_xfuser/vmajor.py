"""V-Major: over slow links, send only the tokens whose V changed since the receivers last got them.

Per attention layer and token, the sender compares this step's V with its *reference*, the value
it last sent for that token (so a token that stays cached for many steps never drifts further
than the policy allows). Tokens the policy selects are *active*: the exchange sends them to every
rank, and the others only to node-mates (:mod:`.comm.sparse`); receivers on other nodes keep the
previous result of the exchange and update its active rows. With scope ``qkv`` the Q and K
exchanges of the layer follow V's selection (the paper's reading); with scope ``v`` they are exact;
with ``qkvo`` the output exchange follows it too: a rank's output rows are its own tokens, so each
sender sends a rank on another node its attention output at that rank's active tokens, whose
indices it received with V's rows (nothing more travels), and keeps its own reference. Where Q
and K follow, a sparse step's V rows ride in Q/K's exchange (:attr:`Step.v_rides`).

Decisions that change which collectives run (full or sparse exchange at this step, whether a
layer fits the cache budget, how many rows each rank sends) depend only on the step, the shapes,
the settings and agreed values, which every rank shares; the selected rows are rank-local and
travel, with their indices, in the exchange. The policies ``top-k``, ``schedule`` and ``budget``
fix each rank's count on the host, so a layer's exchange needs no agreement and no host
synchronization; ``threshold``'s count depends on the data: each layer reads it (one host
synchronization) and agrees the counts (one all-gather of integers).

``budget`` (what ``--cocodiff-v-major auto`` runs) sends, per layer, the fewest tokens that keep the
relative L2 error of V as the receivers hold it within ``error``: every layer measures at every
step, on the device, how many of its tokens that took (the senders know exactly what the
receivers hold), and the clock agrees the counts once per step (one all-reduce, MAX over the
group, that no rank waits for: it is read a step later, so a step sends the counts measured two
steps before, the first sparse step those of the step before). ``auto`` maps a PSNR target to ``error`` with a calibration measured on
the trained models (``configs/policies/v-major-calibration.yaml``), and turns V-Major off where
its steps are not faster than exact ones (:class:`_Trial`; ``if_slower: keep`` keeps it on, e.g. to
save the bytes of a metered link).

Caches live per attention layer and per transformer call within a step (true CFG calls the
transformer twice per step) and are dropped when a new pipeline call starts, which a
transformer's clock sees as a timestep that does not decrease.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import order, sparse
from cocodiff_xfuser.comm.autotune import paired_ratios
from cocodiff_xfuser.platform import detect
from cocodiff_xfuser.shipped import CONFIGS

logger = logging.getLogger("cocodiff_xfuser")

DEFAULTS = CONFIGS / "policies" / "v-major.yaml"
POLICIES = ("threshold", "top-k", "schedule", "budget")
#: The knobs each policy reads besides the ones every policy reads (warm-up, refresh, scope, residual
#: dtype, cache budget): a knob given for a policy that does not read it is refused.
POLICY_KNOBS = {"threshold": ("metric", "threshold"), "top-k": ("metric", "fraction"),
                "schedule": ("metric", "final_cached"), "budget": ("error",)}
POLICY_READ = {knob for knobs in POLICY_KNOBS.values() for knob in knobs}
METRICS = ("rel-l2", "l1")
SCOPES = ("v", "qkv", "qkvo")
RESIDUAL_DTYPES = ("none", "bfloat16", "float8_e4m3fn")
IF_SLOWER = ("stop", "keep")
MODES = ("off", "on", "auto")
CALIBRATION = DEFAULTS.with_name("v-major-calibration.yaml")


#: ``--cocodiff-v-major-min-psnr``'s default (dB against the exact run).
DEFAULT_MIN_PSNR_DB = 38.0


def error_for(min_psnr_db: float, path: Path = CALIBRATION) -> float:
    """The ``budget`` policy's ``error`` for a mean-PSNR target: on each calibrated model, the largest
    error whose PSNR, interpolated linearly in log(error) between measured points (each point's
    PSNR taken as the lower 95% prediction bound for a fresh 20-image check where the calibration
    gives one, and as the lowest at that error or below, so the curve falls), meets the target; the
    smallest of these over the models. A target above every measured PSNR gets the smallest calibrated error
    (logged): its quality is then not known to meet the target."""
    import yaml

    models = yaml.safe_load(path.read_text())["models"]
    if not models:
        raise ValueError(f"{path}: no calibrated model (cocodiff quality --sweep v-major-budget writes one)")
    errors = []
    for name, model in models.items():
        points = sorted((p["error"], p.get("psnr_low_db", p["psnr_db"])) for p in model["points"])
        falling, lowest = [], math.inf
        for error, psnr in points:
            lowest = min(lowest, psnr)
            falling.append((math.log(error), lowest))
        if min_psnr_db > falling[0][1]:
            logger.warning(
                "cocodiff: V-Major auto: %g dB is above what %s measured at the smallest calibrated error "
                "(%.1f dB at %g); using that error", min_psnr_db, name, falling[0][1], points[0][0],
            )
            errors.append(points[0][0])
            continue
        best = falling[0][0]
        for (x0, y0), (x1, y1) in zip(falling, falling[1:]):
            if y1 >= min_psnr_db:
                best = x1
            elif y0 >= min_psnr_db:
                best = x0 + (x1 - x0) * (y0 - min_psnr_db) / (y0 - y1)
                break
        errors.append(math.exp(best))
    return min(errors)


@dataclass(frozen=True)
class Settings:
    """The V-Major knobs (``configs/policies/v-major.yaml``; each also a ``--cocodiff-v-major-*`` flag)."""

    policy: str
    metric: str
    threshold: float
    error: float
    fraction: float
    final_cached: float
    warmup_steps: int
    refresh_every: int
    scope: str
    residual_dtype: str
    budget_mib: float
    if_slower: str
    # --cocodiff-v-major auto's target (not a file knob): its ``error`` came from the calibration,
    # and V-Major turns itself off where its steps are not faster than exact ones.
    min_psnr_db: float | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, *, min_psnr_db: float | None = None, strict: bool = False,
             **overrides: Any) -> Settings:
        """The settings of ``path`` (default: the shipped defaults), with non-None ``overrides`` applied
        and auto's ``min_psnr_db``. ``strict`` (a user's settings): a knob that the user's file or an
        override sets and the chosen policy never reads is an error, not a silent no-op."""
        import yaml

        path = Path(path) if path else DEFAULTS
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--cocodiff-v-major-config {path}: cannot read it ({e})") from e
        names = {f.name: f.type for f in fields(cls) if f.name != "min_psnr_db"}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{path}: unknown V-Major setting(s) {', '.join(unknown)}; expected {', '.join(names)}")
        given = {k for k, v in overrides.items() if v is not None} | (set(data) if path != DEFAULTS else set())
        if path != DEFAULTS:  # a user's file may set only some knobs
            data = {**yaml.safe_load(DEFAULTS.read_text()), **data}
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            settings = cls(**{k: (int if names[k] == "int" else float if names[k] == "float" else str)(data[k]) for k in names},
                           min_psnr_db=min_psnr_db)
        except (TypeError, ValueError) as e:
            raise ValueError(f"V-Major settings: {e}") from e
        settings.check()
        if strict:
            settings.check_read(given)
        return settings

    def check_read(self, given: set[str]) -> None:
        """One line for the first knob in ``given`` that these settings never read."""
        unread = sorted(given & (POLICY_READ - set(POLICY_KNOBS[self.policy])))
        if unread:
            name = unread[0]
            readers = [policy for policy, knobs in POLICY_KNOBS.items() if name in knobs]
            raise ValueError(f"--cocodiff-v-major-{name.replace('_', '-')} is not read by policy {self.policy} (read by "
                             f"{', '.join(readers)}): leave it out or choose one of those with --cocodiff-v-major-policy")
        if "if_slower" in given and self.min_psnr_db is None:
            raise ValueError("--cocodiff-v-major-if-slower acts only with --cocodiff-v-major auto (its speed check): leave it out")

    def check(self) -> None:
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("metric", self.metric, METRICS),
            ("scope", self.scope, SCOPES),
            ("residual-dtype", self.residual_dtype, RESIDUAL_DTYPES),
            ("if-slower", self.if_slower, IF_SLOWER),
        ):
            if value not in allowed:
                raise ValueError(f"--cocodiff-v-major-{name} {value!r}: expected one of {', '.join(allowed)}")
        for name, value in (("fraction", self.fraction), ("final-cached", self.final_cached)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--cocodiff-v-major-{name} {value!r}: expected a share between 0 and 1")
        if not 0.0 < self.error < 1.0:
            raise ValueError(f"--cocodiff-v-major-error {self.error!r}: expected a relative error between 0 and 1")
        if self.threshold < 0 or self.warmup_steps < 0 or self.refresh_every < 0 or self.budget_mib < 0:
            raise ValueError("--cocodiff-v-major-threshold, -warmup-steps, -refresh-every and -budget-mib must be >= 0")

    def describe(self) -> str:
        rule = {
            "threshold": f"change > {self.threshold:g} ({self.metric})",
            "top-k": f"top {self.fraction:.0%} per step ({self.metric})",
            "schedule": f"cached share rising to {self.final_cached:.0%} ({self.metric})",
            "budget": f"fewest tokens keeping V's error within {self.error:g} (rel-l2, per layer)",
        }[self.policy]
        refresh = f", full every {self.refresh_every} steps" if self.refresh_every else ""
        rows = "values" if self.residual_dtype == "none" else f"{self.residual_dtype} residuals"
        auto = "" if self.min_psnr_db is None else f"auto for {self.min_psnr_db:g} dB: "
        return (f"{auto}{rule}, scope {self.scope}, active rows as {rows}, {self.warmup_steps} warm-up steps{refresh}, "
                f"cache budget {self.budget_mib:g} MiB")

    @property
    def residual(self) -> torch.dtype | None:
        """The dtype active rows' changes travel in (None: the rows themselves, in the exchange's dtype)."""
        return None if self.residual_dtype == "none" else getattr(torch, self.residual_dtype)


class _Budget:
    """Cache bytes held per (layer, branch) of one transformer, against ``budget_mib``."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.warned = False  # the one log line

    def admit(self, key: tuple[int, int], nbytes: int, budget_mib: float) -> bool:
        self.held.pop(key, None)
        if sum(self.held.values()) + nbytes > budget_mib * 2**20:
            return False
        self.held[key] = nbytes
        return True

    def release(self, layer: int) -> None:
        for key in [k for k in self.held if k[0] == layer]:
            del self.held[key]


#: Pairs of steps, one with V-Major's exchanges and one exact, that auto times (:class:`_Trial`).
TRIAL_PAIRS = 3


class _Trial:
    """Auto's speed check: whether V-Major makes this job's steps faster, measured on whole steps.

    From step ``first`` (the end of the warm-up) of a pipeline call, ``TRIAL_PAIRS`` pairs of steps
    run one with V-Major and one as V-First alone (exact exchanges, no selection, no caches touched:
    the next step's residuals are still against what the receivers hold), in alternating order
    (sparse first, then exact first...) so that a drift hits both alike, like the autotune's paired
    timings. A step's time runs from its first transformer call to the next step's, the device
    synchronized at both ends, and counts everything V-Major adds or saves: selection, residuals,
    caches and all of a layer's exchanges. Each step's time is the MAX over the group (one
    all-reduce, so every rank takes the same decision); V-Major stays on if the median of the pairs'
    ratios (sparse / exact) is below 1. A pipeline call too short for the trial leaves it to the
    next one.
    """

    def __init__(self, first: int) -> None:
        self.first = first
        self.times: list[float] = []  # the trial's steps so far, in step order
        self._started: float | None = None

    def exact(self, step: int) -> bool:
        """Whether ``step`` is one of the trial's exact steps."""
        i = step - self.first
        if not 0 <= i < 2 * TRIAL_PAIRS:
            return False
        pair, second = divmod(i, 2)
        return (second == 1) == (pair % 2 == 0)

    def restart(self) -> None:
        self.times, self._started = [], None

    def at_step(self, step: int, device: torch.device, group: Any) -> bool | None:
        """At the start of ``step`` (every rank, the same steps): time the step that ended, and once
        all of the trial's have, decide: whether V-Major's steps are faster (None: not decided)."""
        if not self.first <= step <= self.first + 2 * TRIAL_PAIRS:
            return None
        detect().synchronize(device)
        now = time.perf_counter()
        if self._started is not None:
            self.times.append(now - self._started)
        self._started = now
        if step < self.first + 2 * TRIAL_PAIRS:
            return None
        times = torch.tensor(self.times, dtype=torch.float32, device=device)
        order.launched(group, "all_reduce")
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        by_kind: dict[str, list[float]] = {"sparse": [], "exact": []}  # pair by pair
        for i, seconds in enumerate(times.tolist()):
            by_kind["exact" if self.exact(self.first + i) else "sparse"].append(seconds)
        ratio = statistics.median(paired_ratios(by_kind, "exact")["sparse"])
        if ratio < 1.0:
            logger.info("cocodiff: V-Major's steps took %.2fx exact steps' time; V-Major stays on", ratio)
            return True
        logger.warning("cocodiff: V-Major off: its steps took %.2fx exact steps' time (the links are not the bottleneck)", ratio)
        commstats.count_fallback("v-major: steps not faster than exact steps")
        return False


class Clock:
    """The denoising step of one transformer, read from the timesteps it is called with.

    A timestep lower than the last one is the next step; the same one, another call of the same
    step (true CFG's second branch); a higher one (or the first), a new pipeline call.
    """

    def __init__(self, group: Any = None, trial_from: int | None = None) -> None:
        self.call = 0
        self.step = 0
        self.branch = 0
        self.layers = 0  # V-Major layers attached to this clock
        self.budget = _Budget()  # their caches
        self.group = group  # the Ulysses group the layers' counts are agreed over (policy budget)
        # Auto's speed check from step ``trial_from`` (None: none), until it decides; ``off``: it
        # found V-Major's steps not faster, and every exchange is exact for the rest of the job.
        self.trial = None if trial_from is None else _Trial(trial_from)
        self.off = False
        # Policy budget: per layer, the share of tokens the current step sends (agreed; None: not
        # yet measured, the exchange is exact), and what the layers measured during this step.
        self.shares: list[float] | None = None
        self.needed: list[tuple[int, torch.Tensor]] = []
        self._agreeing: tuple[Any, torch.Tensor] | None = None  # an all-reduce in flight, and its tensor
        self._last: float | None = None

    def tick(self, timestep: Any) -> None:
        t = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
        if self._last is None or t > self._last:
            self.call, self.step, self.branch = self.call + 1, 0, 0
            self._take_shares()  # the last call's: completed, then dropped
            self.shares, self.needed = None, []
            if self.trial is not None:
                self.trial.restart()
        elif t == self._last:
            self.branch += 1
        else:
            self.step, self.branch = self.step + 1, 0
            self._agree_shares()
        self._last = t
        if self.trial is not None and self.branch == 0:
            device = timestep.device if isinstance(timestep, torch.Tensor) else torch.device("cpu")
            faster = self.trial.at_step(self.step, device, self._agreement_group())
            if faster is not None:
                self.trial, self.off = None, not faster

    def _agreement_group(self) -> Any:
        """The group the clock's agreements run over: the Ulysses group, or WORLD where none was given
        (looked up when used: a clock can be built before the process group)."""
        return self.group if self.group is not None else dist.group.WORLD

    def exact_step(self) -> bool:
        """Whether this step runs without V-Major (one of auto's timed exact steps)."""
        return self.trial is not None and self.trial.exact(self.step)

    def need(self, layer: int, share: torch.Tensor) -> None:
        """Layer ``layer`` needs to send ``share`` (a device scalar) of its tokens to meet its budget
        (the largest of a step's calls counts; gathered once per step, in :meth:`_agree_shares`)."""
        self.needed.append((layer, share))

    def shares_now(self) -> list[float] | None:
        """The agreed shares for this step; the first time there are any, waits for their agreement."""
        if self.shares is None:
            self._take_shares()
        return self.shares

    def _agree_shares(self) -> None:
        """Agree the shares the layers measured during the step that ended (MAX over the group),
        without waiting: one all-reduce per step, launched here and read at the next step's tick
        (a step's counts come from the measurements of two steps before, the first sparse step's
        from the step before), so no step waits for the others' measurements and, on a GPU, the
        host reads a result its queue has long passed. Whether it runs depends on the steps and
        the layers that ran, the same on every rank."""
        self._take_shares()
        if not self.needed:
            return
        layers, shares = zip(*self.needed)
        device = shares[0].device
        needed = torch.zeros(self.layers, dtype=torch.float32, device=device).index_reduce_(
            0, torch.tensor(layers, device=device), torch.stack(shares).float(), "amax")
        group = self._agreement_group()
        order.launched(group, "all_reduce")
        work = dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._agreeing, self.needed = (work, needed), []

    def settle(self) -> None:
        """Complete the agreement in flight (after a transformer call: it has had the whole call to
        finish, and nothing is left in flight when the job ends)."""
        if self._agreeing is not None:
            self._agreeing[0].wait()

    def _take_shares(self) -> None:
        if self._agreeing is not None:
            work, needed = self._agreeing
            work.wait()
            self.shares, self._agreeing = needed.tolist(), None


def attach_clock(transformer: torch.nn.Module, group: Any = None, settings: Settings | None = None) -> Clock:
    """A :class:`Clock` ticked before every call of ``transformer`` (its ``timestep`` argument) and
    settled after it; ``group``: the Ulysses group of its V-Major layers; ``settings``: theirs (auto,
    unless ``if_slower: keep``, times its steps against exact ones)."""

    def before(module, args, kwargs) -> None:
        timestep = kwargs.get("timestep")
        if timestep is None:
            raise ValueError(f"cocodiff: V-Major needs {type(module).__name__} to be called with timestep=...")
        clock.tick(timestep)

    trial = settings is not None and settings.min_psnr_db is not None and settings.if_slower == "stop"
    clock = Clock(group, max(settings.warmup_steps, 1) if trial else None)
    transformer.register_forward_pre_hook(before, with_kwargs=True)
    transformer.register_forward_hook(lambda module, args, output: clock.settle())
    return clock


class _Caches:
    """One layer's caches for one (pipeline call, branch): the sender's reference, the receivers' results."""

    def __init__(self, shape: tuple) -> None:
        self.shape = shape
        # Exchange name ('v', 'qk', 'o') -> the input as the receivers on other nodes hold it
        # (destination-major; 'qk' and 'o' only with residuals), and the last result on this rank.
        self.reference: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] = {}
        # (kind, names exchanged together) -> one tensor along dim 1 and the views of it kept as
        # their entries, so a layer whose V rides with Q/K every step joins them without a copy.
        self._joined: dict[tuple[str, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def joined(self, kind: str, names: tuple[str, ...]) -> torch.Tensor:
        """The entries ``names`` of ``kind`` ('reference' or 'received') as one tensor along dim 1,
        which they become views of: the one kept from the last time where they still are."""
        store = getattr(self, kind)
        base, views = self._joined.get((kind, *names), (None, []))
        parts = [store[name] for name in names]
        if base is not None and all(part is view for part, view in zip(parts, views)):
            return base
        base = torch.cat(parts, dim=1)
        self.split(kind, names, base)
        return base

    def split(self, kind: str, names: tuple[str, ...], base: torch.Tensor) -> None:
        """Keep ``base`` (the entries ``names`` of ``kind`` along dim 1, as many planes each as
        before) as those entries."""
        store, first, views = getattr(self, kind), 0, []
        for name in names:
            n = store[name].shape[1]
            store[name] = base[:, first:first + n]
            views.append(store[name])
            first += n
        self._joined[(kind, *names)] = (base, views)


class Layer:
    """The V-Major state of one attention layer (owned by its V-First processor)."""

    def __init__(self, clock: Clock, settings: Settings) -> None:
        self.clock, self.settings = clock, settings
        self.index = clock.layers
        clock.layers += 1
        self._call = -1
        self._caches: dict[int, _Caches] = {}

    def stopped(self) -> bool:
        """Whether this call runs without V-Major, as V-First alone: auto turned it off for the job
        (the layer's caches are then dropped), or this is one of its timed exact steps (the caches
        are kept: the senders' references still match what the receivers hold)."""
        if self.clock.off and self._caches:
            self._drop_caches()
        return self.clock.off or self.clock.exact_step()

    def _drop_caches(self) -> None:
        self._caches = {}
        self.clock.budget.release(id(self))

    def begin(self, v: torch.Tensor) -> Step:
        """Decide this call's exchanges from V (destination-major ``[W, 1, b, h/W, s, d]``)."""
        clock, settings = self.clock, self.settings
        if clock.call != self._call:  # a new pipeline call: nothing carries over
            self._call = clock.call
            self._drop_caches()
            if self.index == 0:
                need = _cache_bytes(v, settings)
                logger.info(
                    "cocodiff: V-Major caches need %.1f MiB per layer, %.1f MiB for %d layers (budget %g MiB)",
                    need / 2**20, need * clock.layers / 2**20, clock.layers, settings.budget_mib,
                )
        caches = self._caches.get(clock.branch)
        if caches is None or caches.shape != tuple(v.shape):
            if not clock.budget.admit((id(self), clock.branch), _cache_bytes(v, settings), settings.budget_mib):
                if not clock.budget.warned:
                    clock.budget.warned = True
                    logger.warning(
                        "cocodiff: V-Major cache budget (%g MiB, --cocodiff-v-major-budget-mib) reached at layer %d "
                        "of %d; layers beyond it use the exact exchange", settings.budget_mib, self.index, clock.layers,
                    )
                commstats.count_fallback("v-major: cache budget")
                return Step(self, None, None)
            caches = self._caches[clock.branch] = _Caches(tuple(v.shape))
        step, s = clock.step, v.shape[4]
        reference = caches.reference.get("v")
        ranked = None  # policy budget: the tokens by their change, smallest first, measured at every step
        if settings.policy == "budget" and reference is not None:
            share, ranked = _share_needed(_squared_change(v, reference), v, settings.error)
            clock.need(self.index, share)
        k = None if reference is None else self._count(step, s)
        if (
            step < settings.warmup_steps
            or (settings.policy == "budget" and clock.shares_now() is None)  # nothing measured yet
        ):
            k = s
        residual = settings.residual
        if k is not None and residual is not None and sparse.whole_is_smaller(k, s, _row_bytes(v, residual)):
            k = s  # every token, without indices, is no more bytes
        exact = (
            reference is None
            or (settings.refresh_every and step % settings.refresh_every == 0)
            or (k is not None and k >= s and residual is None)  # every token as values: the exact exchange is smaller
        )
        if exact:
            commstats.count_v_major(step, self.index, s, s)
            return Step(self, caches, None)
        if k is not None and k >= s:  # every token, as residuals: in order, so no index travels
            active = torch.arange(s, device=v.device)
        else:
            active = ranked[s - k:] if ranked is not None else self._select(v, reference, k)
        commstats.count_v_major(step, self.index, active.numel(), s)
        return Step(self, caches, active)

    def _count(self, step: int, s: int) -> int | None:
        """How many of its ``s`` tokens this rank sends at ``step``, where the policy fixes it (the
        same on every rank); None for ``threshold``, whose count the data decides."""
        settings = self.settings
        if settings.policy == "top-k":
            return math.ceil(settings.fraction * s)
        if settings.policy == "schedule":
            ramp = max(_total_steps() - settings.warmup_steps, 1)
            cached = settings.final_cached * min((step - settings.warmup_steps + 1) / ramp, 1.0)
            return math.ceil((1.0 - cached) * s)
        shares = self.clock.shares_now() if settings.policy == "budget" else None
        if shares is not None:
            return min(math.ceil(shares[self.index] * s), s)
        return None

    def _select(self, v: torch.Tensor, reference: torch.Tensor, k: int | None) -> torch.Tensor:
        """The active tokens: indices into this rank's tokens (``k`` of them where the policy fixes
        the count, on the device without a host synchronization)."""
        settings = self.settings
        dims = (0, 1, 3, 5)  # all but batch and token
        diff = (v - reference).float()
        if settings.metric == "l1":
            change = diff.abs().mean(dim=dims)
        else:
            norm = torch.linalg.vector_norm(reference.float(), dim=dims)
            change = torch.linalg.vector_norm(diff, dim=dims) / norm.clamp_min(torch.finfo(torch.float32).tiny)
        change = change.amax(0)  # [s]: the largest change over the batch
        if k is None:
            return (change > settings.threshold).nonzero().flatten()
        return change.topk(k).indices


def _squared_change(v: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per token, ``||v - reference||^2`` over everything else (batch included): ``[s]``."""
    return (v - reference).float().square().sum(dim=(0, 1, 2, 3, 5))


def _share_needed(change: torch.Tensor, v: torch.Tensor, error: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest share of tokens whose sending (largest ``change`` first) leaves the relative L2
    error of V as the receivers hold it within ``error`` (a device scalar), and the tokens ranked
    by ``change``, smallest first (the share's tokens are the last ones): the tokens left out are
    the longest prefix whose changes sum within the budget."""
    ordered, ranked = change.sort()
    flat = v.float().flatten()
    left_out = (ordered.cumsum(0) <= flat.dot(flat) * error**2).sum()
    return 1.0 - left_out / change.numel(), ranked


def _row_bytes(v: torch.Tensor, dtype: torch.dtype) -> int:
    """One token's row of V (``[W, 1, b, h/W, s, d]``) for one destination, in ``dtype``."""
    return v.shape[2] * v.shape[3] * v.shape[5] * dtype.itemsize


def _cache_bytes(v: torch.Tensor, settings: Settings) -> int:
    """The receivers' results and the senders' references of V (and of Q, K under scope qkv, and
    the output under qkvo; their references only with residuals)."""
    received = len(settings.scope)  # v: 1, qkv: 3, qkvo: 4
    references = received if settings.residual is not None else 1
    return v.numel() * v.element_size() * (received + references)


def _total_steps() -> int:
    from xfuser.core.distributed import get_runtime_state

    return int(get_runtime_state().input_config.num_inference_steps)


#: The scopes under which each exchange of a layer follows V's decision.
_FOLLOWS = {"v": SCOPES, "qk": ("qkv", "qkvo"), "o": ("qkvo",)}


@dataclass
class Step:
    """One layer call's V-Major decision: exact (``active`` None), or sparse with this rank's
    active tokens.

    ``caches`` None: the layer is outside the budget, nothing is kept.
    """

    layer: Layer
    caches: _Caches | None
    active: torch.Tensor | None
    selection: Any = None  # the active rows and every rank's count, once known (the V exchange)
    # The active tokens of every rank on another node (group rank -> indices), as V's exchange
    # received them: the rows the output exchange sends them under scope qkvo.
    peers: dict = field(default_factory=dict)

    @property
    def v_rides(self) -> bool:
        """Whether V's exchange waits to ride with Q/K's (a sparse step whose Q and K follow V's
        selection). V-First hides V's exchange behind the Q/K projections; at a sparse step that
        exchange is V's few changed rows, and posting them in Q/K's messages saves the layer a
        whole exchange: its latency on every link and its host work."""
        return self.active is not None and self.caches is not None and self.layer.settings.scope in _FOLLOWS["qk"]

    @property
    def fixed(self) -> bool:
        """Whether every rank's count is fixed by the settings and the step (no agreement)."""
        return self.layer.settings.policy != "threshold"

    def covers(self, name: str, x: torch.Tensor) -> bool:
        """Whether the exchange ``name`` ('v', 'qk' or 'o') of ``x`` (destination-major
        ``[W, n, b, h/W, s, d]``) follows this decision."""
        if self.caches is None or self.layer.settings.scope not in _FOLLOWS[name]:
            return False
        return x.shape[4] == self.caches.shape[4] and x.shape[2] == self.caches.shape[2]

    def rows(self, names: tuple[str, ...], x: torch.Tensor) -> tuple[Any, bool]:
        """What the exchange of ``names`` (one, or 'qk' and 'v' riding together at a sparse step)
        in ``x`` (``[W, n, b, h/W, s, d]``, theirs along dim 1) sends over slow links this step, and
        whether it is a residual; updates the references to what the receivers will hold.

        A full step sends everything: the reference becomes ``x``. A sparse one sends the active
        tokens, as values, or as their change since the reference rounded to the residual dtype
        (the rounding error stays in the reference's distance to V, so it is sent later: error
        feedback). The input exchanges send this rank's active tokens to everyone (a tensor,
        ``[W, n, b, h/W, k, d]``); the output exchange ('o') sends each rank on another node its
        own active tokens (a dict, group rank -> ``[n, b, h/W, k_j, d]``).
        """
        caches, residual = self.caches, self.layer.settings.residual
        name = names[0]
        if self.active is None:
            if name == "v" or residual is not None:
                caches.reference[name] = x
            return x, False
        if len(names) > 1 and residual is not None:
            return _changed(x, caches.joined("reference", names), self.selection.active, 4, residual), True
        if len(names) > 1:  # values: only V's reference is kept
            first, sent = 0, []
            for name in names:
                reference = caches.reference.get(name)
                n = caches.received[name].shape[1]
                sent.append(_changed(x[:, first:first + n], reference, self.selection.active, 4, None))
                first += n
            return torch.cat(sent, dim=1), False
        reference = caches.reference.get(name)
        s = x.shape[4]
        if name == "o" and self.peers and all(active.numel() == s for active in self.peers.values()):
            whole = _changed(x, reference, next(iter(self.peers.values())), 4, residual)  # one pass for every peer
            sent = {j: whole[j] for j in self.peers}
        elif name == "o":
            sent = {j: _changed(x[j], None if reference is None else reference[j], active, 3, residual)
                    for j, active in self.peers.items()}
        else:
            sent = _changed(x, reference, self.selection.active, 4, residual)
        return sent, residual is not None


def _changed(x: torch.Tensor, reference: torch.Tensor | None, active: torch.Tensor, dim: int, residual: torch.dtype | None) -> torch.Tensor:
    """The rows ``active`` (along ``dim``) of ``x`` as they travel: their values (``reference``, where
    kept, takes them), or with ``residual`` their change since ``reference`` in that dtype, clamped
    to its range, which ``reference`` adds as the receivers will. Every row goes in order (the
    selection's rule), so then whole tensors stand in for their rows."""
    every = active.numel() == x.shape[dim]
    fresh = x if every else x.index_select(dim, active)
    if residual is None:
        if reference is not None and every:
            reference.copy_(fresh)
        elif reference is not None:
            reference.index_copy_(dim, active, fresh)
        return fresh
    limit = torch.finfo(residual).max  # fp8 has no infinity: out-of-range values would cast to NaN
    change = (fresh - (reference if every else reference.index_select(dim, active))).clamp(-limit, limit).to(residual)
    if every:
        reference.add_(change.to(x.dtype))
    else:
        reference.index_add_(dim, active, change.to(x.dtype))
    return change
