"""Typed async client of one rollout replica (used by the trainer, launcher and evaluation).

Retries follow one rule: a call is repeated only when repeating is harmless. Reads
(GetVersion, Stats), Pause/Resume (they set a state) and Generate (no side effect) are
retried on transient errors; a disk update carries a `request_id` the replica deduplicates
on, so it is retried too. A distributed update is a collective broadcast and a weight
stream is consumed as it is sent: neither is retried here, the caller decides.

An outage of the replica is retried for `outage_budget_s`, seconds by default rather than
the minutes of the buffer's clients, and once it is known down each call makes one attempt
until the replica answers again: the trainer skips a replica that misses an update and
brings it up to date when it is back (the replica also pulls the newest weights itself), so
a restarting replica must not hold every training step. The channel reconnects within
seconds of the replica's return (services/common/grpc_client.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import grpc

from flywheel_proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.codec import completion_from_proto, sampling_to_proto
from services.common.config.services import TLSConfig
from services.common.grpc_client import OUTAGE, RetryingClient, make_channel, status_code
from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.common.outage import PeerHealth
from services.core.types import Completion, SamplingParams
from services.wire.rollout_types import RolloutStatsView, UpdateResult

if TYPE_CHECKING:  # torch is only needed by callers that send tensors
    import torch

    from services.common.weights.manifest import TensorSpec, WeightManifest

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_OUTAGE_BUDGET_S = 10.0


@dataclass
class GenerateResult:
    """Completions prompt-major (`n_samples` per prompt, in order) and the version served
    when the request finished."""

    completions: list[Completion]
    version: int


def _rid(request_id: str | None) -> str:
    return request_id or uuid.uuid4().hex


class RolloutClient(RetryingClient):
    """One replica at `address` (`host:port`). Use as `async with RolloutClient(...) as c:`."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        timeout: float = 60.0,
        retries: int | None = None,
        outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        weight_update_timeout: float = 600.0,
        peer: PeerHealth | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._retry_settings("rollout", address, timeout, retries, outage_budget_s, peer)
        self.weight_update_timeout = weight_update_timeout
        self._channel = make_channel(
            address, max_message_bytes=max_message_bytes, auth_token=auth_token, tls=tls
        )
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    def _retries_now(self) -> int | None:
        return 0 if self.peer.down else self.retries

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompts: Sequence[str] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Generate for text prompts (tokenized by the replica, chat template when its
        tokenizer has one) or token-id prompts; exactly one of the two."""
        if (prompts is None) == (prompt_ids is None):
            raise ValueError("generate: pass exactly one of prompts= or prompt_ids=")
        sampling = (sampling or SamplingParams()).validate()
        req = rollout_pb2.GenerateRequest(
            request_id=_rid(request_id), sampling=sampling_to_proto(sampling)
        )
        if prompts is not None:
            req.prompts.extend(prompts)
        else:
            for ids in prompt_ids or ():
                req.prompt_ids.add(ids=list(ids))
        resp = await self._retrying(self._stub.Generate, req, idempotent=True, timeout=timeout)
        return GenerateResult([completion_from_proto(c) for c in resp.completions], resp.version)

    # ---------------------------------------------------------------- weights

    async def update_weights(
        self,
        transport: Literal["disk", "distributed"],
        manifest: WeightManifest,
        *,
        path: str | None = None,
        specs: Sequence[TensorSpec] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group_name: str = "",
        forward_group: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Apply weights from a safetensors directory (`path`) or a broadcast in the
        weights group (`specs` in send order, `bucket_bytes` as the sender uses). Two-level
        fan-out: `group_name` is the group to receive from, `forward_group` the node group
        a relay re-broadcasts to."""
        req = rollout_pb2.UpdateWeightsRequest(
            request_id=_rid(request_id), manifest=manifest.to_proto()
        )
        if transport == "disk":
            if not path:
                raise ValueError("update_weights(transport='disk') needs path=")
            req.transport = rollout_pb2.WEIGHT_TRANSPORT_DISK
            req.path = str(path)
            idempotent = True
        elif transport == "distributed":
            if not specs:
                raise ValueError("update_weights(transport='distributed') needs specs=")
            req.transport = rollout_pb2.WEIGHT_TRANSPORT_DISTRIBUTED
            req.specs.extend(s.to_proto() for s in specs)
            req.bucket_bytes = bucket_bytes
            req.group_name = group_name
            req.forward_group = forward_group
            idempotent = False
        else:
            raise ValueError(
                f"transport={transport!r}: use 'disk', 'distributed' or stream_weights()"
            )
        resp = await self._retrying(
            self._stub.UpdateWeights,
            req,
            idempotent=idempotent,
            timeout=timeout or self.weight_update_timeout,
        )
        return UpdateResult.from_proto(resp)

    async def update_weights_from_disk(
        self, path: str, manifest: WeightManifest, **kwargs: Any
    ) -> UpdateResult:
        return await self.update_weights("disk", manifest, path=path, **kwargs)

    async def update_weights_distributed(
        self,
        manifest: WeightManifest,
        specs: Sequence[TensorSpec],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **kwargs: Any,
    ) -> UpdateResult:
        return await self.update_weights(
            "distributed", manifest, specs=specs, bucket_bytes=bucket_bytes, **kwargs
        )

    async def stream_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        manifest: WeightManifest,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Send the tensors as a stream of chunks (name order, manifest first)."""
        from services.common.weights.grpc_stream import iter_weight_chunks

        chunks = iter_weight_chunks(
            named_tensors, manifest, chunk_bytes=chunk_bytes, request_id=_rid(request_id)
        )
        started = time.monotonic()
        try:
            resp = await self._stub.StreamWeights(
                chunks, timeout=timeout or self.weight_update_timeout
            )
        except grpc.RpcError as err:  # not retried (the stream is consumed), but reported
            if status_code(err) in OUTAGE:
                self.peer.failed(since=started)
            raise
        self.peer.answered()
        return UpdateResult.from_proto(resp)

    async def init_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "flywheel_weights",
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Make the replica join the trainer's weight-broadcast group as `rank`. Returns once
        the rendezvous completed; raises `RuntimeError` with the replica's reason otherwise."""
        req = rollout_pb2.InitWeightsGroupRequest(
            request_id=_rid(request_id),
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
        )
        resp = await self._retrying(
            self._stub.InitWeightsGroup,
            req,
            idempotent=False,
            timeout=timeout or self.weight_update_timeout,
        )
        if not resp.ok:
            raise RuntimeError(
                f"rollout {self.address} could not join weights group: {resp.message}"
            )

    # ---------------------------------------------------------------- control

    async def pause(self, request_id: str | None = None) -> int:
        """Stop starting new groups and pause decoding between steps; returns the version."""
        resp = await self._retrying(
            self._stub.Pause, rollout_pb2.PauseRequest(request_id=_rid(request_id)), idempotent=True
        )
        return int(resp.version)

    async def resume(self, request_id: str | None = None) -> int:
        resp = await self._retrying(
            self._stub.Resume,
            rollout_pb2.PauseRequest(request_id=_rid(request_id)),
            idempotent=True,
        )
        return int(resp.version)

    async def get_version(self) -> int:
        resp = await self._retrying(self._stub.GetVersion, common_pb2.Empty(), idempotent=True)
        return int(resp.version)

    async def stats(self) -> RolloutStatsView:
        resp = await self._retrying(self._stub.Stats, common_pb2.Empty(), idempotent=True)
        return RolloutStatsView.from_proto(resp)
