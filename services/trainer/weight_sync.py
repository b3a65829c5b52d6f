"""Publish new policy weights to every rollout replica (rank 0 of the trainer).

Three transports, one contract (`services/common/weights/`): the replica receives
named tensors with a manifest (version + SHA-256 checksum), verifies them, and answers with
the version it now serves.

- `disk`: safetensors into a fresh directory `<weight_dir>/v<version:08d>/` (manifest
  written last), then every replica is told the path. `<weight_dir>/LATEST` names the
  newest complete directory, so a replica that starts late can load it before serving.
  Older directories beyond `keep_weight_versions` are deleted.
- `distributed`: a torch.distributed group of rank 0 + every replica (gloo on CPU, NCCL
  on GPU), built once; each update broadcasts the tensors in buckets from rank 0 while the
  replicas' UpdateWeights calls receive them. An SGLang replica with `tp_size` N holds N
  ranks (SGLang ranks each TP worker at `rank_offset + tp_rank`), so replica i joins at
  `rank_offset = 1 + N * i` and the world is `1 + N * replicas` (`group_layout`). A replica
  found serving an older version than the group last gave it (its server restarted and
  lost the group) makes the group be rebuilt; replicas destroy a group of the same name
  before joining again.
  With `trainer.weight_fanout: two_level` the trainer broadcasts to one relay replica per
  node instead, and each relay to its node's replicas (services/trainer/fanout.py).
- `grpc`: the tensors streamed as chunks to each replica.

Every transport carries plain Hugging Face weights under their original names. A LoRA actor
(`actor.use_lora`) publishes its merged weights `W + (alpha / r) · B @ A`
(`TrainEngine.full_state_dict`, services/trainer/lora.py), so the torch engine and SGLang
serve it as an ordinary model; AReaL instead sends the adapter alone and the inference
server applies it.

A publication is complete when every replica answers with the new version, or has failed
and been marked unhealthy for that version (counted in `unhealthy_replicas_total`, never
silent); so is one that took the update but then fails the parity probe (`check_parity`,
services/trainer/parity.py). Unhealthy replicas are tried again at the next publication; for the distributed
transport a failure also dissolves the group, which is rebuilt with the replicas that
answer at the next publication.

Every call to a replica ends within `rollout.weight_update_timeout`, retries included, so a
replica that is alive but never answers (stopped, wedged) fails like a dead one and the
trainer goes on. An unhealthy replica gets weights again once it answers a version probe
(`UNHEALTHY_PROBE_S`); until then it is skipped, so a hung replica costs one deadline, not
one per step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.config import FlywheelConfig
from services.common.outage import PeerOutageMetrics
from services.common.weights.disk import save_weights
from services.common.weights.distributed import WeightsGroup, send_buckets
from services.common.weights.manifest import WeightManifest, make_manifest, tensor_specs
from services.trainer.dist import free_port
from services.trainer.fanout import TwoLevelFanout, node_of
from services.wire.rollout_client import RolloutClient

if TYPE_CHECKING:
    from services.trainer.parity import ParityProbe

log = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
UNHEALTHY_PROBE_S = 5.0
"""Seconds an unhealthy replica has to answer GetVersion before a publication sends it
weights again (capped by `rollout.weight_update_timeout`)."""


@dataclass
class PublishReport:
    version: int
    transport: str
    seconds: float
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def replica_addresses(cfg: FlywheelConfig) -> list[str]:
    """Addresses of the rollout replicas; none when the rollout port is unset (0), which
    means no rollout is wired to this trainer (tests, offline training)."""
    ep = cfg.services.rollout
    if ep.port == 0:
        return []
    return [ep.replica_address(i) for i in range(cfg.rollout.n_replicas)]


def replica_ranks(cfg: FlywheelConfig) -> int:
    """Ranks one replica holds in the weights group: SGLang's `tp_size` (one per TP worker),
    1 for the torch engine."""
    return cfg.rollout.sglang.tp_size if cfg.rollout.engine == "sglang" else 1


def group_layout(n_members: int, ranks_per_member: int) -> tuple[int, list[int]]:
    """World size and each member's `rank_offset` of a weights group: the trainer is rank 0,
    member i holds ranks `1 + ranks_per_member * i .. + ranks_per_member - 1`."""
    if n_members < 1 or ranks_per_member < 1:
        raise ValueError(f"{n_members} members x {ranks_per_member} ranks: both must be >= 1")
    offsets = [1 + ranks_per_member * i for i in range(n_members)]
    return 1 + ranks_per_member * n_members, offsets


def version_dir(weight_dir: str | os.PathLike[str], version: int) -> Path:
    return Path(weight_dir) / f"v{version:08d}"


def published_versions(weight_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """The version directories under `weight_dir` (named by `version_dir`), by version."""
    return {
        int(p.name[1:]): p
        for p in Path(weight_dir).glob("v*")
        if p.is_dir() and p.name[1:].isdigit()
    }


class WeightPublisher:
    """Pushes weights to the replicas; lives on rank 0's I/O loop."""

    def __init__(
        self,
        cfg: FlywheelConfig,
        *,
        weight_dir: str | os.PathLike[str],
        addresses: list[str] | None = None,
        peers: PeerOutageMetrics | None = None,
        parity: ParityProbe | None = None,
    ) -> None:
        self.cfg = cfg
        self.transport = cfg.trainer.weight_transport
        self.weight_dir = Path(weight_dir)
        self.addresses = replica_addresses(cfg) if addresses is None else list(addresses)
        timeout = cfg.rollout.weight_update_timeout
        self.clients = {
            a: RolloutClient(
                a,
                auth_token=cfg.services.auth_token,
                max_message_bytes=cfg.services.max_message_bytes,
                weight_update_timeout=timeout,
                timeout=min(60.0, timeout),
                peer=peers.peer(f"rollout-{i}", a) if peers is not None else None,
                tls=cfg.services.tls,
            )
            for i, a in enumerate(self.addresses)
        }
        self.unhealthy: set[str] = set()
        self.failures_total = 0
        self._group: WeightsGroup | None = None
        self._group_members: list[str] = []
        self._group_version = -1  # the version the group last delivered to every member
        self.fanout: TwoLevelFanout | None = None  # trainer.weight_fanout: two_level
        self.parity = parity

    @property
    def enabled(self) -> bool:
        return bool(self.addresses)

    @property
    def deadline_s(self) -> float:
        """What one replica's part of a publication may take, retries included."""
        return self.cfg.rollout.weight_update_timeout

    async def close(self) -> None:
        self._drop_group()
        if self.fanout is not None:
            self.fanout.close()
        for c in self.clients.values():
            await c.close()

    # -- control of the replicas -------------------------------------------------------------
    async def pause(self) -> None:
        await self._each(lambda c: c.pause())

    async def resume(self) -> None:
        await self._each(lambda c: c.resume())

    async def versions(self) -> dict[str, int | None]:
        async def one(c: RolloutClient) -> int | None:
            try:
                return await asyncio.wait_for(c.get_version(), self.deadline_s)
            except Exception:  # noqa: BLE001 - unreachable replica: no version
                return None

        vals = await asyncio.gather(*(one(c) for c in self.clients.values()))
        return dict(zip(self.clients, vals, strict=True))

    async def _each(self, fn) -> None:  # type: ignore[no-untyped-def]
        async def one(addr: str, c: RolloutClient) -> None:
            try:
                await asyncio.wait_for(fn(c), self.deadline_s)
            except Exception as exc:  # noqa: BLE001 - a dead replica must not stop training
                log.warning(
                    "rollout control call failed", extra={"replica": addr, "error": str(exc)}
                )

        await asyncio.gather(*(one(a, c) for a, c in self.clients.items()))

    # -- publication -------------------------------------------------------------------------
    async def publish(
        self, state_dict: dict[str, torch.Tensor], version: int, *, only: list[str] | None = None
    ) -> PublishReport:
        """Make every replica (or those in `only`) serve `state_dict` as `version`."""
        targets = list(self.addresses if only is None else only)
        t0 = time.perf_counter()
        skipped = await self._still_unhealthy([a for a in targets if a in self.unhealthy])
        targets = [a for a in targets if a not in skipped]
        dtype = getattr(torch, self.cfg.trainer.weight_dtype)
        if any(t.dtype != dtype and t.is_floating_point() for t in state_dict.values()):
            state_dict = {
                k: t.to(dtype) if t.is_floating_point() else t for k, t in state_dict.items()
            }
        manifest = await asyncio.to_thread(make_manifest, state_dict, version)
        if self.transport == "disk":
            results = await self._publish_disk(state_dict, manifest, targets)
        elif self.transport == "grpc":
            results = await self._publish_grpc(state_dict, manifest, targets)
        elif self.transport == "distributed":
            results = await self._publish_distributed(state_dict, manifest, targets)
        else:  # pragma: no cover - the config validates the literal
            raise ValueError(f"trainer.weight_transport={self.transport!r} is unknown")
        results.update(skipped)
        report = PublishReport(version, self.transport, 0.0)
        for addr, outcome in results.items():
            if outcome is None:
                report.updated.append(addr)
                self.unhealthy.discard(addr)
            else:
                report.failed[addr] = outcome
                self.unhealthy.add(addr)
                self.failures_total += 1
                log.error(
                    "replica did not take the new weights; marked unhealthy and skipped",
                    extra={"replica": addr, "version": version, "reason": outcome},
                )
        report.seconds = time.perf_counter() - t0
        return report

    async def check_parity(
        self, state_dict: dict[str, torch.Tensor], report: PublishReport
    ) -> PublishReport:
        """Run the parity probe (services/trainer/parity.py) on the replicas `report` updated,
        once they decode again (after `resume` in synchronous mode); a replica that fails
        moves from `updated` to `failed` and is unhealthy like one that refused the update."""
        freq = self.cfg.trainer.parity_probe_freq
        if self.parity is None or not report.updated or not freq or report.version % freq:
            return report
        dtype = getattr(torch, self.cfg.trainer.weight_dtype)
        sent = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state_dict.items()}
        results = await self.parity.check(self.clients, sent, report.version, report.updated)
        for addr, r in results.items():
            if not r.ok:
                report.updated.remove(addr)
                report.failed[addr] = f"parity: {r.reason}"
                self.unhealthy.add(addr)
                self.failures_total += 1
        return report

    async def _still_unhealthy(self, addrs: list[str]) -> dict[str, str | None]:
        """The unhealthy replicas among `addrs` that still do not answer a version probe,
        with the reason they are skipped; the others get this publication's weights."""
        probe = min(UNHEALTHY_PROBE_S, self.deadline_s)

        async def silent(addr: str) -> bool:
            try:
                await asyncio.wait_for(self.clients[addr].get_version(), probe)
            except Exception:  # noqa: BLE001 - no answer is the answer
                return True
            return False

        found = await asyncio.gather(*(silent(a) for a in addrs))
        return {
            a: f"skipped: no answer to a version probe within {probe:g}s"
            for a, s in zip(addrs, found, strict=True)
            if s
        }

    @staticmethod
    def _check(result, version: int) -> str | None:  # type: ignore[no-untyped-def]
        if not result.ok:
            return result.message or "refused"
        if result.version != version:
            return f"serves version {result.version}, expected {version}"
        return None

    async def _guarded(self, addr: str, coro, version: int) -> str | None:  # type: ignore[no-untyped-def]
        try:
            return self._check(await asyncio.wait_for(coro, self.deadline_s), version)
        except TimeoutError:
            return (
                f"no answer within rollout.weight_update_timeout={self.deadline_s:g}s "
                "(retries included)"
            )
        except Exception as exc:  # noqa: BLE001 - reported per replica
            return f"{type(exc).__name__}: {exc}"

    async def _publish_disk(
        self, sd: dict[str, torch.Tensor], manifest: WeightManifest, targets: list[str]
    ) -> dict[str, str | None]:
        path = version_dir(self.weight_dir, manifest.version)
        saved = await asyncio.to_thread(
            save_weights, path, sd, manifest.version, manifest=manifest
        )  # the checksum is computed once (publish), not again here
        (self.weight_dir / f".{LATEST_FILE}.tmp").write_text(path.name)
        os.replace(self.weight_dir / f".{LATEST_FILE}.tmp", self.weight_dir / LATEST_FILE)
        outcomes = await asyncio.gather(
            *(
                self._guarded(
                    a,
                    self.clients[a].update_weights_from_disk(
                        str(path.resolve()),
                        saved,
                        # Names this exact update (the replica deduplicates retries on it):
                        # republishing other weights under the same version gets a new id.
                        request_id=f"w{manifest.version}-{manifest.checksum[:16]}-{a}",
                    ),
                    manifest.version,
                )
                for a in targets
            )
        )
        self._prune_disk(manifest.version)
        return dict(zip(targets, outcomes, strict=True))

    def _prune_disk(self, newest: int) -> None:
        keep = self.cfg.trainer.keep_weight_versions
        versions = sorted(published_versions(self.weight_dir).items())
        for v, p in versions[: max(0, len(versions) - keep)]:
            if v < newest:
                shutil.rmtree(p, ignore_errors=True)

    async def _publish_grpc(
        self, sd: dict[str, torch.Tensor], manifest: WeightManifest, targets: list[str]
    ) -> dict[str, str | None]:
        chunk = self.cfg.trainer.weight_chunk_bytes
        outcomes = await asyncio.gather(
            *(
                self._guarded(
                    a,
                    self.clients[a].stream_weights(sd, manifest, chunk_bytes=chunk),
                    manifest.version,
                )
                for a in targets
            )
        )
        return dict(zip(targets, outcomes, strict=True))

    def _group_address(self) -> str:
        host = self.cfg.services.trainer.host
        return socket.getfqdn() if host in ("", "0.0.0.0", "::") else host

    def _drop_group(self) -> None:
        self._group = None
        self._group_members = []
        self._group_version = -1

    def _group_backend(self) -> str:
        return (
            "nccl" if torch.cuda.is_available() and self.cfg.trainer.backend == "nccl" else "gloo"
        )

    def _two_level(self) -> TwoLevelFanout:
        if self.fanout is None:
            addr = self._group_address()
            self.fanout = TwoLevelFanout(
                clients=self.clients,
                nodes=node_of(self.addresses, self.cfg.trainer.weight_fanout_replicas_per_node),
                address=addr,
                port=self.cfg.trainer.weights_group_port
                or free_port("127.0.0.1" if addr in ("127.0.0.1", "localhost") else ""),
                backend=self._group_backend(),
                bucket_bytes=self.cfg.trainer.weight_bucket_bytes,
                timeout_s=self.cfg.rollout.weight_update_timeout,
            )
        return self.fanout

    async def _ensure_group(self, members: list[str]) -> None:
        if self._group is not None and self._group_members == members:
            return
        self._drop_group()
        addr = self._group_address()
        port = self.cfg.trainer.weights_group_port or free_port(
            "127.0.0.1" if addr in ("127.0.0.1", "localhost") else ""
        )
        world, offsets = group_layout(len(members), replica_ranks(self.cfg))
        backend = self._group_backend()
        timeout = self.cfg.rollout.weight_update_timeout
        joins = [
            self.clients[m].init_weights_group(addr, port, offset, world, backend)
            for m, offset in zip(members, offsets, strict=True)
        ]
        host = asyncio.to_thread(
            WeightsGroup,
            master_address=addr,
            master_port=port,
            rank=0,
            world_size=world,
            backend=backend,
            timeout_s=timeout,
        )
        results = await asyncio.gather(host, *joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"weights group rendezvous failed: {errors[0]}")
        self._group = results[0]  # type: ignore[assignment]
        self._group_members = list(members)

    async def _publish_distributed(
        self, sd: dict[str, torch.Tensor], manifest: WeightManifest, targets: list[str]
    ) -> dict[str, str | None]:
        # A broadcast is collective: every member must take part, so the group is exactly
        # the replicas that answer right now.
        served = await self.versions()
        alive = [a for a, v in served.items() if v is not None and a in targets]
        outcomes: dict[str, str | None] = {a: "unreachable" for a in targets if a not in alive}
        if not alive:
            return outcomes
        if self.cfg.trainer.weight_fanout == "two_level":
            outcomes.update(
                await self._two_level().publish(sd, manifest, alive, served, self._guarded)
            )
            return outcomes
        regressed = [a for a in alive if (served[a] or 0) < self._group_version]
        if self._group is not None and regressed:
            # Back on older weights than the group gave it: its server restarted and lost
            # the group, and a broadcast to it would hang. Rebuild with everyone.
            log.warning(
                "replica serves an older version than the weights group delivered; "
                "rebuilding the group",
                extra={"replicas": regressed, "group_version": self._group_version},
            )
            self._drop_group()
        try:
            await self._ensure_group(alive)
        except Exception as exc:  # noqa: BLE001
            self._drop_group()
            outcomes.update({a: f"group rendezvous failed: {exc}" for a in alive})
            return outcomes
        # SGLang receives one broadcast per tensor (bucket_bytes=0), our engine buckets.
        bucket = 0 if self.cfg.rollout.engine == "sglang" else self.cfg.trainer.weight_bucket_bytes
        specs = tensor_specs(sd)
        tasks = [
            asyncio.ensure_future(
                self.clients[a].update_weights_distributed(manifest, specs, bucket)
            )
            for a in alive
        ]
        group = self._group
        assert group is not None
        try:
            await asyncio.to_thread(send_buckets, group, sd, bucket)
        except Exception as exc:  # noqa: BLE001 - a receiver died mid-broadcast
            self._drop_group()
            for t in tasks:
                t.cancel()
            outcomes.update({a: f"broadcast failed: {exc}" for a in alive})
            return outcomes
        for a, task in zip(alive, tasks, strict=True):
            outcomes[a] = await self._guarded(a, task, manifest.version)
        if any(outcomes[a] is not None for a in alive):
            self._drop_group()
        else:
            self._group_version = manifest.version
        return outcomes
