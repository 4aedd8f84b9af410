"""Any head and token count under Ulysses: pad to the degree, keep attention exact, trim.

Stock Ulysses needs the attention heads and the sequence each divisible by the Ulysses degree
``W`` (SD3.5-large has 38 heads: it splits over neither 4, 8 nor 12 ranks, and an Aurora node has
12 tiles). cache-dit's "Ulysses Anything" pads and unpads; this is the same idea for xfuser, kept
exact:

* **heads**: each exchanged ``[b, h, s, d]`` tensor gets ``ceil(h/W)*W - h`` zero heads before its
  input exchange, and the output exchange's result is cut back to ``h`` heads. Heads are attended
  independently, so a zero head changes no real one (its own output is zeros and is dropped).
* **tokens** (FLUX, Ulysses without ring): the text and image streams are each padded with zero
  tokens to a multiple of ``W`` so every rank holds an equal shard of both; the padded tokens are
  removed from the keys and values after the input exchange (:func:`keep_keys`), so no real token
  attends to them, and the image is cut back after the final gather. Padded queries compute
  rows that are dropped.

The padding costs bytes, counted in ``commstats.ran()["padded_bytes"]`` (sent zeros), and a copy
of K and V per layer when tokens are padded (``copied_bytes``). Which layouts need it is decided
from shapes and settings alone, the same on every rank.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.errors import user_error


def padded(count: int, world: int) -> int:
    """``count`` rounded up to a multiple of ``world``."""
    return math.ceil(count / world) * world


def pad_heads(x: torch.Tensor, world: int) -> torch.Tensor:
    """``[b, h, s, d]`` with zero heads appended up to a multiple of ``world`` (``x`` itself if none)."""
    extra = padded(x.shape[1], world) - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)


@dataclass(frozen=True)
class Streams:
    """The token streams of one forward, in the order each rank lays out its shard (text, then
    image for FLUX): ``(real, padded)`` lengths each, ``padded`` a multiple of the degree."""

    lengths: tuple[tuple[int, int], ...]
    world: int

    @property
    def local(self) -> int:
        """Tokens per rank (all streams)."""
        return sum(p for _, p in self.lengths) // self.world

    def kept(self) -> tuple[tuple[int, int], ...]:
        """The real tokens of the exchanged sequence ``[rank 0's shard, rank 1's, ...]`` as runs
        ``(first position, length)``, in order, adjacent runs joined. Slices, not an index tensor:
        a traced layer then holds static slices, with no index made on the host and copied over."""
        runs: list[tuple[int, int]] = []
        for rank in range(self.world):
            offset = rank * self.local
            for real, pad in self.lengths:
                shard = pad // self.world
                count = min(shard, max(0, real - rank * shard))  # a shard's real tokens come first
                if count and runs and sum(runs[-1]) == offset:
                    runs[-1] = (runs[-1][0], runs[-1][1] + count)
                elif count:
                    runs.append((offset, count))
                offset += shard
        return tuple(runs)


class Padding:
    """One job's padding (the exchanger holds it, so a new job starts with none of the last one's):
    the loaded model's heads where the degree does not divide them, the running forward's padded
    token streams, and whether a forward padded tokens since the step clock last cleared it."""

    def __init__(self) -> None:
        #: The loaded model's heads over the degree, when they do not divide (``"38 attention heads over ..."``).
        self.uneven_heads: str | None = None
        #: The running forward's padded streams (None: its tokens are not padded); callers that count
        #: per exchange read it to skip :meth:`count` where nothing is padded (a Python call per exchange).
        self.running: Streams | None = None
        # Whether a forward padded tokens since the last clear (what a step clock checks around a call).
        # Written by traced code, read only on the host: a traced read would guard its value, which
        # changes per forward, and the transformer would be traced again for every call.
        self._padded = False

    @contextlib.contextmanager
    def tokens(self, streams: Streams) -> Iterator[None]:
        """While a padded forward runs: attention drops the padded keys (:meth:`keep_keys`)."""
        previous, self.running = self.running, streams
        self._padded = True
        try:
            yield
        finally:
            self.running = previous

    def clear_padded(self) -> None:
        """From now on, :meth:`tokens_were_padded` says whether a forward padded tokens (host code only)."""
        self._padded = False

    def tokens_were_padded(self) -> bool:
        """Whether a forward padded tokens since :meth:`clear_padded` (host code only)."""
        return self._padded

    def required(self) -> str | None:
        """What needs cocodiff's padded exchange right now (heads or tokens), or None: then a layer
        must not take the stock path, which cannot split them."""
        if self.running is not None:
            return f"{self.running.lengths} tokens padded to the degree {self.running.world}"
        return self.uneven_heads

    def keep_keys(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head-sharded ``[b, h/W, W*s, d]`` K and V without the padded tokens of the running forward."""
        running = self.running
        if running is None:
            return key, value
        if key.shape[2] != running.world * running.local:
            user_error(
                f"cocodiff: padded tokens of a {running.world}-way Ulysses forward, but an attention layer sees "
                f"{key.shape[2]} keys instead of {running.world * running.local}; this model's sequence layout "
                f"is not supported with padding: choose a resolution and text length divisible by the degree"
            )
        runs = running.kept()
        # [b, h/W, W*s, d] -> [b, h/W, real tokens, d]: one copy of each, as an index_select would make
        key = torch.cat([key.narrow(2, first, count) for first, count in runs], 2)
        value = torch.cat([value.narrow(2, first, count) for first, count in runs], 2)
        commstats.traced("count_copy", 2 * key.numel() * key.element_size())
        return key, value

    def count(self, nbytes: int, heads: int, padded_heads: int) -> None:
        """Count the padding's share of an exchange of ``nbytes``: ``padded_heads`` heads, of which
        ``heads`` are real, and the padded tokens of the running forward (in traced code, per graph run)."""
        real = heads / padded_heads
        if self.running is not None:
            real *= sum(r for r, _ in self.running.lengths) / sum(p for _, p in self.running.lengths)
        if real < 1:
            commstats.traced("count_padding", round(nbytes * (1 - real)))


def streams(lengths: Sequence[int], world: int) -> Streams | None:
    """The padded layout of streams of these lengths, or None when every one divides ``world``."""
    if all(n % world == 0 for n in lengths):
        return None
    return Streams(tuple((n, padded(n, world)) for n in lengths), world)


def pad_tokens(x: torch.Tensor, to: int, dim: int) -> torch.Tensor:
    """``x`` with zero tokens appended along ``dim`` up to length ``to``."""
    extra = to - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
