"""A STAND-IN for an SGLang server, for tests only: SGLang cannot be installed on this machine.

It speaks the subset of SGLang's native HTTP API that `SGLangEngine` uses, with SGLang's
documented request and response fields, and generates with Flywheel's own torch engine so
that tokens, logprobs, pauses (in-flight requests come back with `finish_reason.type ==
"abort"` and their partial output) and weight updates behave as on a real server. Every call
is recorded in `calls` so tests can check what the client sent. It is NOT SGLang: it checks
the client's side of the contract, not SGLang's behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from services.common.weights import TensorSpec, WeightManifest, recv_buckets, state_dict_checksum
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.types import SamplingParams


def _sampling(sp: dict[str, Any]) -> SamplingParams:
    temp = float(sp.get("temperature", 1.0))
    top_k = int(sp.get("top_k", -1))
    return SamplingParams(
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        min_new_tokens=int(sp.get("min_new_tokens", 0)),
        greedy=temp == 0.0,
        temperature=temp,
        top_p=float(sp.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        stop=list(sp.get("stop") or []),
        stop_token_ids=list(sp.get("stop_token_ids") or []),
        ignore_eos=bool(sp.get("ignore_eos", False)),
        skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
        frequency_penalty=float(sp.get("frequency_penalty", 0.0)),
        seed=sp.get("sampling_seed"),
    )


def build_app(standin: SGLangStandIn) -> FastAPI:
    eng = standin.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await eng.start()
        yield
        await eng.stop()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/generate")
    async def generate(req: Request) -> dict[str, Any]:
        body = await req.json()
        standin.calls.append(("/generate", body))
        c = await eng.agenerate(body["input_ids"], _sampling(body.get("sampling_params", {})))
        meta: dict[str, Any] = {
            "id": body.get("rid", ""),
            "finish_reason": {"type": c.stop_reason},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(c.output_ids),
            "weight_version": standin.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(c.logprobs, c.output_ids, strict=True)
            ]
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause(req: Request) -> dict[str, Any]:
        standin.calls.append(("/pause_generation", await req.json()))
        await eng.pause()
        await eng.abort_all()  # SGLang's default pause mode: in-flight requests return now
        return {}

    @app.post("/continue_generation")
    async def resume(req: Request) -> dict[str, Any]:
        standin.calls.append(("/continue_generation", await req.json()))
        await eng.resume()
        return {}

    @app.post("/abort_request")
    async def abort(req: Request) -> dict[str, Any]:
        body = await req.json()
        standin.calls.append(("/abort_request", body))
        if body.get("abort_all"):
            await eng.abort_all()
        return {}

    @app.post("/flush_cache")
    async def flush(req: Request) -> dict[str, Any]:
        standin.calls.append(("/flush_cache", {}))
        return {}

    @app.post("/update_weight_version")
    async def update_version(req: Request) -> dict[str, Any]:
        body = await req.json()
        standin.calls.append(("/update_weight_version", body))
        standin.weight_version = body["new_version"]
        return {"success": True, "message": ""}

    @app.post("/update_weights_from_disk")
    async def from_disk(req: Request) -> dict[str, Any]:
        from safetensors.torch import load_file

        body = await req.json()
        standin.calls.append(("/update_weights_from_disk", body))
        path = Path(body["model_path"])
        if not (path / "config.json").is_file():
            return {"success": False, "message": f"{path} is not a model directory"}
        tensors: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        version = int(body.get("weight_version") or eng.version)
        manifest = WeightManifest(version, state_dict_checksum(tensors), len(tensors), 0)
        r = await eng.update_weights_from_tensors(tensors, manifest, verified=True)
        return {"success": r.ok, "message": r.message, "num_paused_requests": 0}

    @app.post("/init_weights_update_group")
    async def init_group(req: Request) -> dict[str, Any]:
        body = await req.json()
        standin.calls.append(("/init_weights_update_group", body))
        try:
            await eng.init_weights_group(
                master_address=body["master_address"],
                master_port=body["master_port"],
                rank=body["rank_offset"],
                world_size=body["world_size"],
                backend=body.get("backend", "nccl"),
                group_name=body.get("group_name", "weight_update_group"),
            )
        except Exception as exc:  # noqa: BLE001 - reported as SGLang does
            return {"success": False, "message": str(exc)}
        return {"success": True, "message": ""}

    @app.post("/update_weights_from_distributed")
    async def from_distributed(req: Request) -> dict[str, Any]:
        body = await req.json()
        standin.calls.append(("/update_weights_from_distributed", body))
        specs = [
            TensorSpec(n, d, tuple(s))
            for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
        ]
        # One broadcast per tensor in its own dtype, as SGLang receives them.
        tensors = await asyncio.to_thread(recv_buckets, eng._group, specs, 0)
        version = int(body.get("weight_version") or eng.version)
        manifest = WeightManifest(version, state_dict_checksum(tensors), len(tensors), 0)
        r = await eng.update_weights_from_tensors(tensors, manifest, verified=True)
        return {"success": r.ok, "message": r.message}

    return app


class SGLangStandIn:
    """Runs the stand-in app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = TorchEngine(model_dir, max_batch_size=4, device="cpu")
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.weight_version = "0"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(self), host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> SGLangStandIn:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in did not start")
            time.sleep(0.01)
        return self

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
