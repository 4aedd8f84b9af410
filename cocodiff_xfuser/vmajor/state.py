"""V-Major's state: each layer's caches (the senders' references and the receivers' results) and
the bound on what they hold together."""

from __future__ import annotations

import torch

from cocodiff_xfuser.settings import VMajorSettings


class Budget:
    """Cache bytes held per (layer, branch) in one pipeline call of one transformer, against ``budget_mib``."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}

    def admit(self, key: tuple[int, int], nbytes: int, budget_mib: float) -> bool:
        self.held.pop(key, None)
        if sum(self.held.values()) + nbytes > budget_mib * 2**20:
            return False
        self.held[key] = nbytes
        return True

    def release(self, layer: int) -> None:
        for key in [k for k in self.held if k[0] == layer]:
            del self.held[key]


#: The planes each exchange carries along dim 1: Q and K packed together, V, the output.
PLANES = {"qk": 2, "v": 1, "o": 1}


class Caches:
    """One layer's caches for one branch of a pipeline call: the sender's reference, the receivers' results."""

    def __init__(self, shape: tuple) -> None:
        self.shape = shape
        # Exchange name ('v', 'qk', 'o') -> the input as the receivers on other nodes hold it
        # (destination-major; 'qk' and 'o' only with residuals), and the last result on this rank.
        self.reference: dict[str, torch.Tensor] = {}
        self.received: dict[str, torch.Tensor] = {}
        # The active tokens of every rank on another node (group rank -> indices), as V's exchange
        # at this step learned them: the rows the output exchange sends them under scope qkvo.
        self.peers: dict[int, torch.Tensor] = {}
        # (kind, names exchanged together) -> one tensor along dim 1 and the views of it kept as
        # their entries, so a layer whose V rides with Q/K every step joins them without a copy.
        self._joined: dict[tuple[str, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def start_from_zero(self, names: tuple[str, ...], x: torch.Tensor) -> None:
        """Zeros for the entries ``names`` not held yet (``x``: them along dim 1, as many planes
        each as :data:`PLANES` says): before anything arrives, the receivers hold zeros, so a first
        step's residuals are the values themselves, rounded."""
        first = 0
        for name in names:
            n = PLANES[name]
            for store in (self.reference, self.received):
                if name not in store:
                    store[name] = torch.zeros_like(x[:, first:first + n])
            first += n

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


def cache_bytes(v: torch.Tensor, settings: VMajorSettings) -> int:
    """The receivers' results and the senders' references of V (and of Q, K under scope qkv, and
    the output under qkvo; their references only with residuals)."""
    received = len(settings.scope)  # v: 1, qkv: 3, qkvo: 4
    references = received if settings.residual is not None else 1
    return v.numel() * v.element_size() * (received + references)
