"""V-Major's clock: the denoising step of a transformer, the counts its layers agree once per step
(policy budget), and auto's speed check on whole steps."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from cocodiff_xfuser import commstats, padding
from cocodiff_xfuser.comm import timing, transport
from cocodiff_xfuser.comm.agreement import agree
from cocodiff_xfuser.settings import VMajorSettings
from cocodiff_xfuser.vmajor.state import Budget

logger = logging.getLogger("cocodiff_xfuser")


#: Rounds of auto's speed check, each one step per way of running a step (:class:`Trial`).
TRIAL_ROUNDS = 3
#: The ways auto's speed check runs steps: with V-Major; as V-First alone (exact exchanges, no
#: selection); with xfuser's own attention processors over cocodiff's exchange (exact too).
ARMS = ("v-major", "v-first", "stock")
#: What a V-First processor's call on a stock step counts as (:func:`cocodiff_xfuser.commstats.ran`'s fall-backs).
STOCK_STEP = "stock processors' step (auto)"


#: Not there: a scheduler without a step index, the call before a call's first transformer call.
_MISSING = object()


class Trial:
    """Auto's speed check: which way of running this job's steps is fastest, measured on whole steps.

    From step ``first`` (the end of the warm-up) of a pipeline call, ``TRIAL_ROUNDS`` rounds each
    run one step per arm of ``arms`` (:data:`ARMS`, or without ``stock`` where the model needs
    cocodiff's processors), the order rotated round by round so that every arm takes every place
    once and a drift hits all alike, like the autotune's paired timings. The exact arms touch no
    cache: the next sparse step's residuals are still against what the receivers hold. A step's
    time runs from its first transformer call to the next step's, the device synchronized at both
    ends, and counts everything an arm adds or saves (selection, residuals, caches, V's early
    exchange competing with the Q/K projections for the cores). Each step's time is the MAX over
    the group (one all-reduce, so every rank takes the same decision).

    V-Major is lossy, so it stays on only with evidence that it pays, as the autotune leaves the
    flat exchange: against each exact arm, the distribution-free upper bound of the median of the
    rounds' ratios (V-Major / that arm; with three rounds, the largest) is below 1. A tie within
    the timing noise turns it off. Between the exact arms, which give the same image bitwise, the
    median ratio picks (a tie keeps V-First). A pipeline call too short for the trial leaves it to
    the next one.
    """

    def __init__(self, first: int, arms: tuple[str, ...] = ARMS) -> None:
        self.first, self.arms = first, arms
        self.times: list[float] = []  # the trial's steps so far, in step order
        self._started: float | None = None

    def arm(self, step: int) -> str | None:
        """The arm ``step`` runs (None: outside the trial)."""
        i = step - self.first
        if not 0 <= i < len(self.arms) * TRIAL_ROUNDS:
            return None
        round_, place = divmod(i, len(self.arms))
        return self.arms[(place + round_) % len(self.arms)]

    def restart(self) -> None:
        self.times, self._started = [], None

    def at_step(self, step: int, device: torch.device, group: Any) -> str | None:
        """At the start of ``step`` (every rank, the same steps): time the step that ended, and once
        all of the trial's have, decide: the arm the job runs from now on (None: not decided)."""
        last = self.first + len(self.arms) * TRIAL_ROUNDS
        if not self.first <= step <= last:
            return None
        stamp = timing.now(device)
        if self._started is not None:
            self.times.append(stamp - self._started)
        self._started = stamp
        if step < last:
            return None
        by_arm: dict[str, list[float]] = {arm: [] for arm in self.arms}  # round by round
        for i, seconds in enumerate(timing.slowest(self.times, group, device)):
            by_arm[self.arm(self.first + i)].append(seconds)
        return self._decide(by_arm)

    def _decide(self, by_arm: dict[str, list[float]]) -> str:
        exact = [arm for arm in self.arms if arm != "v-major"]
        sparse = {arm: timing.paired_ratios(by_arm, arm)["v-major"] for arm in exact}
        ratio = max(statistics.median(r) for r in sparse.values())
        bound = max(timing.median_upper_bound(r) for r in sparse.values())
        if bound < 1.0:
            logger.info("cocodiff: V-Major's steps took %.2fx exact steps' time (at most %.2fx); V-Major stays on", ratio, bound)
            return "v-major"
        logger.warning("cocodiff: V-Major off: its steps took %.2fx exact steps' time (up to %.2fx): not faster beyond "
                       "the timing noise (the links are not the bottleneck)", ratio, bound)
        commstats.count_fallback("v-major: steps not faster than exact steps")
        if "stock" not in exact:
            return "v-first"
        v_first = statistics.median(timing.paired_ratios(by_arm, "stock")["v-first"])
        if v_first <= 1.0:
            logger.info("cocodiff: V-First's steps took %.2fx stock processors' time; V-First stays on", v_first)
            return "v-first"
        logger.warning("cocodiff: V-First off: its steps took %.2fx the stock processors' time over cocodiff's exchange "
                       "(V's early exchange does not hide here); stock processors from now on", v_first)
        commstats.count_fallback("v-first: steps not faster than stock processors' steps")
        return "stock"


class Call:
    """One pipeline call's V-Major state, opened at the pipeline's entry and dropped when the call
    returns (:meth:`Clock.open`, :meth:`Clock.close`): where the call is (step, branch), every
    layer's caches and the budget they are held against, and the shares its layers agree (policy
    budget). Nothing of one call reaches the next: a request served after others starts as it
    would in a fresh process."""

    def __init__(self, scheduler: Any = None) -> None:
        self.step = 0
        self.branch = 0
        self.scheduler = scheduler  # the pipeline's, whose step index tells the steps apart (None: the timesteps do)
        self._last: Any = _MISSING  # the step key of the transformer call before
        # (layer index on the clock, branch) -> that layer's caches (a Ulysses layer's or a ring layer's).
        self.caches: dict[tuple[int, int], Any] = {}
        self.budget = Budget()
        # Policy budget: per layer, the share of tokens the current step sends (agreed; None: not
        # yet measured, the exchange is exact), and what the layers measured during this step.
        self.shares: list[float] | None = None
        self.needed: list[tuple[int, torch.Tensor]] = []
        self.agreeing: tuple[Any, torch.Tensor] | None = None  # an all-reduce in flight, and its tensor

    def tick(self, timestep: Any) -> bool:
        """A transformer call at ``timestep``: in the same step as the call before, another branch of
        the step (true CFG's second); in another step, the next one (True). The step is told by the
        scheduler's step index where it keeps one (a host integer that its ``step`` advances, once
        per step in xfuser's patch mode too), else by the timestep's value (read from the device: a
        synchronization per transformer call on a GPU)."""
        key = getattr(self.scheduler, "step_index", _MISSING)
        if key is _MISSING:
            key = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
        last, self._last = self._last, key
        if last is _MISSING:
            return False
        if key == last:
            self.branch += 1
            return False
        self.step, self.branch = self.step + 1, 0
        return True

    def drop(self, layer: int) -> None:
        """Free ``layer``'s caches (every branch)."""
        for key in [k for k in self.caches if k[0] == layer]:
            del self.caches[key]
        self.budget.release(layer)

    def agree_shares(self, layers: int, group: Any) -> None:
        """Agree the shares the layers measured during the step that ended (MAX over ``group``),
        without waiting: one all-reduce per step, launched here and read at the next step's tick
        (a step's counts come from the measurements of two steps before, the first sparse step's
        from the step before), so no step waits for the others' measurements and, on a GPU, the
        host reads a result its queue has long passed. Whether it runs depends on the steps and
        the layers that ran, the same on every rank."""
        self.take_shares()
        if not self.needed:
            return
        indices, shares = zip(*self.needed)
        device = shares[0].device
        needed = torch.zeros(layers, dtype=torch.float32, device=device).index_reduce_(
            0, torch.tensor(indices, device=device), torch.stack(shares).float(), "amax")
        transport.launched(group, "all_reduce")
        work = dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self.agreeing, self.needed = (work, needed), []

    def take_shares(self) -> None:
        if self.agreeing is not None:
            work, needed = self.agreeing
            work.wait()
            self.shares, self.agreeing = needed.tolist(), None

    def settle(self) -> None:
        """Complete the agreement in flight (after a transformer call: it has had the whole call to
        finish, and nothing is left in flight when the call ends)."""
        if self.agreeing is not None:
            self.agreeing[0].wait()


class Clock:
    """The V-Major clock of one transformer: its layers, the pipeline call in progress
    (:attr:`current`, a :class:`Call`), and what holds for the whole job (auto's decision).

    Within a call, a transformer call at the same timestep as the one before is another branch of
    the step (true CFG's second), at another timestep the next step. A transformer called outside a
    pipeline call (no :attr:`current`) exchanges exactly.
    """

    def __init__(self, group: Any = None, trial_from: int | None = None, arms: tuple[str, ...] = ARMS,
                 settings: VMajorSettings | None = None, padded: padding.Padding | None = None) -> None:
        self.layers = 0  # V-Major layers attached to this clock (Ulysses and ring)
        self.settings = settings  # its layers' (the warm-up and refresh steps of :attr:`phase`)
        self.cache_bytes = 0  # what the layers with static shapes keep (:mod:`.graph`), against their budget
        #: The step's kind for layers with static shapes (:mod:`.graph`), fixed at its tick, all a
        #: compiled graph reads of the step (so a handful of graphs): ``outside`` a pipeline call,
        #: the ``first`` step (the caches made), ``exact`` (a refresh), a ``whole`` warm-up step
        #: (every token), or ``sparse``.
        self.phase = "outside"
        self.group = group  # the group the layers' shares are agreed over (policy budget)
        self.current: Call | None = None
        self.calls = 0  # pipeline calls opened so far
        self.budget_warned = False  # the one log line for the job
        self._outside_warned = False
        self._layers_agreed = False
        # Auto's speed check from step ``trial_from`` over ``arms`` (None: none), until it decides;
        # ``off``: it found V-Major's steps not faster, and every exchange is exact for the rest of
        # the job; ``stock``: it found V-First's not faster either, and xfuser's processors take over.
        self.trial = None if trial_from is None else Trial(trial_from, arms)
        self.off = self.stock = False
        #: Whether the transformer call under way runs xfuser's processors (:meth:`stock_step`, fixed
        #: at its tick): all a compiled graph reads of auto's choice, one bool, so two graphs at
        #: most, both traced in the first pipeline call (the trial's).
        self.to_stock = False
        #: The V-First processors on this clock, each called once per transformer call (all of them
        #: count as handed to stock at a stock step, a processor that falls back for its own reason too).
        self.processors = 0
        #: The job's padding, whose forwards that pad tokens keep V-First at a stock step.
        self.padding = padding.Padding() if padded is None else padded

    def open(self, scheduler: Any = None) -> Call:
        """A pipeline call starts (``scheduler``: the pipeline's): its own state, nothing carried over
        from the last."""
        self.close()
        self.current, self.calls = Call(scheduler), self.calls + 1
        if self.trial is not None:
            self.trial.restart()
        return self.current

    def close(self) -> None:
        """The pipeline call ended (returned or raised): its agreement completed, its caches freed."""
        call, self.current = self.current, None
        if call is not None:
            call.settle()

    def tick(self, timestep: Any) -> None:
        """A transformer call starts at ``timestep``: where the pipeline call is, and what its graphs
        read of it (:attr:`phase`, :attr:`to_stock`). Runs on the host per transformer call, so its
        steady state is a few calls: the agreement and the trial only where they are under way."""
        call = self.current
        if call is not None and call.tick(timestep):
            if call.needed or call.agreeing is not None:
                self._agree(call)
            if self.trial is not None:
                self._time_trial(call, timestep)
        self.phase = self._phase()
        self.to_stock = self.stock or (self.trial is not None and self.stock_step())
        if self.to_stock:
            self.padding.clear_padded()  # a forward that pads tokens keeps V-First at a stock step (after_call)

    def _agree(self, call: Call) -> None:
        if call.needed and not self._layers_agreed:
            # The layers size the shares' all-reduce (ring layers join in the first call): agreed
            # once, before its first launch (which the same steps and layers launch on every rank).
            agree(self.layers, "the number of layers carrying V-Major", self.agreement_group())
            self._layers_agreed = True
        call.agree_shares(self.layers, self.agreement_group())

    def _time_trial(self, call: Call, timestep: Any) -> None:
        device = timestep.device if isinstance(timestep, torch.Tensor) else torch.device("cpu")
        arm = self.trial.at_step(call.step, device, self.agreement_group())
        if arm is not None:
            self.trial, self.off, self.stock = None, arm != "v-major", arm == "stock"

    def _phase(self) -> str:
        call = self.current
        if call is None:
            return "outside"
        if call.step == 0:
            return "first"
        settings = self.settings
        if settings is not None and settings.refresh_every and call.step % settings.refresh_every == 0:
            return "exact"
        return "whole" if settings is not None and call.step < settings.warmup_steps else "sparse"

    def outside_call(self) -> None:
        """A V-Major layer ran with no pipeline call open (its transformer called by a loop of the
        user's own, not through ``pipe(...)``): it exchanges exactly; counted, and said once."""
        commstats.count_fallback("v-major: outside a pipeline call")
        if not self._outside_warned:
            self._outside_warned = True
            logger.warning("cocodiff: V-Major keeps its state per pipeline call (pipe(...)); this transformer is called "
                           "outside one, so its exchanges are exact")

    def agreement_group(self) -> Any:
        """The group the clock's agreements run over: the given one, or WORLD where none was given
        (looked up when used: a clock can be built before the process group)."""
        return self.group if self.group is not None else dist.group.WORLD

    def exact_step(self) -> bool:
        """Whether this step runs without V-Major (one of auto's timed exact steps)."""
        return self.trial is not None and self.current is not None and self.trial.arm(self.current.step) not in (None, "v-major")

    def stock_step(self) -> bool:
        """Whether this step's attention runs xfuser's processors over cocodiff's exchange (auto found
        V-First not faster, or this is one of its timed stock steps)."""
        return self.stock or (self.trial is not None and self.current is not None and self.trial.arm(self.current.step) == "stock")

    def need(self, layer: int, share: torch.Tensor) -> None:
        """Layer ``layer`` needs to send ``share`` (a device scalar) of its tokens to meet its budget
        (the largest of a step's calls counts; gathered once per step, in :meth:`Call.agree_shares`)."""
        self.current.needed.append((layer, share))

    def shares_now(self) -> list[float] | None:
        """The agreed shares for this step; the first time there are any, waits for their agreement."""
        call = self.current
        if call.shares is None:
            call.take_shares()
        return call.shares

    def before_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The transformer's pre-hook: :meth:`tick` at its ``timestep``."""
        timestep = kwargs.get("timestep")
        if timestep is None:
            raise ValueError(f"cocodiff: V-Major needs {type(module).__name__} to be called with timestep=...")
        self.tick(timestep)

    def after_call(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        """The transformer's hook, after its call: its agreement completed, and its processors' calls
        counted where they ran xfuser's (here, not in the processors: a compiled graph counts nothing)."""
        if self.to_stock and not self.padding.tokens_were_padded():
            commstats.count_fallback(f"v-first: {STOCK_STEP}", self.processors)
        call = self.current
        if call is not None and call.agreeing is not None:
            call.settle()


def attach_clock(
    transformer: torch.nn.Module, group: Any = None, settings: VMajorSettings | None = None, stock: bool = True,
    padded: padding.Padding | None = None,
) -> tuple[Clock, list[RemovableHandle]]:
    """A :class:`Clock` ticked before every call of ``transformer`` (its ``timestep`` argument) and
    settled after it, and the two hooks that do it; ``group``: the Ulysses group of its V-Major
    layers; ``settings``: theirs (auto, unless ``if_slower: keep``, times its steps against exact
    ones: V-First's and, with ``stock``, xfuser's processors'); ``padded``: the job's padding."""
    trial = settings is not None and settings.min_psnr_db is not None and settings.if_slower == "stop"
    arms = ARMS if stock else tuple(arm for arm in ARMS if arm != "stock")
    clock = Clock(group, max(settings.warmup_steps, 1) if trial else None, arms, settings, padded)
    # Compiled, the hooks run on the host between the transformer's graphs, never traced.
    hooks = [transformer.register_forward_pre_hook(torch.compiler.disable(clock.before_call), with_kwargs=True),
             transformer.register_forward_hook(torch.compiler.disable(clock.after_call))]
    return clock, hooks
