"""``flat-pxn``: the flat all-to-all routed as NCCL routes it on a rail-optimized cluster (PXN).

On a rail-optimized cluster the NIC of local rank j of every node is cabled to leaf switch j (rail
j), and a message from one rail to another crosses the oversubscribed spine. Since NCCL 2.12, PXN
("PCI x NVLink") keeps such messages off the spine: the sending GPU writes the message over NVLink
into a buffer on the GPU of its own node that sits on the destination's rail, and that GPU's NIC
sends it over the rail (NVIDIA, "Doubling all2all Performance with NVIDIA Collective Communication
Library 2.12", technical blog, 2022; on by default, ``NCCL_PXN_DISABLE=1`` turns it off,
``NCCL_P2P_PXN_LEVEL`` says where it applies). So NCCL's all-to-all on a rail cluster is not the
direct routes of ``flat-p2p`` but this routing, and it is the fair reference there: TAPA's gain on
rails is measured against it (``cocodiff bench a2a``). On NCCL where PXN applies, the backend's own
all-to-all (``flat``) already routes this way; this entry makes the routing run, and be measured,
on every backend (:mod:`.transport`), and the autotune may choose it like any other.

Routing of the message from (node a, local i) to (node b, local j) over a group whose plan is node x
local (the two-level plan of :class:`.tapa.HierarchicalAllToAll`, whose sub-groups it uses):

* same node (a == b): direct, over the fast level;
* same rail (i == j): direct, over rail i;
* otherwise: to (a, j) over the fast level, which forwards it to (b, j) over rail j.

Batches, in one program order (:mod:`.transport`): at start, over the rails the same-rail chunks; over
the fast level the chunks to relay, then the chunks for this node (so a relay waits for the former
only); in ``advance``, once the chunks to relay are in, over the rails the relayed chunks. Every
chunk is sent and received in place; the only local copy is the own chunk.

What is not NCCL's. Aggregation: every relayed chunk stays its own message, the relayed chunks for
one peer go in one batch (NCCL's proxy can post them as one network operation where the network
plugin has grouped receives, ``maxRecvs`` of the ncclNet API; joining them here would add a copy
NCCL does not make). Pipelining: NCCL's proxy forwards a relayed message slice by slice as its
staging buffer fills; here the relayed chunks are forwarded once the whole batch of chunks to relay
has completed (nothing is posted because something completed), while the same-rail chunks keep the
rails busy. TAPA's two-level exchange (:class:`.tapa.TwoLevelHandle`) relays half of every
cross-rail chunk this way and sends the other half over its own rail first, to be forwarded inside
the destination node.

Scope: two levels, the outer one the topology's nodes. A group within one node has no rails, and a
three-level group (node x GPU x tile) is refused: its relay would need a sub-group of each node's
GPUs x tiles, which no plan has, and Aurora-like nodes share their NICs instead of one per rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from . import transport
from .subgroups import GroupPlan
from .tapa import HierarchicalAllToAll


class PxnHandle:
    """A ``flat-pxn`` exchange in flight (module docstring): one phase at start, the relay in ``advance``."""

    def __init__(self, x: torch.Tensor, plan: GroupPlan) -> None:
        self._plan = plan
        self._shape, self._dtype = x.shape, x.dtype
        nodes, local = plan.levels
        src = transport.comm_view(x).view(nodes, local, -1)  # [destination node, destination local, c]
        self._out = src.new_empty(src.shape)  # [source node, source local, c]
        # What local peers relay through this rank, for the nodes on its rail: [destination node, source local, c].
        self._relay = src.new_empty(src.shape)
        m0, m1 = divmod(plan.index, local)
        self._others = [i for i in range(local) if i != m1]  # the local ranks on other rails
        transport.copy_own(self._out[m0, m1], src[m0, m1])
        self._buffers = (src, self._out, self._relay)
        away = [b for b in range(nodes) if b != m0]
        # Lists indexed by peer: node over the rail (level 0), local rank inside the node (level 1).
        self._same_rail = self._post(
            0, "same-rail chunks", [[self._out[a, m1]] for a in range(nodes)], [[src[b, m1]] for b in range(nodes)],
        )
        self._to_relay = self._post(
            1, "chunks to relay", [[self._relay[b, i] for b in away] for i in range(local)],
            [[src[b, j] for b in away] for j in range(local)],
        )
        self._posted = [self._post(
            1, "chunks for this node", [[self._out[m0, i]] for i in range(local)], [[src[m0, j]] for j in range(local)],
        )]
        self._relayed = False
        self._result: torch.Tensor | None = None

    def _post(self, level: int, what: str, recv: list, send: list) -> transport.Completion:
        return transport.post(recv, send, self._plan.level_groups[level], self._plan.roles[level], what, self._buffers)

    def advance(self) -> bool:
        if not self._relayed:
            self._to_relay.wait()
            nodes = self._plan.levels[0]
            self._posted.append(self._post(
                0, "relayed chunks", [[self._out[a, i] for i in self._others] for a in range(nodes)],
                [[self._relay[b, i] for i in self._others] for b in range(nodes)],
            ))
            self._relayed = True
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.advance()
            self._same_rail.wait()
            for done in self._posted:
                done.wait()
            self._posted, self._buffers, self._relay = [], (), None
            self._result = self._out.view(self._dtype).view(self._shape)  # back to the input's dtype and shape
        return self._result


class PxnAllToAll:
    """The ``flat-pxn`` exchange over the groups ``tapa`` has a plan for (it relays over their sub-groups)."""

    def __init__(self, tapa: HierarchicalAllToAll) -> None:
        self._plans = tapa.plans  # read here, at every exchange, without a call into TAPA
        self._per_node = math.prod(tapa.topology.sizes[1:])  # ranks are numbered node-major (:mod:`.topology`)

    def reason(self, x: torch.Tensor, group: Any = None) -> str | None:
        """Why ``flat-pxn`` cannot exchange ``x`` over ``group`` (None: it can)."""
        plan = self._plans.get(transport.group_ranks(group if group is not None else dist.group.WORLD))
        if plan is None:
            return "the group spans fewer than two topology levels (no rail to relay to)"
        if len(plan.levels) != 2:
            return f"the group spans {len(plan.levels)} levels {plan.levels}; the PXN-like relay needs node x local"
        if plan.ranks[0] // self._per_node == plan.ranks[-1] // self._per_node:
            return "the group stays inside one node (no rails)"
        if torch.compiler.is_compiling():
            return "point-to-point messages cannot be traced by torch.compile"
        if x.dim() == 0 or x.shape[0] % len(plan.ranks):
            return "the input does not split into equal chunks"
        return None

    def start(self, x: torch.Tensor, group: Any = None) -> PxnHandle:
        """Start the exchange of ``x`` (split along dim 0, equal chunks) over ``group`` (default: world);
        raises ValueError where :meth:`reason` says it cannot run (it never substitutes another algorithm)."""
        group = group if group is not None else dist.group.WORLD
        why = self.reason(x, group)
        if why is not None:
            raise ValueError(f"flat-pxn all-to-all: {why}")
        return PxnHandle(x, self._plans[transport.group_ranks(group)])

    def __call__(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Blocking exchange, same output as ``flat_all_to_all``."""
        return self.start(x, group).wait()
