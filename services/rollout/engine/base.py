"""The engine contract every generation backend follows, and the weight-update plumbing they share.

An engine turns a prompt (token ids) into a `Completion` whose tokens carry the behaviour
log-probability and the policy version that produced them. Weight updates arrive over three
transports (disk, torch.distributed, gRPC chunks); all of them end in "verified tensors +
manifest", which each engine applies its own way (`_apply_verified`). A failed update leaves
the old weights serving and returns `UpdateResult(ok=False, message=why)`.

Updates are serialised (one at a time) and never move the version backwards.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.weights.disk import load_weights
from services.common.weights.distributed import WeightsGroup, recv_buckets, relay_buckets
from services.common.weights.manifest import TensorSpec, WeightManifest, WeightsError, verify
from services.core.types import Completion, SamplingParams
from services.rollout.types import UpdateResult

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters an engine keeps for the service's metrics and `Stats`."""

    tokens_generated: int = 0
    requests_finished: int = 0
    weight_updates: int = 0
    weight_updates_failed: int = 0
    last_update_error: str = ""
    last_pause_seconds: float = 0.0
    last_update_seconds: float = 0.0


class EngineBase(abc.ABC):
    """The base of `TorchEngine` and `SGLangEngine`: what the rollout service drives
    (lifecycle, pause/resume, weight updates) plus the shared update plumbing.

    It implements `services.core.contracts.InferenceEngine`, the one engine contract
    workflows are typed against (generation, decoding, the version); a workflow never
    needs this class."""

    name: str = "engine"

    def __init__(self) -> None:
        self.version = 0
        self.checksum = ""
        self.stats = EngineStats()
        self._update_lock: asyncio.Lock | None = None
        self._group: WeightsGroup | None = None
        self._groups: dict[str, WeightsGroup] = {}  # by name (two-level fan-out)
        self._two_level = False  # joined or received as part of a two-level fan-out
        self.tokenizer: Any = None

    # --------------------------------------------------------------- lifecycle

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model / reach the server; ready to generate when it returns."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Abort what is in flight and release resources."""

    # -------------------------------------------------------------- generation

    @abc.abstractmethod
    async def agenerate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
    ) -> Completion:
        """One completion of `prompt_ids` (n_samples is ignored here; see `agenerate_n`).

        `images` (encoded PNG/JPEG bytes) go with the prompt to a vision-language model; an
        engine whose model reads no images refuses them (`refuse_images`)."""

    async def agenerate_n(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
    ) -> list[Completion]:
        """`sampling.n_samples` completions of one prompt, generated concurrently.

        With a seed, sample i uses `seed + i`, so a group is reproducible and its samples
        differ from each other.
        """
        self.refuse_images(images)
        extra = {"images": list(images)} if images else {}
        rid = request_id or uuid.uuid4().hex
        tasks = []
        for i in range(sampling.n_samples):
            seed = None if sampling.seed is None else sampling.seed + i
            one = SamplingParams(**{**sampling.__dict__, "n_samples": 1, "seed": seed})
            tasks.append(self.agenerate(prompt_ids, one, request_id=f"{rid}-{i}", **extra))
        return list(await asyncio.gather(*tasks))

    accepts_images: bool = False
    """True once the engine serves a model that reads images (set by `start`)."""

    def refuse_images(self, images: Sequence[bytes] | None) -> None:
        """Raise `ValueError` when `images` are given to an engine whose model reads none:
        dropping them would train a text policy on prompts that refer to unseen pictures."""
        if images and not self.accepts_images:
            raise ValueError(
                f"the {self.name} engine serves a text-only model and was given "
                f"{len(images)} image(s); serve a vision-language model "
                "(rollout.workflow: vision_rlvr) or drop the images from the data set"
            )

    @abc.abstractmethod
    async def pause(self) -> None:
        """Hold decoding between steps (requests in flight are kept)."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @property
    @abc.abstractmethod
    def paused(self) -> bool: ...

    @property
    @abc.abstractmethod
    def requests_in_flight(self) -> int:
        """Requests accepted and not finished (waiting or decoding)."""

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Finish every request in flight now with stop reason `abort`."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- weights

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    @abc.abstractmethod
    async def _apply_verified(self, tensors: Mapping[str, Any], manifest: WeightManifest) -> float:
        """Swap in already-verified tensors; returns seconds decoding was held.
        Raise `WeightsError` (nothing changed) when they do not fit the model."""

    def _check_version(self, manifest: WeightManifest) -> None:
        if manifest.version < self.version:
            raise WeightsError(
                f"update to version {manifest.version} would move backwards from {self.version}"
            )

    async def _run_update(self, label: str, coro_factory: Any) -> UpdateResult:
        """Serialise, time and account an update; any error keeps the old weights."""
        async with self._lock():
            t0 = time.perf_counter()
            try:
                pause_s = await coro_factory()
            except (WeightsError, ValueError, RuntimeError, OSError) as exc:
                self.stats.weight_updates_failed += 1
                self.stats.last_update_error = f"{label}: {exc}"
                log.warning("weight update refused", extra={"transport": label, "error": str(exc)})
                return UpdateResult(
                    ok=False,
                    version=self.version,
                    message=f"{label}: {exc}",
                    total_seconds=time.perf_counter() - t0,
                )
            total = time.perf_counter() - t0
            self.stats.weight_updates += 1
            self.stats.last_pause_seconds = pause_s
            self.stats.last_update_seconds = total
            log.info(
                "weights updated",
                extra={"transport": label, "version": self.version, "pause_s": round(pause_s, 4)},
            )
            return UpdateResult(True, self.version, "", pause_s, total)

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, Any], manifest: WeightManifest, *, verified: bool = False
    ) -> UpdateResult:
        """Apply tensors already in memory (gRPC stream, tests); verifies unless told done."""

        async def run() -> float:
            self._check_version(manifest)
            if not verified:
                await asyncio.to_thread(verify, tensors, manifest)
            return await self._apply_verified(tensors, manifest)

        return await self._run_update("tensors", run)

    async def update_weights_from_disk(
        self, path: str, manifest: WeightManifest | None
    ) -> UpdateResult:
        """Read and verify a safetensors directory, then apply it (disk transport)."""

        async def run() -> float:
            if manifest is not None:
                self._check_version(manifest)
            tensors, found = await asyncio.to_thread(load_weights, path, expected=manifest)
            self._check_version(found)
            return await self._apply_verified(tensors, found)

        return await self._run_update("disk", run)

    async def init_weights_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
    ) -> None:
        """Join a broadcast group (blocks until every member has joined).

        Rank 1.. receives from rank 0: the trainer's rank 0, or the node's relay in the
        two-level fan-out. Rank 0 makes this replica a relay, the source of its node's group;
        the store stays the trainer's (`master_address:master_port`) even then, so no replica
        ever hosts one."""
        old = self._group
        same_name = self._groups.pop(group_name, None)
        if same_name is not None:  # torch refuses a second group under a registered name
            same_name.release()
            if same_name is old:
                self._group = None
        if rank == 0:
            self._two_level = True
        group = await asyncio.to_thread(
            WeightsGroup,
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
            remote_store=True,
        )
        self._groups[group_name] = group
        if rank > 0:
            self._group = group
        if old is not None and rank > 0:
            log.info("replaced previous weights group")

    async def close_weights_group(self) -> None:
        """Leave the weights group (a collective: the trainer closes its side too). The
        groups of the two-level fan-out are left without a barrier: the relays and members
        of a node do not stop together."""
        group, self._group = self._group, None
        for other in self._groups.values():
            if other is not group or self._two_level:
                other.release()
        self._groups.clear()
        if group is not None and not self._two_level:
            await asyncio.to_thread(group.close)

    def _named_group(self, name: str) -> WeightsGroup:
        group = self._groups.get(name) if name else self._group
        if group is None:
            raise WeightsError(
                f"no weights group {name!r}: call InitWeightsGroup first"
                if name
                else "no weights group: call InitWeightsGroup first"
            )
        return group

    def _keep_groups(self, *names: str) -> None:
        """After a two-level update, forget the groups it did not use: the trainer re-forms
        a group under a new name, so an older one has no other members left."""
        for name in [n for n in self._groups if n not in names]:
            self._groups.pop(name).release()

    async def update_weights_from_distributed(
        self,
        manifest: WeightManifest,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        *,
        group_name: str = "",
        forward_group: str = "",
    ) -> UpdateResult:
        """Receive a broadcast (from the trainer's rank 0, or from the node's relay), verify
        it, apply it. With `forward_group` this replica is its node's relay: every bucket
        also goes down to that group as it arrives (`relay_buckets`). A failed forward does
        not fail this replica's own update (its copy is whole and verified); the members
        fail theirs, and the trainer re-forms the node's group."""
        forward_error: list[Exception] = []

        async def run() -> float:
            group = self._named_group(group_name)
            # Receive even when the version is wrong: the broadcast is collective and the
            # sender would hang on a replica that skipped it.
            if forward_group:
                relayed = await asyncio.to_thread(
                    relay_buckets, group, self._named_group(forward_group), specs, bucket_bytes
                )
                tensors = relayed.tensors
                if relayed.forward_error is not None:
                    forward_error.append(relayed.forward_error)
                    log.warning(
                        "relay could not forward the update to its node",
                        extra={"group": forward_group, "error": str(relayed.forward_error)},
                    )
            else:
                tensors = await asyncio.to_thread(recv_buckets, group, list(specs), bucket_bytes)
            if group_name:
                self._two_level = True
                self._keep_groups(group_name, forward_group)
            self._check_version(manifest)
            await asyncio.to_thread(verify, tensors, manifest)
            return await self._apply_verified(tensors, manifest)

        result = await self._run_update("distributed", run)
        if forward_error and result.ok:
            result.message = f"relayed to {forward_group} failed: {forward_error[0]}"
        return result
