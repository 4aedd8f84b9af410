"""The routes of one Ulysses group's exact exchanges: one per (label, what fixes its size), chosen once.

Every exact Ulysses exchange of a job asks its route here: the algorithm that carries it, how to
start it (the exchanger's handles, :meth:`Router.route`) or the groups a compiled graph names (the
functional collectives of a traced layer, and the same code run eagerly, :meth:`Router.traced`), and
its slow-link bytes, sent and exact. The choice is the autotune's (:mod:`cocodiff_xfuser.comm.autotune`)
among the registry's candidates that can carry it, for a traced exchange among those a graph holds
(:attr:`~cocodiff_xfuser.comm.autotune.Algorithm.traced`), each timed as it runs: ``--cocodiff-a2a
auto`` weighs the same candidates by the same rule wherever a layer's exchange runs. A route is kept
once the choice is final, so a denoising loop decides nothing per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from cocodiff_xfuser.comm import transport
from cocodiff_xfuser.comm.autotune import AutoAllToAll
from cocodiff_xfuser.comm.flat import AllToAllHandle

T = TypeVar("T")


@dataclass(frozen=True)
class Route:
    """What an exact exchange of one (label, shape, dtype) decides: its algorithm, how to start it (the
    hierarchical exchange's pipeline parts bound), its slow-link bytes, sent and exact, and where it runs
    (for the fault line)."""

    algorithm: str
    parts: int
    start: Callable[..., AllToAllHandle]
    slow_bytes: int
    exact_bytes: int
    where: str


class Router:
    """The routes of the exchanges over ``group``: ``levels`` and ``level_groups`` (names) are its
    topology levels' (TAPA's; empty without); ``share``, the part of an exchange this rank sends to
    other nodes; ``finish`` runs a step under the exchanger's fault handling; ``settle`` completes
    the exchanges in flight before a measurement shares the links with them."""

    def __init__(self, group: Any, autotune: AutoAllToAll, share: float, levels: tuple[int, ...], level_groups: tuple[str, ...],
                 where: str, finish: Callable[..., Any], settle: Callable[[], None]) -> None:
        self.group, self.autotune, self._share = group, autotune, share
        self._levels, self._level_groups, self._where = levels, level_groups, where
        self._finish, self._settle = finish, settle
        self._routes: dict[tuple, Route] = {}
        self._traced: dict[tuple, tuple] = {}

    def route(self, key: tuple, payload: Callable[[], torch.Tensor], exact_bytes: Callable[[], int]) -> Route:
        """The route of the exchange ``key`` names (its label first, then what fixes its size: shapes,
        dtype, device) through the exchanger's handles. Only where it is not kept yet: ``payload()``
        makes the flat payload to choose with, ``exact_bytes()`` gives its size uncompressed, on the wire."""
        route = self._routes.get(key)
        if route is None:
            route = self._finish(lambda: self._new_route(key, payload(), exact_bytes()), key[0], "autotune")
        return route

    def _new_route(self, key: tuple, x: torch.Tensor, exact_bytes: int) -> Route:
        autotune, group = self.autotune, self.group
        if autotune.measures(x, group):
            self._settle()
        algorithm = autotune.choose(x, group)
        parts = autotune.parts(x, group) if algorithm == "hierarchical" else 1
        route = Route(algorithm, parts, autotune.starter(algorithm, x, group), int(transport.wire_bytes(x) * self._share),
                      int(exact_bytes * self._share), f"{algorithm} over {self._where}")
        if autotune.settled(x, group):
            self._routes[key] = route
        return route

    def traced(self, label: str, shape: tuple[int, ...], dtype: str, device: str, exact_bytes: int) -> tuple:
        """The route of a traced exchange (:mod:`cocodiff_xfuser.ulysses_collectives`) of a payload of
        ``shape`` (``[W, c]``), ``dtype`` and ``device`` (named as ``str`` names them) that stands for
        ``exact_bytes`` uncompressed: ``(algorithm, levels, group names, slow-link bytes, their
        exact count)``, one group for the flat exchange, one per level for TAPA's. Decided when the
        graph is traced, once per size (collective where ``--cocodiff-a2a auto`` measures, each
        candidate as the graph runs it); eagerly, the same route for the same code, looked up per call."""
        key = (shape, dtype, device, exact_bytes)
        route = self._traced.get(key)
        if route is None:
            torch_dtype = getattr(torch, dtype.removeprefix("torch."))
            algorithm = self._finish(lambda: self._choose_traced(shape, torch_dtype, device), label, "autotune")
            levels, groups = (self._levels, self._level_groups) if algorithm == "hierarchical" else ((), (self.group.group_name,))
            route = self._traced[key] = (algorithm, levels, groups, int(math.prod(shape) * torch_dtype.itemsize * self._share),
                                         int(exact_bytes * self._share))
        return route

    def _choose_traced(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> str:
        autotune, group = self.autotune, self.group
        probe = torch.empty(1, dtype=dtype, device=device).expand(math.prod(shape))  # its size is what the choice reads
        if autotune.measures(probe, group, traced=True):
            self._settle()
            probe = torch.zeros(math.prod(shape), dtype=dtype, device=device)  # a real buffer to measure with
        return autotune.choose(probe, group, traced=True)
