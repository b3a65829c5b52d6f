"""The two-level weight fan-out: nodes, relays, and the groups a publication (re)forms.

With `trainer.weight_fanout: two_level` (and `weight_transport: distributed`) the trainer's
rank 0 does not broadcast to every replica. It broadcasts each bucket to one relay replica
per node, in a group of rank 0 + the relays (`flywheel_weights.top.g<n>`); each relay
re-broadcasts the bucket, as it arrives, to the other replicas of its node in the node's own
group (`flywheel_weights.node[<node>].g<n>`, relay at rank 0). The replicas are told which
group to receive from and which to relay to in their UpdateWeights request, and answer as
with one group: verified tensors (the manifest's SHA-256) and the version they now serve.

Nodes come from `trainer.weight_fanout_replicas_per_node` (replica i is on node i // n) or,
when it is 0, from the host of each replica's address. A node's relay is its first replica
that answers, and stays the relay while it answers, so a replica coming back does not move
the relay and re-form the trainer's group.

Fault domain: a publication re-forms only the groups whose members changed (a replica gone,
back, or found serving an older version than its group last delivered, which means its
server restarted and lost the group). A member that dies or joins re-forms its node's group;
the trainer's group and the other nodes' groups are not touched. A relay that dies makes its
node's next replica the relay, so the trainer's group and that node's group are re-formed.
Every formation gets a new name (`g<n>`), so its rendezvous keys in the store (one store,
hosted by the trainer for every group) never meet those of an earlier formation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.weights.distributed import WeightsGroup, host_store, send_buckets
from services.common.weights.manifest import WeightManifest, tensor_specs
from services.wire.rollout_client import RolloutClient

log = logging.getLogger(__name__)

GROUP_PREFIX = "flywheel_weights"


def node_of(addresses: list[str], replicas_per_node: int) -> dict[str, str]:
    """The node of each replica address: `node<i // replicas_per_node>` for replica i, or
    the host part of its address when `replicas_per_node` is 0."""
    if replicas_per_node > 0:
        return {a: f"node{i // replicas_per_node}" for i, a in enumerate(addresses)}
    return {a: a.rsplit(":", 1)[0] for a in addresses}


@dataclass(frozen=True)
class NodePlan:
    """The replicas of one node that answer now, relay first."""

    node: str
    ranks: tuple[str, ...]

    @property
    def relay(self) -> str:
        return self.ranks[0]

    @property
    def members(self) -> tuple[str, ...]:
        return self.ranks[1:]


def plan_nodes(alive: list[str], nodes: dict[str, str], relays: dict[str, str]) -> list[NodePlan]:
    """Group the `alive` replicas by node (nodes and replicas in the order of `alive`). The
    relay is the node's relay so far (`relays`, by node) while it is alive, else its first
    alive replica."""
    by_node: dict[str, list[str]] = {}
    for a in alive:
        by_node.setdefault(nodes[a], []).append(a)
    plans = []
    for node, addrs in by_node.items():
        relay = relays.get(node)
        if relay in addrs:
            addrs = [relay, *(a for a in addrs if a != relay)]
        plans.append(NodePlan(node, tuple(addrs)))
    return plans


@dataclass
class FormedGroup:
    """A group that exists: its name, the replicas in rank order (the trainer's group:
    relays at ranks 1..; a node group: relay at 0, members 1..) and the version it last
    delivered to all of them (-1: none yet)."""

    name: str
    ranks: tuple[str, ...]
    delivered: int = -1

    def regressed(self, served: dict[str, int | None]) -> list[str]:
        """Members serving an older version than this group gave them: restarted."""
        return [a for a in self.ranks if (served.get(a) or 0) < self.delivered]


def stale_groups(
    plans: list[NodePlan],
    top: FormedGroup | None,
    nodes: dict[str, FormedGroup],
    served: dict[str, int | None],
) -> tuple[bool, list[NodePlan]]:
    """Whether the trainer's group must be (re)formed, and which nodes' groups must: a group
    is stale when it does not exist, its ranks differ from the plan, or a member regressed.
    A node with one replica needs no group (its relay receives only)."""
    relays = tuple(p.relay for p in plans)
    need_top = top is None or top.ranks != relays or bool(top.regressed(served))
    need_nodes = []
    for p in plans:
        if len(p.ranks) < 2:
            continue
        formed = nodes.get(p.node)
        if formed is None or formed.ranks != p.ranks or formed.regressed(served):
            need_nodes.append(p)
    return need_top, need_nodes


Guard = Callable[[str, Awaitable[Any], int], Awaitable["str | None"]]
"""`WeightPublisher._guarded`: an RPC's outcome for one replica within its deadline."""


