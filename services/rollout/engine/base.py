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
from services.common.weights.distributed import WeightsGroup, recv_buckets
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
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> Completion:
        """One completion of `prompt_ids` (n_samples is ignored here; see `agenerate_n`)."""

    async def agenerate_n(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> list[Completion]:
        """`sampling.n_samples` completions of one prompt, generated concurrently.

        With a seed, sample i uses `seed + i`, so a group is reproducible and its samples
        differ from each other.
        """
        rid = request_id or uuid.uuid4().hex
        tasks = []
        for i in range(sampling.n_samples):
            seed = None if sampling.seed is None else sampling.seed + i
            one = SamplingParams(**{**sampling.__dict__, "n_samples": 1, "seed": seed})
            tasks.append(self.agenerate(prompt_ids, one, request_id=f"{rid}-{i}"))
        return list(await asyncio.gather(*tasks))

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
        """Join the trainer's broadcast group (blocks until every member has joined)."""
        if rank == 0:
            raise WeightsError("rank 0 of the weights group is the trainer; replicas use 1..N")
        old = self._group
        self._group = await asyncio.to_thread(
            WeightsGroup,
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
        )
        if old is not None:
            log.info("replaced previous weights group")

    async def close_weights_group(self) -> None:
        """Leave the weights group (a collective: the trainer closes its side too)."""
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)

    async def update_weights_from_distributed(
        self, manifest: WeightManifest, specs: Sequence[TensorSpec], bucket_bytes: int
    ) -> UpdateResult:
        """Receive a broadcast from the trainer's rank 0, verify it, apply it."""

        async def run() -> float:
            group = self._group
            if group is None:
                raise WeightsError("no weights group: call InitWeightsGroup first")
            # Receive even when the version is wrong: the broadcast is collective and the
            # sender would hang on a replica that skipped it.
            tensors = await asyncio.to_thread(recv_buckets, group, list(specs), bucket_bytes)
            self._check_version(manifest)
            await asyncio.to_thread(verify, tensors, manifest)
            return await self._apply_verified(tensors, manifest)

        return await self._run_update("distributed", run)
