"""Client engine of a real SGLang server (HTTP), launched as a subprocess or reached by URL.

SGLang's HTTP and command-line vocabulary (the endpoints and their fields) is
`sglang_protocol.py`'s; this module is the engine around it.

Two HTTP connection pools: generation (`/generate`, as many connections as requests in
flight) and control (everything else, a few connections of its own), so a pause or an
update never waits behind hundreds of generation requests for a free connection.

Versions: every token is tagged with the version the server reports for it
(`meta_info.weight_versions`, else `meta_info.weight_version`), not with the client's
snapshot: a request that slipped past a pause and ran on new weights says so. The server is
told each update's version with the update itself. A server reporting a version below the
one this client last installed (a restart: SGLang comes back on its base weights, reporting
`"default"` or whatever `--weight-version` it was launched with) is noticed on the next
answer: the engine then reports the version the server really serves (base = 0), forgets
its weights group (the server lost it), and counts it in `server_restarts`; the rollout
loop's catch-up then loads the newest published weights and the trainer rebuilds the
group, so the replica re-syncs instead of labelling base-model tokens with a new version.

Interruptible generation: a weight update pauses the server, swaps the weights, resumes, and
every interrupted request is resubmitted with its prompt extended by the partial output (the
server recomputes that KV). A request aborted by anyone else (an operator's
`/abort_request`, a server-side abort) is not resubmitted: it finishes with `abort` and what
it had, possibly nothing when it was aborted before prefill.

Weights on disk are handed over by path: SGLang opens the folder in its own container, so
the rollout writes what it sends (a folder of links to the published safetensors beside the
model's config, or the safetensors of a gRPC-streamed update) into `scratch_dir`, on a volume
both mount at the same path (`handover_dir`). The rollout reads the manifest and the
safetensors headers only, never the tensors (a float32 model of billions of parameters would
not fit beside SGLang's), so it refuses torn, truncated or mislabelled folders, not data
corrupted in place; SGLang reads the data.

What this client cannot check: in a distributed update SGLang receives the broadcast
itself, so the checksum is recorded but not recomputed here (gRPC updates are verified
before they are written; disk updates as above). SGLang expects one broadcast per tensor:
the trainer must send with `bucket_bytes=0`. A replica with `tp_size` N takes ranks
`rank_offset .. rank_offset + N - 1` of the group (SGLang ranks each TP worker at
`rank_offset + tp_rank`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.weights.disk import save_weights
from services.common.weights.manifest import TensorSpec, WeightManifest, WeightsError
from services.core.types import Completion, SamplingParams, StopReason
from services.rollout.engine.base import EngineBase
from services.rollout.engine.safetensors_headers import check_weights_headers
from services.rollout.engine.sglang_handover import WeightHandover, handover_dir
from services.rollout.engine.sglang_protocol import (
    ContextOverflowError,
    SGLangError,
    answer_json,
    image_data,
    launch_command,
    meta_info,
    parse_generate_response,
    sampling_to_sglang,
    server_version,
    token_versions,
)
from services.rollout.types import UpdateResult

log = logging.getLogger(__name__)

CONTROL_CONNECTIONS = 4
"""Connections of the control pool: pause, continue, abort, updates, groups, liveness."""


class SGLangEngine(EngineBase):
    name = "sglang"

    def __init__(
        self,
        base_url: str | None,
        *,
        model_path: str,
        tokenizer_path: str | None = None,
        launch_args: Mapping[str, Any] | None = None,
        tp_size: int = 1,
        startup_timeout: float = 600.0,
        request_timeout: float = 3600.0,
        host: str = "127.0.0.1",
        port: int = 0,
        scratch_dir: str | None = None,
        control_timeout: float = 600.0,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/") if base_url else None
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.launch_args = dict(launch_args or {})
        self.tp_size = tp_size
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.control_timeout = control_timeout
        self.host = host
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._gen: Any = None  # generation pool: /generate only
        self._ctl: Any = None  # control pool: everything else
        self._resume = asyncio.Event()
        self._resume.set()
        self._paused = False
        self._in_flight = 0
        self._aborting = False  # abort_all: returned requests are not resubmitted
        self._tokens = 0
        self._interrupts = 0  # pauses this client made: aborts they cause are resubmitted
        self._updates = 0  # updates this client installed (a piece's answer is checked
        # against the version only when no update happened while it ran)
        self._group_name: str | None = None
        self._handover = WeightHandover(model_path, scratch_dir)
        self.unknown_names = 0
        """Tensor names sent in updates that the served checkpoint does not have."""
        self.server_restarts = 0
        """Times the server was found back on older weights than this client installed."""

    @property
    def scratch_dir(self) -> str | None:
        """The folder weights are handed over in (`WeightHandover.root`)."""
        return self._handover.scratch_dir

    @scratch_dir.setter
    def scratch_dir(self, value: str | None) -> None:
        self._handover.scratch_dir = value

    @classmethod
    def from_config(cls, cfg: Any, *, replica_index: int = 0, tokenizer_path: str) -> SGLangEngine:
        sg = cfg.rollout.sglang
        return cls(
            sg.url,
            model_path=cfg.actor.path,
            tokenizer_path=tokenizer_path,
            launch_args=sg.launch_args,
            tp_size=sg.tp_size,
            startup_timeout=sg.startup_timeout,
            request_timeout=cfg.rollout.request_timeout,
            control_timeout=max(60.0, float(cfg.rollout.weight_update_timeout)),
            scratch_dir=handover_dir(cfg),
        )

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        import httpx

        from services.rollout.engine.torch_engine import load_tokenizer

        if self.base_url is None:
            self._launch()
        assert self.base_url is not None
        # A server started with --api-key (the Helm chart's) wants it on every call but /health.
        key = os.environ.get("SGLANG_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else None
        # Generation: one connection per request in flight, never shared with control.
        self._gen = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=self.request_timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._ctl = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=self.control_timeout,
            limits=httpx.Limits(
                max_connections=CONTROL_CONNECTIONS,
                max_keepalive_connections=CONTROL_CONNECTIONS,
            ),
        )
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.tokenizer_path)
        await self._wait_healthy()
        # A server that already serves published weights (this client restarted, the
        # server did not) says which: serve under that version, not 0.
        info = await self.model_info()
        v = server_version(info.get("weight_version"))
        if v is not None:
            self.version = v
        # SGLang says whether its model reads images; a text model is sent none.
        self.accepts_images = bool(info.get("has_image_understanding"))

    def _launch(self) -> None:
        import socket

        if not self.port:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        cmd = launch_command(self.model_path, self.host, self.port, self.tp_size, self.launch_args)
        log.info("launching SGLang server", extra={"cmd": " ".join(cmd)})
        self._proc = subprocess.Popen(cmd)  # noqa: S603 - our own command line
        self.base_url = f"http://{self.host}:{self.port}"

    async def alive(self) -> bool:
        """Liveness without generating: `/ping` (200 once started, paused or not; SGLang's
        `/health` generates a token and answers 503 while paused)."""
        try:
            r = await self._ctl.get("/ping", timeout=5.0)
        except Exception:  # noqa: BLE001 - not up
            return False
        return bool(r.status_code == 200)

    async def model_info(self) -> dict[str, Any]:
        """`GET /model_info` (model path, `weight_version`) on the control pool."""
        r = await self._ctl.get("/model_info", timeout=30.0)
        if r.status_code >= 400:
            raise SGLangError(f"/model_info: HTTP {r.status_code}: {r.text[:500]}")
        return dict(r.json())

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangError(f"SGLang server exited with code {self._proc.returncode}")
            try:
                r = await self._ctl.get("/ping", timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = str(exc)
            else:
                if r.status_code == 200:
                    return
                if r.status_code in (401, 403):  # an answer, not a server still starting
                    raise SGLangError(
                        f"SGLang at {self.base_url} refused the API key (HTTP {r.status_code}): "
                        "set SGLANG_API_KEY to the server's --api-key"
                    )
                last = f"HTTP {r.status_code}"
            await asyncio.sleep(0.5)
        raise SGLangError(
            f"SGLang at {self.base_url} not healthy after {self.startup_timeout}s: {last}"
        )

    async def stop(self) -> None:
        await self.abort_all()
        for client in (self._gen, self._ctl):
            if client is not None:
                await client.aclose()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    async def _post(
        self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """A control call (never on the generation pool)."""
        r = await self._ctl.post(path, json=payload or {}, timeout=timeout or self.control_timeout)
        return answer_json(path, r)

    # -------------------------------------------------------------- generation

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def requests_in_flight(self) -> int:
        return self._in_flight

    async def _generate_piece(self, payload: dict[str, Any]) -> Any:
        r = await self._gen.post("/generate", json=payload, timeout=self.request_timeout)
        if r.status_code == 400 and "context length" in r.text:
            raise ContextOverflowError(f"/generate: HTTP 400: {r.text[:500]}")
        return answer_json("/generate", r)

    def _observe(self, reported: int | None, updates_at_submit: int) -> None:
        """A piece that ran with no update of ours in between reports an older version than
        we installed: the server restarted on its launch weights (or was reset by someone
        else). Serve under what it really has and forget the group it lost."""
        if reported is None or updates_at_submit != self._updates or not self._resume.is_set():
            return
        if reported < self.version:
            log.error(
                "SGLang server serves older weights than this client installed "
                "(restarted?); reporting its version and dropping the weights group",
                extra={"installed": self.version, "served": reported, "url": self.base_url},
            )
            self.server_restarts += 1
            self.version = reported
            self.checksum = ""
            self._group_name = None

    async def agenerate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
    ) -> Completion:
        self.refuse_images(images)
        sampling.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        # Sent with every piece: a resubmitted piece is the same prompt, images included.
        media = {"image_data": image_data(images)} if images else {}
        budget = sampling.max_new_tokens
        if sampling.max_tokens > 0:
            budget = min(budget, sampling.max_tokens - len(prompt))
        if budget <= 0:
            return Completion([], [], [], "length", "", prompt)
        out: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        reason: StopReason = "abort"
        rid = request_id or uuid.uuid4().hex
        self._in_flight += 1
        try:
            piece = 0
            while True:
                while not self._resume.is_set():
                    await self._resume.wait()
                interrupts, updates, snapshot = self._interrupts, self._updates, self.version
                payload = {
                    "input_ids": prompt + out,
                    "sampling_params": sampling_to_sglang(
                        sampling,
                        budget - len(out),
                        max(0, sampling.min_new_tokens - len(out)),
                    ),
                    "return_logprob": True,
                    "rid": f"{rid}.{piece}",
                    **media,
                }
                piece += 1
                try:
                    data = await self._generate_piece(payload)
                except ContextOverflowError as exc:
                    if not out:
                        raise ContextOverflowError(
                            f"prompt of {len(prompt)} tokens + max_new_tokens {budget} exceed "
                            f"the server's context length; cap them with gconfig.max_tokens "
                            f"({exc})"
                        ) from exc
                    reason = "length"  # the resubmitted prompt + remaining budget overflow
                    break
                ids, piece_lps, kind = parse_generate_response(data)
                meta = meta_info(data)
                piece_vers = token_versions(meta, len(ids), snapshot)
                self._observe(server_version(meta.get("weight_version")), updates)
                out.extend(ids)
                lps.extend(piece_lps)
                vers.extend(piece_vers)
                self._tokens += len(ids)
                self.stats.tokens_generated += len(ids)
                if kind != "abort":
                    reason = kind
                    break
                if self._aborting or len(out) >= budget:
                    reason = "abort" if len(out) < budget else "length"
                    break
                if interrupts == self._interrupts and self._resume.is_set():
                    # Aborted by someone else (an operator, the server): not resubmitted.
                    break
                # Interrupted by our own pause or weight update: continue where it stopped.
        finally:
            self._in_flight -= 1
        text = self.decode(out, sampling.skip_special_tokens)
        return Completion(out, lps, vers, reason, text, prompt)

    async def pause(self) -> None:
        self._paused = True
        self._resume.clear()
        self._interrupts += 1
        await self._post("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})
        self._paused = False
        self._resume.set()

    async def abort_all(self) -> None:
        if self._ctl is None:
            return
        self._aborting = True
        self._resume.set()
        try:
            await self._post("/abort_request", {"rid": "", "abort_all": True}, timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - server may already be gone
            log.warning("abort_request failed", extra={"error": str(exc)})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    # ----------------------------------------------------------------- weights

    async def _swap(self, send: Any, manifest: WeightManifest) -> float:
        """Pause (interrupting requests), run `send()` (which names the new version, so
        SGLang labels tokens with it from the first one on), resume."""
        was_paused = self._paused
        self._resume.clear()
        self._interrupts += 1
        t0 = time.perf_counter()
        try:
            await self._post("/pause_generation", {"mode": "abort"})
            result = await send()
            if not result.get("success", False):
                raise WeightsError(f"SGLang refused the update: {result.get('message', '')}")
            self.version = manifest.version
            self.checksum = manifest.checksum
            self._updates += 1
        finally:
            if not was_paused:
                await self._post("/continue_generation", {})
                self._resume.set()
        return time.perf_counter() - t0

    async def update_weights_from_disk(
        self, path: str, manifest: WeightManifest | None
    ) -> UpdateResult:
        async def run() -> float:
            if manifest is not None:
                self._check_version(manifest)
            # Checked before SGLang reads anything, from the headers only: a torn folder,
            # a truncated file or another version is refused here; the tensors are read
            # by SGLang alone.
            names, found = await asyncio.to_thread(check_weights_headers, path, manifest)
            self._check_version(found)
            self.unknown_names += self._handover.unknown_names(names, refuse=True)
            target, prepared = await asyncio.to_thread(
                self._handover.loadable_dir, path, found.version
            )

            async def send() -> Any:
                return await self._post(
                    "/update_weights_from_disk",
                    {"model_path": target, "weight_version": str(found.version)},
                )

            try:
                return await self._swap(send, found)
            finally:
                if prepared is not None:  # links and config copies: SGLang has loaded them
                    shutil.rmtree(prepared, ignore_errors=True)

        return await self._run_update("disk", run)

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, Any], manifest: WeightManifest, *, verified: bool = False
    ) -> UpdateResult:
        """gRPC-streamed weights: written as safetensors into `scratch_dir` (where SGLang
        can read them), then loaded from disk."""
        try:
            scratch = self._handover.scratch("streamed-")
        except (WeightsError, OSError) as exc:
            return UpdateResult(False, self.version, f"tensors: {exc}")
        try:
            written = await asyncio.to_thread(save_weights, scratch, tensors, manifest.version)
            if written.checksum != manifest.checksum:
                return UpdateResult(False, self.version, "tensors: checksum mismatch")
            return await self.update_weights_from_disk(str(scratch), manifest)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

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
        """Have SGLang join the trainer's group with its TP workers at ranks
        `rank .. rank + tp_size - 1` (`rank` is SGLang's `rank_offset`). A group of the same
        name left from an earlier attempt (a failed publication, this client restarting) is
        destroyed first: SGLang refuses to create a group whose name is taken."""
        if rank < 1 or rank + self.tp_size > world_size:
            raise WeightsError(
                f"rank_offset {rank} with tp_size {self.tp_size} does not fit world_size "
                f"{world_size} (the trainer is rank 0; this replica needs ranks "
                f"{rank}..{rank + self.tp_size - 1})"
            )
        await self.destroy_weights_group(group_name)
        result = await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )
        if not result.get("success", False):
            raise WeightsError(f"SGLang could not join the group: {result.get('message', '')}")
        self._group_name = group_name

    async def destroy_weights_group(self, group_name: str | None = None) -> bool:
        """`/destroy_weights_update_group`; False when the server had no such group."""
        name = group_name or self._group_name
        if name is None:
            return False
        try:
            result = await self._post("/destroy_weights_update_group", {"group_name": name})
        except SGLangError as exc:  # 400: "The group to be destroyed does not exist."
            log.info("no weights group to destroy", extra={"group": name, "reason": str(exc)})
            result = {"success": False}
        if name == self._group_name:
            self._group_name = None
        return bool(result.get("success", False))

    async def close_weights_group(self) -> None:
        await self.destroy_weights_group()

    async def update_weights_from_distributed(
        self,
        manifest: WeightManifest,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        *,
        group_name: str = "",
        forward_group: str = "",
    ) -> UpdateResult:
        async def run() -> float:
            if forward_group:
                raise WeightsError(
                    "an SGLang server cannot relay a broadcast; the two-level fan-out "
                    "(trainer.weight_fanout: two_level) needs the torch engine"
                )
            if bucket_bytes != 0:
                raise WeightsError(
                    f"bucket_bytes={bucket_bytes}: SGLang receives one broadcast per tensor; "
                    "send with bucket_bytes=0"
                )
            group = self._group_name
            if group is None:
                raise WeightsError("no weights group: call InitWeightsGroup first")
            self._check_version(manifest)
            # Only a warning here: refusing now would leave the trainer's broadcast hanging.
            self.unknown_names += self._handover.unknown_names(
                [s.name for s in specs], refuse=False
            )

            async def send() -> Any:
                return await self._post(
                    "/update_weights_from_distributed",
                    {
                        "names": [s.name for s in specs],
                        "dtypes": [s.dtype for s in specs],
                        "shapes": [list(s.shape) for s in specs],
                        "group_name": group,
                        "flush_cache": True,
                        "weight_version": str(manifest.version),
                    },
                )

            return await self._swap(send, manifest)

        return await self._run_update("distributed", run)

    async def _apply_verified(self, tensors: Mapping[str, Any], manifest: WeightManifest) -> float:
        raise WeightsError("the SGLang engine applies weights through its own endpoints")