class TwoLevelFanout:
    """The trainer's side of the two-level fan-out: the store every group meets in, the
    trainer's group to the relays, and the bookkeeping of every node's group."""

    def __init__(
        self,
        *,
        clients: dict[str, RolloutClient],
        nodes: dict[str, str],
        address: str,
        port: int,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
    ) -> None:
        self.clients = clients
        self.nodes = nodes
        self.address = address
        self.port = port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.top: FormedGroup | None = None
        self.node_groups: dict[str, FormedGroup] = {}
        self.formations = 0  # groups formed so far; names each new one
        self._store: Any = None
        self._top_group: WeightsGroup | None = None

    # -- groups ------------------------------------------------------------------------------
    def _name(self, kind: str) -> str:
        self.formations += 1
        return f"{GROUP_PREFIX}.{kind}.g{self.formations}"

    def drop_top(self) -> None:
        group, self._top_group, self.top = self._top_group, None, None
        if group is not None:
            group.release()

    def drop_all(self) -> None:
        self.drop_top()
        self.node_groups.clear()

    def close(self) -> None:
        self.drop_all()
        self._store = None

    async def _form_top(self, relays: tuple[str, ...]) -> None:
        self.drop_top()
        name = self._name("top")
        world = 1 + len(relays)
        host = asyncio.to_thread(
            WeightsGroup,
            master_address=self.address,
            master_port=self.port,
            rank=0,
            world_size=world,
            backend=self.backend,
            group_name=name,
            timeout_s=self.timeout_s,
            store=self._store,
        )
        joins = [
            self.clients[r].init_weights_group(
                self.address, self.port, i + 1, world, self.backend, name
            )
            for i, r in enumerate(relays)
        ]
        results = await asyncio.gather(host, *joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if isinstance(results[0], WeightsGroup):
                results[0].release()
            raise RuntimeError(f"the trainer's group: {errors[0]}")
        self._top_group = results[0]  # type: ignore[assignment]
        self.top = FormedGroup(name, relays)

    async def _form_node(self, plan: NodePlan) -> None:
        self.node_groups.pop(plan.node, None)
        name = self._name(f"node[{plan.node}]")
        world = len(plan.ranks)
        joins = [
            self.clients[r].init_weights_group(
                self.address, self.port, i, world, self.backend, name
            )
            for i, r in enumerate(plan.ranks)
        ]
        results = await asyncio.gather(*joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"node {plan.node}'s group: {errors[0]}")
        self.node_groups[plan.node] = FormedGroup(name, plan.ranks)

    async def _form(self, plans: list[NodePlan], served: dict[str, int | None]) -> dict[str, str]:
        """(Re)form the stale groups, all at once; returns the replicas that cannot take this
        update (their group did not form) with the reason."""
        if self._store is None:
            self._store = await asyncio.to_thread(host_store, self.port, self.timeout_s)
        for node in [n for n in self.node_groups if n not in {p.node for p in plans}]:
            del self.node_groups[node]  # no replica of it answers, or only its relay
        for p in plans:
            if len(p.ranks) < 2:
                self.node_groups.pop(p.node, None)
        need_top, need_nodes = stale_groups(plans, self.top, self.node_groups, served)
        if need_top or need_nodes:
            log.info(
                "forming weight fan-out groups",
                extra={
                    "trainer_group": need_top,
                    "node_groups": [p.node for p in need_nodes],
                    "relays": [p.relay for p in plans],
                },
            )
        jobs: list[Awaitable[None]] = [self._form_node(p) for p in need_nodes]
        if need_top:
            jobs.append(self._form_top(tuple(p.relay for p in plans)))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failed: dict[str, str] = {}
        for p, r in zip(need_nodes, results, strict=False):
            if isinstance(r, BaseException):
                failed.update({m: f"group rendezvous failed: {r}" for m in p.members})
        if need_top and isinstance(results[-1], BaseException):
            self.drop_all()
            failed = {a: f"group rendezvous failed: {results[-1]}" for p in plans for a in p.ranks}
        return failed

    # -- publication -------------------------------------------------------------------------
    async def publish(
        self,
        sd: dict[str, torch.Tensor],
        manifest: WeightManifest,
        alive: list[str],
        served: dict[str, int | None],
        guarded: Guard,
    ) -> dict[str, str | None]:
        """Send `sd` to the `alive` replicas: the trainer's broadcast to the relays, each
        relay's to its node. Returns each replica's outcome (None: serves the version)."""
        relays = {n: g.ranks[0] for n, g in self.node_groups.items()}
        if self.top is not None:
            relays.update({self.nodes[r]: r for r in self.top.ranks})
        plans = plan_nodes(alive, self.nodes, relays)
        outcomes: dict[str, str | None] = dict(await self._form(plans, served))
        top, group = self.top, self._top_group
        if top is None or group is None:
            return outcomes
        specs = tensor_specs(sd)
        tasks: dict[str, asyncio.Future[Any]] = {}
        for p in plans:
            node = self.node_groups.get(p.node)
            tasks[p.relay] = asyncio.ensure_future(
                self.clients[p.relay].update_weights_distributed(
                    manifest,
                    specs,
                    self.bucket_bytes,
                    group_name=top.name,
                    forward_group=node.name if node is not None else "",
                )
            )
            if node is None:
                continue  # one replica, or its group did not form (outcomes say why)
            for m in p.members:
                tasks[m] = asyncio.ensure_future(
                    self.clients[m].update_weights_distributed(
                        manifest, specs, self.bucket_bytes, group_name=node.name
                    )
                )
        try:
            await asyncio.to_thread(send_buckets, group, sd, self.bucket_bytes)
        except Exception as exc:  # noqa: BLE001 - a relay died mid-broadcast
            self.drop_all()
            for t in tasks.values():
                t.cancel()
            outcomes.update({a: f"broadcast failed: {exc}" for a in tasks})
            return outcomes
        for a, task in tasks.items():
            outcomes[a] = await guarded(a, task, manifest.version)
        self._account(plans, outcomes, manifest.version)
        return outcomes

    def _account(
        self, plans: list[NodePlan], outcomes: dict[str, str | None], version: int
    ) -> None:
        """Drop the groups a failure touched (a relay: the trainer's group and its node's; a
        member: its node's), and note the version the others delivered."""
        for p in plans:
            if outcomes.get(p.relay) is not None:
                self.drop_top()
                self.node_groups.pop(p.node, None)
            elif any(outcomes.get(m) is not None for m in p.members):
                self.node_groups.pop(p.node, None)
        if self.top is not None:
            self.top.delivered = version
        for node in self.node_groups.values():
            node.delivered = version
