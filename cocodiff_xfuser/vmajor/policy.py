"""V-Major's policy: per layer call, the decision (exact, or sparse with this rank's active tokens)
and the rows each exchange the decision covers sends over slow links."""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import residuals, sparse
from cocodiff_xfuser.settings import SCOPES, Budget, Schedule, Threshold, TopK, VMajorSettings
from cocodiff_xfuser.vmajor import change_kernels, rank_kernels
from cocodiff_xfuser.vmajor.clock import Clock
from cocodiff_xfuser.vmajor.state import Caches, cache_bytes

logger = logging.getLogger("cocodiff_xfuser")


_numbers = itertools.count()
_by_number: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def numbered(number: int) -> Any:
    """The layer (Ulysses or ring) :func:`register` numbered ``number``."""
    return _by_number[number]


def register(layer: Any) -> int:
    """The number trace-time calls (:func:`cocodiff_xfuser.compat.trace_time`), which take no
    Python objects, name ``layer`` by (:func:`numbered`)."""
    number = next(_numbers)
    _by_number[number] = layer
    return number


class Layer:
    """The V-Major state of one attention layer (owned by its V-First processor), whose exchanges
    send the chunks of the group ranks ``crossing`` over slow links (the others are node-mates')."""

    def __init__(self, clock: Clock, settings: VMajorSettings, crossing: tuple[int, ...]) -> None:
        self.clock, self.settings = clock, settings
        #: ``crossing`` as runs of consecutive group ranks, ``(first, last + 1)``: slices of the chunks.
        self.runs = [(run[0], run[-1] + 1) for run in sparse.runs(crossing)]
        self.index = clock.layers
        clock.layers += 1
        #: (branch, V's shape, dtype, device) -> exchange name -> (reference, received): the caches
        #: this layer keeps from call to call where its calls have static shapes (:mod:`.graph`).
        self.buffers: dict[tuple, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        #: How trace-time calls (:func:`cocodiff_xfuser.compat.trace_time`), which take no Python objects, name
        #: this layer (:func:`numbered`).
        self.number = register(self)

    def stopped(self) -> bool:
        """Whether this call runs without V-Major, as V-First alone: auto turned it off for the job
        (the layer's caches are then dropped), or this is one of its timed exact steps (the caches
        are kept: the senders' references still match what the receivers hold)."""
        call = self.clock.current
        if self.clock.off and call is not None:
            call.drop(self.index)
        return self.clock.off or self.clock.exact_step()

    def begin(self, v: torch.Tensor) -> Step:
        """Decide this call's exchanges from V (destination-major ``[W, 1, b, h/W, s, d]``)."""
        clock, settings, call = self.clock, self.settings, self.clock.current
        if call is None:  # the transformer called outside a pipeline call: nothing to keep
            clock.outside_call()
            return Step(self, None, None)
        if self.index == 0 and call.step == 0 and call.branch == 0:
            need = cache_bytes(v, settings)
            logger.info(
                "cocodiff: V-Major caches need %.1f MiB per layer, %.1f MiB for %d layers (budget %g MiB)",
                need / 2**20, need * clock.layers / 2**20, clock.layers, settings.budget_mib,
            )
        key = (self.index, call.branch)
        caches = call.caches.get(key)
        if caches is None or caches.shape != tuple(v.shape):
            if not call.budget.admit(key, cache_bytes(v, settings), settings.budget_mib):
                if not clock.budget_warned:
                    clock.budget_warned = True
                    logger.warning(
                        "cocodiff: V-Major cache budget (%g MiB, --cocodiff-v-major-budget-mib) reached at layer %d "
                        "of %d; layers beyond it use the exact exchange", settings.budget_mib, self.index, clock.layers,
                    )
                commstats.count_fallback("v-major: cache budget")
                return Step(self, None, None)
            caches = call.caches[key] = Caches(tuple(v.shape))
        residual = settings.residual
        # Ranked by the change of the chunks that cross nodes, over all but batch and token (dim 4
        # of [W, 1, b, h/W, s, d]): what the receivers there hold.
        reference = caches.reference.get("v")
        if reference is None and residual is not None and settings.first_step == "residual":
            # The receivers hold nothing yet: every token, as its change since zero (what they hold).
            commstats.count_v_major(call.step, self.index, v.shape[4], v.shape[4])
            selection = sparse.Selection.fixed(torch.arange(v.shape[4], device=v.device), v.shape[0])
        else:
            selection = decide(self, self.crossing(v), None if reference is None else self.crossing(reference), 4,
                               (0, 1, 3, 5), token_bytes(v, residual) if residual else 0, v.shape[0])
        return Step(self, caches, None if selection is None else selection.active, selection)

    def crossing(self, x: torch.Tensor) -> torch.Tensor:
        """The chunks of ``x`` (dim 0) that go to other nodes: a view where they are one run."""
        if len(self.runs) == 1:
            return x[self.runs[0][0]:self.runs[0][1]]
        return torch.cat([x[first:last] for first, last in self.runs])


def decide(layer: Any, x: torch.Tensor, reference: torch.Tensor | None, token_dim: int, select_dims: tuple[int, ...],
           token_bytes: int, world: int) -> sparse.Selection | None:
    """The one V-Major decision of a layer call, Ulysses (:class:`Layer`) or ring
    (:class:`~cocodiff_xfuser.vmajor.ring.RingLayer`), at its clock's current step: None for the
    exact exchange (every token, as values: the first step without residuals, a refresh, or every token being no more
    bytes), else this rank's active tokens of ``x`` along ``token_dim`` (ranked over ``select_dims``),
    as many on each of the ``world`` ranks of its group: fixed by the policy and the step, or, where
    the data decides (threshold, budget), the share its layer needed at an earlier step, agreed over
    the clock (:meth:`Clock.need`). ``token_bytes``: one token's row in the residual dtype.

    The selection is the same on every device for the same data: changes are summed as integers
    and ranked as a stable sort orders them (ties to the lower token index left out first), and no
    value is read on the host."""
    settings, clock, index, rule = layer.settings, layer.clock, layer.index, layer.settings.rule
    step, tokens = clock.current.step, x.shape[token_dim]
    change = ranks = None  # per token: the change the policy ranks by, and its place in their stable ascending order
    if reference is not None and isinstance(rule, (Budget, Threshold)):  # measured at every step, for later ones
        change, share, ranks = measure(rule, x, reference, token_dim, select_dims)
        clock.need(index, share)
    k = None if reference is None else count(settings, clock, index, step, tokens)
    if step < settings.warmup_steps or k is None:
        k = tokens  # warm-up, or nothing measured yet
    residual = settings.residual
    if residual is not None and sparse.whole_is_smaller(k, tokens, token_bytes):
        k = tokens  # every token, without a mask, is no more bytes
    if (
        reference is None
        or (settings.refresh_every and step % settings.refresh_every == 0)
        or (k >= tokens and residual is None)  # every token as values: the exact exchange is smaller
    ):
        commstats.count_v_major(step, index, tokens, tokens)
        return None
    commstats.count_v_major(step, index, k, tokens)
    if k >= tokens:  # every token, as residuals: in order, so no index travels
        return sparse.Selection.fixed(torch.arange(tokens, device=x.device), world)
    if ranks is None:
        change = token_change(rule.metric, x, reference, token_dim, select_dims) if change is None else change
        ranks, _ = rank(change)
    active, mask = top(ranks, k)
    return sparse.Selection.fixed(active, world, mask)


def rank(keys: torch.Tensor, budget: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's place in the stable ascending order of ``keys`` (and the tokens ``budget``
    leaves out: :func:`.rank_kernels.ranks`): one kernel where it runs, the torch reference elsewhere."""
    if rank_kernels.usable(keys):
        commstats.traced("count_kernel", "rank")
    if budget is None:
        return torch.ops.cocodiff_kernels.ranks(keys), None
    return torch.ops.cocodiff_kernels.budget_ranks(keys, *budget)


def top(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` tokens ranked last by ``ranks`` (the largest change), ascending as their mask
    sends them, and that mask: one kernel where it runs, the torch reference elsewhere."""
    if rank_kernels.usable(ranks):
        commstats.traced("count_kernel", "top")
    return torch.ops.cocodiff_kernels.top(ranks, k)


# V-Major's kernels as operators: each runs the Triton kernel where it runs, which a graph traced
# through it holds as its launch, and elsewhere (the CPU's kernel) the torch reference.
@torch.library.triton_op("cocodiff_kernels::ranks", mutates_args=())
def _ranks(keys: torch.Tensor) -> torch.Tensor:
    return rank_kernels.ranks(keys)[0] if rank_kernels.usable(keys) else reference_ranks(keys)[0]


@torch.library.triton_op("cocodiff_kernels::budget_ranks", mutates_args=())
def _budget_ranks(keys: torch.Tensor, norms: torch.Tensor, scale: torch.Tensor, norm_scale: torch.Tensor, bound: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    budget = (norms, scale, norm_scale, bound)
    return rank_kernels.ranks(keys, budget) if rank_kernels.usable(keys) else reference_ranks(keys, budget)


@torch.library.triton_op("cocodiff_kernels::top", mutates_args=())
def _top(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_kernels.top(ranks, k) if rank_kernels.usable(ranks) else reference_top(ranks, k)


@torch.library.triton_op("cocodiff_kernels::change_sums", mutates_args=())
def _change_sums(x: torch.Tensor, reference: torch.Tensor, first: str, second: str, dims: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sums` of the quantities ``first`` and ``second`` as two tensors: their sums (int64
    ``[2, ...]``) and scales (float64 ``[2]``)."""
    if change_kernels.usable(x, reference):
        return change_kernels.sums((first, second), x, reference, tuple(dims))
    found = reference_sums((first, second), x, reference, tuple(dims))
    return torch.stack([sums for sums, _ in found]), torch.stack([scale for _, scale in found])


def count(settings: VMajorSettings, clock: Clock, layer: int, step: int, s: int) -> int | None:
    """How many of its ``s`` tokens a rank sends at ``step`` in ``layer`` (its index on ``clock``):
    fixed by the policy, or the agreed share its layer needed before (None: none yet)."""
    rule = settings.rule
    if isinstance(rule, TopK):
        return math.ceil(rule.fraction * s)
    if isinstance(rule, Schedule):
        ramp = max(_total_steps() - settings.warmup_steps, 1)
        cached = rule.final_cached * min((step - settings.warmup_steps + 1) / ramp, 1.0)
        return math.ceil((1.0 - cached) * s)
    shares = clock.shares_now()
    return None if shares is None else min(math.ceil(shares[layer] * s), s)


def measure(rule: Budget | Threshold, x: torch.Tensor, reference: torch.Tensor, token_dim: int,
            select_dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per token, the change ``rule`` ranks by, the share of tokens it would send now (a device
    scalar), and where it ranked them (budget), each token's place in their stable ascending order
    of change: budget, the fewest tokens (largest squared change first) leaving V's relative L2
    error as the receivers hold it within ``rule.error``; threshold, those whose change exceeds it."""
    if isinstance(rule, Threshold):
        change = token_change(rule.metric, x, reference, token_dim, select_dims)
        bound = rule.threshold**2 if rule.metric == "rel-l2" else rule.threshold
        return change, (change > bound).sum().float() / change.numel(), None
    others = tuple(d for d in range(x.dim()) if d != token_dim)
    # Per token, the squared change and V's squared norm, [s] int64 each, exact.
    (squared, scale), (norms, norm_scale) = _sums(("squared change", "squared value"), x, reference, others)
    ranks, left_out = rank(squared, (norms, scale, norm_scale, rule.error**2))
    return squared, 1.0 - left_out.squeeze(0) / squared.numel(), ranks


def reference_ranks(keys: torch.Tensor, budget: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`.rank_kernels.ranks` as torch computes it: a stable sort, and the budget's running sums."""
    ordered, order = keys.sort(stable=True)
    ranks = torch.empty_like(order).scatter_(0, order, torch.arange(keys.numel(), device=keys.device))
    if budget is None:
        return ranks, None
    norms, scale, norm_scale, bound = budget
    allowed = norms.sum().double() * norm_scale * bound
    return ranks, (ordered.cumsum(0).double() * scale <= allowed).sum().float().reshape(1)


def reference_top(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.rank_kernels.top` as torch computes it."""
    s = ranks.numel()
    order = torch.empty_like(ranks).scatter_(0, ranks, torch.arange(s, device=ranks.device))
    active = order[s - k:].sort().values
    return active, sparse.mask_of(active, s)


def token_change(metric: str, x: torch.Tensor, reference: torch.Tensor, token_dim: int,
                 select_dims: tuple[int, ...]) -> torch.Tensor:
    """Per token along ``token_dim``, its change by ``metric`` over ``select_dims`` (float64 ``[s]``;
    rel-l2 squared, which ranks alike), the largest over the dims left (the batch): the same bits
    on every device."""
    if metric == "l1":
        (sums, scale), _ = _sums(("absolute change", "absolute change"), x, reference, select_dims)
        change = sums.double() * scale / math.prod(x.shape[d] for d in select_dims)  # the mean
    else:
        (sums, scale), (norms, norm_scale) = _sums(("squared change", "squared reference"), x, reference, select_dims)
        change = (sums.double() * scale) / (norms.double() * norm_scale).clamp_min(torch.finfo(torch.float64).tiny)
    left = [d for d in range(x.dim()) if d not in select_dims]
    return change.movedim(left.index(token_dim), -1).reshape(-1, x.shape[token_dim]).amax(0)


def _sums(kinds: tuple[str, str], x: torch.Tensor, reference: torch.Tensor, dims: tuple[int, ...]
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`integer_sums` over ``dims`` of two quantities of ``x`` and ``reference`` (names of
    :data:`.change_kernels.KINDS`): two fused kernels where they run, the torch reference elsewhere."""
    if change_kernels.usable(x, reference):
        commstats.traced("count_kernel", "change sums")
        commstats.traced("count_kernel", "change sums' one scale")
    sums, scales = torch.ops.cocodiff_kernels.change_sums(x, reference, *kinds, list(dims))
    return list(zip(sums.unbind(), scales.unbind()))


def reference_sums(kinds: tuple[str, str], x: torch.Tensor, reference: torch.Tensor, dims: tuple[int, ...]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_sums` as torch computes it (CPU, and what the kernels must match)."""
    diff = x.float() - reference.float()
    values = {"squared change": lambda: diff.square(), "absolute change": lambda: diff.abs(),
              "squared reference": lambda: reference.float().square(), "squared value": lambda: x.float().square()}
    done = {kind: integer_sums(values[kind](), dims) for kind in dict.fromkeys(kinds)}
    return [done[kind] for kind in kinds]


def integer_sums(t: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over ``dims`` of ``t`` (float32, >= 0) in fixed point, and the scale that makes them
    values (int64 sums, float64 scalar), the same bits in any order of summation: each sum's
    elements at a power-of-two scale of their own (:func:`own_scale_sums`), then every sum brought
    to the scale of the one with the largest element (:func:`one_scale`). One pass over ``t`` on a
    device. Every element sits below ``2**62 / t.numel()`` at its scale: no sum of the sums overflows."""
    top = 62 - t.numel().bit_length()
    return one_scale(*own_scale_sums(t, dims, top), top)


def own_scale_sums(t: torch.Tensor, dims: tuple[int, ...], top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sum over ``dims`` of ``t``: its elements floored to integers at ``2**(top - e)`` and
    summed (int64), and ``e`` (int64), the exponent its largest element is below."""
    own = _exponent(t.amax(dims, keepdim=True))
    return torch.floor(t.double() * _pow2(top - own)).long().sum(dims), own.squeeze(dims)


def one_scale(sums: torch.Tensor, exponents: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`own_scale_sums`' sums at the scale of the one with the largest exponent (a right
    shift, a floor), and that scale."""
    exponent = exponents.max()
    return sums >> (exponent - exponents).clamp(max=63), _pow2(exponent - top)


def _exponent(t: torch.Tensor) -> torch.Tensor:
    """Per element of ``t`` (float32, >= 0), the ``e`` (int64) with ``t < 2**e``, from its bits (its
    exponent field - 126; zero and subnormals take the smallest): every device agrees."""
    return ((t.view(torch.int32) >> 23) & 0xFF).long() - 126


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` (float64, ``e`` int64 in [-1022, 1023]) from its bits: exact everywhere."""
    return ((e + 1023) << 52).view(torch.float64)


def token_bytes(v: torch.Tensor, dtype: torch.dtype) -> int:
    """One token's row of V (``[W, 1, b, h/W, s, d]``) for one destination, as a residual in ``dtype``."""
    return v.shape[2] * v.shape[3] * residuals.row_bytes(v.shape[5], dtype)


def _total_steps() -> int:
    from xfuser.core.distributed import get_runtime_state

    return int(get_runtime_state().input_config.num_inference_steps)


#: The scopes under which each exchange of a layer follows V's decision.
_FOLLOWS = {"v": SCOPES, "qk": ("qkv", "qkvo"), "o": ("qkvo",)}


@dataclass(frozen=True)
class Step:
    """One layer call's V-Major decision, made once and never changed: exact (``active`` None), or
    sparse with this rank's active tokens and every rank's count (``selection``).

    ``caches`` None: the layer is outside the budget, nothing is kept. What the exchanges learn
    (the other nodes' active tokens, from V's) goes to the layer's caches, not here.
    """

    layer: Layer
    caches: Caches | None
    active: torch.Tensor | None
    selection: sparse.Selection | None = None

    @property
    def v_rides(self) -> bool:
        """Whether V's exchange waits to ride with Q/K's (a sparse step whose Q and K follow V's
        selection). V-First hides V's exchange behind the Q/K projections; at a sparse step that
        exchange is V's few changed rows, and posting them in Q/K's messages saves the layer a
        whole exchange: its latency on every link and its host work."""
        return self.active is not None and self.caches is not None and self.layer.settings.scope in _FOLLOWS["qk"]

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
        feedback). Either way to each rank on another node (group rank -> ``[n, b, h/W, k, d']``,
        ``d'`` = ``d``, or int4's bytes per row): the input exchanges this rank's active tokens, the
        output exchange ('o') that rank's own active tokens.
        """
        caches, residual = self.caches, self.layer.settings.residual
        name = names[0]
        if self.active is None:
            if name == "v" or residual is not None:
                caches.reference[name] = x
            return x, False
        active = self.selection.active
        if residual is not None:
            caches.start_from_zero(names, x)
        if len(names) > 1 and residual is not None:
            return self._encode_crossing(x, caches.joined("reference", names), active, residual), True
        if len(names) > 1:  # values: only V's reference is kept
            first, parts = 0, []
            for name in names:
                n = caches.received[name].shape[1]
                parts.append(self._encode_crossing(x[:, first:first + n], caches.reference.get(name), active, None))
                first += n
            return {j: torch.cat([part[j] for part in parts]) for j in parts[0]}, False
        reference = caches.reference.get(name)
        peers = caches.peers
        if name == "o" and peers and all(rows.numel() == x.shape[4] for rows in peers.values()):
            sent = self._encode_crossing(x, reference, next(iter(peers.values())), residual)  # every token of every peer
        elif name == "o":
            sent = {j: residuals.encode(x[j], None if reference is None else reference[j], rows, 3, residual)
                    for j, rows in peers.items()}
        else:
            sent = self._encode_crossing(x, reference, active, residual)
        return sent, residual is not None

    def _encode_crossing(self, x: torch.Tensor, reference: torch.Tensor | None, rows: torch.Tensor,
                  residual: torch.dtype | None) -> dict[int, torch.Tensor]:
        """The rows ``rows`` of ``x`` (``[W, n, b, h/W, s, d]``) that go to the ranks on other nodes,
        encoded per run of consecutive ones (one launch each; views, no copies): group rank ->
        ``[n, b, h/W, k, d']``. Node-mates get exact chunks, so their rows are not encoded and
        their chunks of the reference are not kept."""
        sent: dict[int, torch.Tensor] = {}
        for first, last in self.layer.runs:
            part = residuals.encode(x[first:last], None if reference is None else reference[first:last], rows, 4, residual)
            sent.update(zip(range(first, last), part.unbind(0)))
        return sent
