"""Client engine of a real SGLang server (HTTP), launched as a subprocess or reached by URL.

Endpoints used (SGLang's native HTTP API; request/response fields as SGLang documents them):

- `POST /generate` `{"input_ids", "sampling_params", "return_logprob": true, "rid"}` ->
  `{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort"},
  "output_token_logprobs": [[logprob, token_id, text], ...], ...}}`
- `POST /pause_generation`, `POST /continue_generation`
- `POST /abort_request` `{"rid": "", "abort_all": true}`
- `POST /update_weights_from_disk` `{"model_path", "weight_version"}` -> `{"success", "message"}`
- `POST /init_weights_update_group` `{"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"}` -> `{"success", "message"}`
- `POST /update_weights_from_distributed` `{"names", "dtypes", "shapes", "group_name",
  "flush_cache", "weight_version"}` -> `{"success", "message"}`
- `POST /flush_cache`, `POST /update_weight_version` `{"new_version", "abort_all_requests"}`
- `GET /health`

Interruptible generation: a weight update pauses the server (requests in flight come back
with `finish_reason.type == "abort"` and their partial output), swaps the weights, resumes,
and every interrupted request is resubmitted with its prompt extended by the partial output
(the server recomputes that KV). Each submission runs under one version, so the tokens of
every piece are tagged with the version they were sampled under.

What this client cannot check: in a distributed update SGLang receives the broadcast
itself, so the checksum is recorded but not recomputed here (disk and gRPC updates are
verified before SGLang sees them). SGLang expects one broadcast per tensor: the trainer
must send with `bucket_bytes=0`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.weights import (
    TensorSpec,
    WeightManifest,
    WeightsError,
    load_weights,
    save_weights,
)
from services.rollout.engine.base import InferenceEngine
from services.rollout.types import Completion, SamplingParams, StopReason, UpdateResult

log = logging.getLogger(__name__)

_HF_SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


class SGLangError(RuntimeError):
    """The SGLang server answered with an error or not at all."""


def sampling_to_sglang(
    s: SamplingParams, max_new_tokens: int, min_new_tokens: int
) -> dict[str, Any]:
    """Our sampling settings in SGLang's `sampling_params` vocabulary."""
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min_new_tokens,
        "temperature": 0.0 if s.is_greedy else s.temperature,
        "top_p": s.top_p,
        "top_k": -1 if s.top_k <= 0 else s.top_k,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        "no_stop_trim": True,
        "frequency_penalty": s.frequency_penalty,
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = int(s.seed)
    return out


def launch_command(
    model_path: str, host: str, port: int, tp_size: int, launch_args: Mapping[str, Any]
) -> list[str]:
    """`python -m sglang.launch_server ...`; `launch_args` keys become `--key-name value`
    (True -> a bare flag, False/None -> omitted)."""
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
    ]
    for key, value in launch_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        else:
            cmd.extend([flag, str(value)])
    return cmd


