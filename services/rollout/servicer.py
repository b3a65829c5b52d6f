"""gRPC servicer of `flywheel.v1.RolloutService`: a thin layer over the engine and the loop.

Bad input becomes INVALID_ARGUMENT; a weight update that cannot be applied is *not* an RPC
error but `ok=false` with the reason (the old weights keep serving, the caller decides).
Weight updates are deduplicated on `request_id`, so a retried disk update applies once.
A disk update loads only from the replica's weights root (`weights_root`, the trainer's
`weight_dir`); any other path gets the one answer `disk.PATH_REFUSED`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from flywheel_proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.codec import completion_to_proto, sampling_from_proto
from services.common.image_bytes import ImageLimits, images_problem
from services.common.weights.disk import (
    WeightsPathRefused,
    check_weights_dir,
    weights_dir_in_root,
)
from services.common.weights.grpc_stream import WeightAssembler
from services.common.weights.manifest import (
    DEFAULT_MAX_WEIGHT_BYTES,
    TensorSpec,
    WeightManifest,
    WeightsError,
    check_update_size,
)
from services.rollout.data.datasets import DatasetError, render_prompt
from services.rollout.engine.base import EngineBase
from services.rollout.metrics import RolloutMetrics
from services.rollout.types import UpdateResult

log = logging.getLogger(__name__)

MAX_COMPLETIONS_PER_REQUEST = 4096
IMAGE_LIMITS = ImageLimits()  # per prompt, as per trajectory group
_TRANSPORT_NAMES = {
    rollout_pb2.WEIGHT_TRANSPORT_DISK: "disk",
    rollout_pb2.WEIGHT_TRANSPORT_DISTRIBUTED: "distributed",
    rollout_pb2.WEIGHT_TRANSPORT_GRPC: "grpc",
}


def prompt_images(request: Any, n_prompts: int) -> list[list[bytes]]:
    """The images of each prompt of a `GenerateRequest` (empty lists for text), checked
    against the bounds a trajectory group's images obey; `ValueError` names the problem.
    Images go with `prompt_ids` only: the caller renders them with the model's processor,
    so the ids hold each image's tokens (the engine checks the count)."""
    if not request.images:
        return [[] for _ in range(n_prompts)]
    if request.prompts:
        raise ValueError(
            "images go with prompt_ids rendered by the model's processor, not text prompts"
        )
    if len(request.images) != n_prompts:
        raise ValueError(f"{len(request.images)} image entries for {n_prompts} prompts")
    out = []
    for i, entry in enumerate(request.images):
        data = [bytes(d) for d in entry.data]
        problem = images_problem(data, IMAGE_LIMITS)
        if problem is not None:
            raise ValueError(f"prompt {i}: {problem}")
        out.append(data)
    return out


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        engine: EngineBase,
        *,
        rollout_id: str,
        metrics: RolloutMetrics,
        loop: Any = None,
        set_serving: Callable[[bool], None] = lambda serving: None,
        max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES,
        dedup_entries: int = 256,
        weights_root: str | os.PathLike[str] | None = None,
    ) -> None:
        """`weights_root`: the only directory disk updates are loaded from (None: every
        disk update is refused)."""
        self.engine = engine
        self.rollout_id = rollout_id
        self.metrics = metrics
        self.loop = loop
        self.set_serving = set_serving
        self.max_weight_bytes = max_weight_bytes
        self.weights_root = weights_root
        self._done: collections.OrderedDict[str, UpdateResult] = collections.OrderedDict()
        self._pending: dict[str, asyncio.Future[UpdateResult]] = {}
        self._dedup_entries = dedup_entries
        self.draining = False

    # ---------------------------------------------------------------- helpers

    async def _dedup(
        self, request_id: str, run: Callable[[], Awaitable[UpdateResult]]
    ) -> UpdateResult:
        if request_id and request_id in self._done:
            return self._done[request_id]
        if request_id and request_id in self._pending:
            return await asyncio.shield(self._pending[request_id])
        fut: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
        if request_id:
            self._pending[request_id] = fut
        try:
            result = await run()
            fut.set_result(result)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved
            raise
        finally:
            self._pending.pop(request_id, None)
        if request_id:
            self._done[request_id] = result
            while len(self._done) > self._dedup_entries:
                self._done.popitem(last=False)
        return result

    async def _updating(
        self, transport: str, run: Callable[[], Awaitable[UpdateResult]]
    ) -> UpdateResult:
        self.set_serving(False)
        try:
            result = await run()
        finally:
            if not self.draining:
                self.set_serving(True)
        self.metrics.observe_update(
            transport, result.ok, result.total_seconds, result.pause_seconds
        )
        self.metrics.weight_version.set(self.engine.version)
        if result.ok and self.loop is not None:
            self.loop.weights_changed()  # a held Reserve asks again with the new version
        return result

    # ------------------------------------------------------------------- RPCs

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if bool(request.prompts) == bool(request.prompt_ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of prompts or prompt_ids"
            )
        n_prompts = len(request.prompts) or len(request.prompt_ids)
        if n_prompts * sampling.n_samples > MAX_COMPLETIONS_PER_REQUEST:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{n_prompts} prompts x n_samples {sampling.n_samples} exceeds "
                f"{MAX_COMPLETIONS_PER_REQUEST} completions per request",
            )
        try:
            images = prompt_images(request, n_prompts)
            if request.prompts:
                prompts = [render_prompt(self.engine.tokenizer, p)[1] for p in request.prompts]
            else:
                prompts = [list(p.ids) for p in request.prompt_ids]
            if any(not p for p in prompts):
                raise ValueError("an empty prompt was given")
            groups = await asyncio.gather(
                *(
                    self.engine.agenerate_n(
                        p,
                        sampling,
                        request_id=f"{request.request_id}-{i}",
                        **({"images": images[i]} if images[i] else {}),
                    )
                    for i, p in enumerate(prompts)
                )
            )
        except (ValueError, DatasetError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        resp = rollout_pb2.GenerateResponse(version=self.engine.version)
        for group in groups:
            for c in group:
                resp.completions.append(completion_to_proto(c))
        return resp

    async def UpdateWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        transport = _TRANSPORT_NAMES.get(request.transport, "")
        if transport not in ("disk", "distributed"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "transport must be WEIGHT_TRANSPORT_DISK or WEIGHT_TRANSPORT_DISTRIBUTED "
                "(gRPC chunks go through StreamWeights)",
            )
        manifest = (
            WeightManifest.from_proto(request.manifest) if request.HasField("manifest") else None
        )
        if transport == "disk":
            if not request.path:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path is required for disk")
            try:  # the directory's own manifest and files are what gets loaded
                path = await asyncio.to_thread(self._disk_path, request.path)
            except (WeightsError, OSError) as exc:
                return self._refused_update("disk", exc, time.perf_counter())

            async def run() -> UpdateResult:
                return await self.engine.update_weights_from_disk(str(path), manifest)

        else:
            if manifest is None or not request.specs:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "manifest and specs are required for a distributed update",
                )
            if request.bucket_bytes < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bucket_bytes must be >= 0")
            try:
                specs = [TensorSpec.from_proto(s) for s in request.specs]
                assert manifest is not None
                check_update_size(manifest, specs, self.max_weight_bytes)
            except WeightsError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            assert manifest is not None

            async def run() -> UpdateResult:
                return await self.engine.update_weights_from_distributed(
                    manifest,
                    specs,
                    request.bucket_bytes,
                    group_name=request.group_name,
                    forward_group=request.forward_group,
                )

        result = await self._dedup(request.request_id, lambda: self._updating(transport, run))
        return result.to_proto()

    async def StreamWeights(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> Any:
        t0 = time.perf_counter()
        assembler = WeightAssembler(max_total_bytes=self.max_weight_bytes)
        try:
            async for chunk in request_iterator:
                assembler.add(chunk)
            tensors, manifest = await asyncio.to_thread(assembler.finish)
        except WeightsError as exc:
            return self._refused_update("grpc", exc, t0)

        async def run() -> UpdateResult:
            r = await self.engine.update_weights_from_tensors(tensors, manifest, verified=True)
            r.total_seconds = time.perf_counter() - t0
            return r

        result = await self._dedup(assembler.request_id, lambda: self._updating("grpc", run))
        return result.to_proto()

    def _disk_path(self, requested: str) -> str:
        """The real path of a disk update's directory, checked inside the weights root and
        against `max_weight_bytes`; `WeightsPathRefused` (one message for every reason,
        the reason itself only in this replica's log) or `WeightsError`."""
        try:
            if self.weights_root is None:
                raise WeightsPathRefused("this replica has no weights root")
            path = weights_dir_in_root(self.weights_root, requested)
        except WeightsPathRefused as exc:
            log.warning("disk weight update refused", extra={"reason": exc.reason})
            raise
        check_weights_dir(path, self.max_weight_bytes)
        return str(path)

    def _refused_update(self, transport: str, exc: Exception, t0: float) -> Any:
        """An update refused before it reached the engine: ok=false with the reason."""
        self.engine.stats.weight_updates_failed += 1
        self.engine.stats.last_update_error = f"{transport}: {exc}"
        self.metrics.observe_update(transport, False, 0.0, 0.0)
        return UpdateResult(
            False, self.engine.version, f"{transport}: {exc}", 0.0, time.perf_counter() - t0
        ).to_proto()

    async def InitWeightsGroup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self.engine.init_weights_group(
                master_address=request.master_address,
                master_port=request.master_port,
                rank=request.rank,
                world_size=request.world_size,
                backend=request.backend or "gloo",
                group_name=request.group_name or "flywheel_weights",
            )
        except (WeightsError, RuntimeError, ValueError, OSError) as exc:
            log.warning("could not join weights group", extra={"error": str(exc)})
            return rollout_pb2.InitWeightsGroupResponse(ok=False, message=str(exc))
        return rollout_pb2.InitWeightsGroupResponse(ok=True)

    async def Pause(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.loop is not None:
            await self.loop.pause()
        else:
            await self.engine.pause()
        self.metrics.paused.set(1)
        return common_pb2.Version(version=self.engine.version)

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.loop is not None:
            await self.loop.resume()
        else:
            await self.engine.resume()
        self.metrics.paused.set(0)
        return common_pb2.Version(version=self.engine.version)

    async def GetVersion(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return common_pb2.Version(version=self.engine.version)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        e = self.engine
        resp = rollout_pb2.RolloutStats(
            version=e.version,
            requests_in_flight=e.requests_in_flight,
            tokens_generated=e.stats.tokens_generated,
            paused=e.paused or (self.loop is not None and self.loop.paused),
            rollout_id=self.rollout_id,
            checksum=e.checksum,
            draining=self.draining,
            weight_updates=e.stats.weight_updates,
            weight_updates_failed=e.stats.weight_updates_failed,
            last_update_error=e.stats.last_update_error,
            engine=e.name,
        )
        if self.loop is not None:
            resp.groups_produced = self.loop.stats.groups_produced
            for reason, n in self.loop.stats.rejected.items():
                resp.rejected[reason] = n
        return resp
