"""V-Major's policy: per layer call, the decision (exact, or sparse with this rank's active tokens)
and the rows each exchange the decision covers sends over slow links."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import residuals, sparse
from cocodiff_xfuser.settings import SCOPES, Budget, Schedule, Threshold, TopK, VMajorSettings
from cocodiff_xfuser.vmajor.clock import Clock
from cocodiff_xfuser.vmajor.state import Caches, cache_bytes

logger = logging.getLogger("cocodiff_xfuser")


class Layer:
    """The V-Major state of one attention layer (owned by its V-First processor), whose exchanges run
    over the Ulysses ``group`` (where a threshold's counts are agreed: the clock's group is the world
    where the ring crosses nodes too, and a sparse exchange reads counts by Ulysses-group rank)."""

    def __init__(self, clock: Clock, settings: VMajorSettings, group: Any = None) -> None:
        self.clock, self.settings, self.group = clock, settings, group
        self.index = clock.layers
        clock.layers += 1

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
        # Ranked by change over all but batch and token (dim 4 of [W, 1, b, h/W, s, d]).
        selection = decide(self, v, caches.reference.get("v"), 4, (0, 1, 3, 5), _row_bytes(v, residual) if residual else 0,
                           self.group if self.group is not None else clock.agreement_group(), v.shape[0])
        return Step(self, caches, None if selection is None else selection.active, selection)


def decide(layer: Any, x: torch.Tensor, reference: torch.Tensor | None, token_dim: int, select_dims: tuple[int, ...],
           token_bytes: int, group: Any, world: int) -> sparse.Selection | None:
    """The one V-Major decision of a layer call, Ulysses (:class:`Layer`) or ring
    (:class:`~cocodiff_xfuser.vmajor.ring.RingLayer`), at its clock's current step: None for the
    exact exchange (every token, as values: the first step, a refresh, or every token being no more
    bytes), else this rank's active tokens of ``x`` along ``token_dim`` (ranked over ``select_dims``)
    and every rank's count over ``group`` of ``world`` ranks: fixed by the policy and the step, or
    (threshold) agreed here, at V's or the ring's exchange, the same program point on every rank
    (the layer's other exchanges reuse it). ``token_bytes``: one token's row in the residual dtype."""
    settings, clock, index = layer.settings, layer.clock, layer.index
    step, tokens = clock.current.step, x.shape[token_dim]
    ranked = None  # policy budget: the tokens by their change, smallest first, measured at every step
    if isinstance(settings.rule, Budget) and reference is not None:
        share, ranked = share_needed(squared_change(x, reference, token_dim), x, settings.rule.error)
        clock.need(index, share)
    k = None if reference is None else count(settings, clock, index, step, tokens)
    if step < settings.warmup_steps or (isinstance(settings.rule, Budget) and clock.shares_now() is None):
        k = tokens  # warm-up, or nothing measured yet
    residual = settings.residual
    if k is not None and residual is not None and sparse.whole_is_smaller(k, tokens, token_bytes):
        k = tokens  # every token, without indices, is no more bytes
    if (
        reference is None
        or (settings.refresh_every and step % settings.refresh_every == 0)
        or (k is not None and k >= tokens and residual is None)  # every token as values: the exact exchange is smaller
    ):
        commstats.count_v_major(step, index, tokens, tokens)
        return None
    if k is not None and k >= tokens:  # every token, as residuals: in order, so no index travels
        active = torch.arange(tokens, device=x.device)
    else:
        active = ranked[tokens - k:] if ranked is not None else select(settings.rule, x, reference, k, dims=select_dims)
    commstats.count_v_major(step, index, active.numel(), tokens)
    if isinstance(settings.rule, Threshold):
        return sparse.agree_counts(active, group)
    return sparse.Selection.fixed(active, world)



def count(settings: VMajorSettings, clock: Clock, layer: int, step: int, s: int) -> int | None:
    """How many of its ``s`` tokens a rank sends at ``step`` in ``layer`` (its index on ``clock``),
    where the policy fixes it (the same on every rank); None for ``threshold``, whose count the data
    decides."""
    rule = settings.rule
    if isinstance(rule, TopK):
        return math.ceil(rule.fraction * s)
    if isinstance(rule, Schedule):
        ramp = max(_total_steps() - settings.warmup_steps, 1)
        cached = rule.final_cached * min((step - settings.warmup_steps + 1) / ramp, 1.0)
        return math.ceil((1.0 - cached) * s)
    shares = clock.shares_now() if isinstance(rule, Budget) else None
    if shares is not None:
        return min(math.ceil(shares[layer] * s), s)
    return None


def select(rule: Any, x: torch.Tensor, reference: torch.Tensor, k: int | None, dims: tuple[int, ...]) -> torch.Tensor:
    """The active tokens of the policies that rank by a metric (threshold, top-k, schedule): indices
    into the last dim left after reducing ``dims`` (``k`` of them where the policy fixes the count,
    on the device without a host synchronization); a token's change is its largest over the dims
    left (the batch)."""
    diff = (x - reference).float()
    if rule.metric == "l1":
        change = diff.abs().mean(dim=dims)
    else:
        norm = torch.linalg.vector_norm(reference.float(), dim=dims)
        change = torch.linalg.vector_norm(diff, dim=dims) / norm.clamp_min(torch.finfo(torch.float32).tiny)
    change = change.reshape(-1, change.shape[-1]).amax(0)  # [s]
    if k is None:
        return (change > rule.threshold).nonzero().flatten()
    return change.topk(k).indices


def squared_change(v: torch.Tensor, reference: torch.Tensor, token_dim: int = 4) -> torch.Tensor:
    """Per token (along ``token_dim``), ``||v - reference||^2`` over everything else (batch included): ``[s]``."""
    return (v - reference).float().square().sum(dim=tuple(d for d in range(v.dim()) if d != token_dim))


def share_needed(change: torch.Tensor, v: torch.Tensor, error: float) -> tuple[torch.Tensor, torch.Tensor]:
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
            return residuals.encode(x, caches.joined("reference", names), self.selection.active, 4, residual), True
        if len(names) > 1:  # values: only V's reference is kept
            first, sent = 0, []
            for name in names:
                reference = caches.reference.get(name)
                n = caches.received[name].shape[1]
                sent.append(residuals.encode(x[:, first:first + n], reference, self.selection.active, 4, None))
                first += n
            return torch.cat(sent, dim=1), False
        reference = caches.reference.get(name)
        s = x.shape[4]
        peers = caches.peers
        if name == "o" and peers and all(active.numel() == s for active in peers.values()):
            whole = residuals.encode(x, reference, next(iter(peers.values())), 4, residual)  # one pass for every peer
            sent = {j: whole[j] for j in peers}
        elif name == "o":
            sent = {j: residuals.encode(x[j], None if reference is None else reference[j], active, 3, residual)
                    for j, active in peers.items()}
        else:
            sent = residuals.encode(x, reference, self.selection.active, 4, residual)
        return sent, residual is not None