class SGLangEngine(InferenceEngine):
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
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/") if base_url else None
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.launch_args = dict(launch_args or {})
        self.tp_size = tp_size
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.host = host
        self.port = port
        self.scratch_dir = scratch_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: Any = None
        self._resume = asyncio.Event()
        self._resume.set()
        self._paused = False
        self._in_flight = 0
        self._aborting = False  # abort_all: returned requests are not resubmitted
        self._tokens = 0

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
        )

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        import httpx

        from services.rollout.engine.torch_engine import load_tokenizer

        if self.base_url is None:
            self._launch()
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.request_timeout)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.tokenizer_path)
        await self._wait_healthy()

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

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangError(f"SGLang server exited with code {self._proc.returncode}")
            try:
                r = await self._http.get("/health", timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = str(exc)
            await asyncio.sleep(0.5)
        raise SGLangError(
            f"SGLang at {self.base_url} not healthy after {self.startup_timeout}s: {last}"
        )

    async def stop(self) -> None:
        await self.abort_all()
        if self._http is not None:
            await self._http.aclose()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    async def _post(
        self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        r = await self._http.post(path, json=payload or {}, timeout=timeout or self.request_timeout)
        if r.status_code >= 400:
            raise SGLangError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            return {}

    # -------------------------------------------------------------- generation

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def requests_in_flight(self) -> int:
        return self._in_flight

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> Completion:
        sampling.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
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
                await self._resume.wait()
                version = self.version
                payload = {
                    "input_ids": prompt + out,
                    "sampling_params": sampling_to_sglang(
                        sampling,
                        budget - len(out),
                        max(0, sampling.min_new_tokens - len(out)),
                    ),
                    "return_logprob": True,
                    "rid": f"{rid}.{piece}",
                }
                piece += 1
                data = await self._post("/generate", payload)
                ids, piece_lps, kind = parse_generate_response(data)
                out.extend(ids)
                lps.extend(piece_lps)
                vers.extend([version] * len(ids))
                self._tokens += len(ids)
                self.stats.tokens_generated += len(ids)
                if kind != "abort":
                    reason = kind
                    break
                if self._aborting or len(out) >= budget:
                    reason = "abort" if len(out) < budget else "length"
                    break
                # Interrupted by a weight update or a pause: continue from where it stopped.
        finally:
            self._in_flight -= 1
        text = self.decode(out, sampling.skip_special_tokens)
        return Completion(out, lps, vers, reason, text, prompt)

    async def pause(self) -> None:
        self._paused = True
        self._resume.clear()
        await self._post("/pause_generation", {})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})
        self._paused = False
        self._resume.set()

    async def abort_all(self) -> None:
        if self._http is None:
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
        """Pause (interrupting requests), run `send()`, publish the version, resume."""
        was_paused = self._paused
        self._resume.clear()
        t0 = time.perf_counter()
        try:
            await self._post("/pause_generation", {})
            result = await send()
            if not result.get("success", False):
                raise WeightsError(f"SGLang refused the update: {result.get('message', '')}")
            await self._post(
                "/update_weight_version",
                {"new_version": str(manifest.version), "abort_all_requests": False},
            )
            self.version = manifest.version
            self.checksum = manifest.checksum
        finally:
            if not was_paused:
                await self._post("/continue_generation", {})
                self._resume.set()
        return time.perf_counter() - t0

    def _loadable_dir(self, path: str) -> str:
        """SGLang loads a directory as a model: give it the served model's config and
        tokenizer files beside the new safetensors (links in a scratch dir when missing)."""
        src = Path(path)
        if (src / "config.json").is_file():
            return str(src)
        root = Path(self.scratch_dir or tempfile.gettempdir())
        dst = Path(tempfile.mkdtemp(prefix="flywheel-sglang-", dir=root))
        for f in src.glob("*.safetensors"):
            os.symlink(f.resolve(), dst / f.name)
        for name in _HF_SIDECAR_FILES:
            cand = Path(self.model_path) / name
            if cand.is_file():
                shutil.copy(cand, dst / name)
        return str(dst)

    async def update_weights_from_disk(
        self, path: str, manifest: WeightManifest | None
    ) -> UpdateResult:
        async def run() -> float:
            if manifest is not None:
                self._check_version(manifest)
            # Verify before SGLang reads anything: a torn or corrupt dir is refused here.
            _, found = await asyncio.to_thread(load_weights, path, expected=manifest)
            self._check_version(found)
            target = await asyncio.to_thread(self._loadable_dir, path)

            async def send() -> Any:
                return await self._post(
                    "/update_weights_from_disk",
                    {"model_path": target, "weight_version": str(found.version)},
                )

            return await self._swap(send, found)

        return await self._run_update("disk", run)

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, Any], manifest: WeightManifest, *, verified: bool = False
    ) -> UpdateResult:
        """gRPC-streamed weights: written to a scratch safetensors dir, then loaded from disk."""
        scratch = Path(tempfile.mkdtemp(prefix="flywheel-weights-", dir=self.scratch_dir))
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

    async def update_weights_from_distributed(
        self, manifest: WeightManifest, specs: Sequence[TensorSpec], bucket_bytes: int
    ) -> UpdateResult:
        async def run() -> float:
            if bucket_bytes != 0:
                raise WeightsError(
                    f"bucket_bytes={bucket_bytes}: SGLang receives one broadcast per tensor; "
                    "send with bucket_bytes=0"
                )
            group = getattr(self, "_group_name", None)
            if group is None:
                raise WeightsError("no weights group: call InitWeightsGroup first")
            self._check_version(manifest)

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


def parse_generate_response(data: Any) -> tuple[list[int], list[float], StopReason]:
    """Token ids, their logprobs and the finish type of one `/generate` answer."""
    if isinstance(data, list):  # a batch answer for one prompt
        if len(data) != 1:
            raise SGLangError(f"/generate returned {len(data)} results for one prompt")
        data = data[0]
    meta = data.get("meta_info", {})
    triples = meta.get("output_token_logprobs") or []
    ids = [int(t[1]) for t in triples]
    lps = [float(t[0]) for t in triples]
    if not triples and data.get("output_ids"):
        raise SGLangError("/generate returned tokens without logprobs (return_logprob ignored?)")
    if data.get("output_ids") is not None and list(data["output_ids"]) != ids:
        raise SGLangError("/generate output_ids and output_token_logprobs disagree")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"/generate finish_reason {finish!r} is not stop/length/abort")
    return ids, lps, kind  # type: ignore[return-value]
