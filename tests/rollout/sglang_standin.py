"""A STAND-IN for an SGLang 0.5.23 server, for tests only: SGLang cannot run on this machine.

It speaks the subset of SGLang's native HTTP API that `SGLangEngine` uses and generates with
Flywheel's own torch engine, so tokens and logprobs are real. It is held to SGLang's contract
in two ways:

- Shapes: every request body is checked against the fields of SGLang's own request classes,
  extracted from the pinned wheel into `tests/rollout/sglang_schema.json`
  (`tools/sglang_schema.py`): a missing required field or a field SGLang does not have is
  answered HTTP 400, as SGLang's contract gate (`api/v1` `SamplingParams` rejects unknown
  keys) or request parsing would. Every violation is also kept in `contract_errors`.
- Behaviours, each as SGLang's source has it (file in the wheel):
  - `/health` generates a token, so it answers 503 while the server is paused
    (`entrypoints/http_server.py` `health_generate`: the probe request waits on the pause);
    `/ready` is 503 while paused; `/ping` is a flag check, 200 paused or not;
  - `/pause_generation` (`mode` "abort", the default) aborts what is running, which comes
    back with `finish_reason.type == "abort"` and its partial output; requests arriving while
    paused wait until `/continue_generation` (`managers/tokenizer_manager.py`,
    `is_pause_cond`);
  - a request aborted before prefill comes back with no tokens at all (`scheduler.py`
    `abort_request`, "directly pop from the queue"): tests hold requests before prefill with
    `hold_prefill`;
  - a prompt plus `max_new_tokens` beyond the context length is HTTP 400
    (`tokenizer_manager.py` `_validate_one_request`);
  - `sampling_params` go through SGLang's own `SamplingParams.__post_init__` and
    `verify()` (`sampling/sampling_params.py`, their source pinned in the schema and run
    here as it is): what they refuse (`min_new_tokens` above `max_new_tokens`, a `top_p`
    of 0, ...) is HTTP 400 `{"error": {"message"}}` with SGLang's own message
    (`http_server.py` `_create_error_response`), checked after the context length, as
    `tokenizer_manager.py` orders them;
  - updates with tensor names the model does not have succeed; the unknown names are logged
    as a warning and kept in `warnings` (the model's `load_weights` skips them);
  - a weights group whose name is taken cannot be created again until
    `/destroy_weights_update_group` (torch refuses a used group name); a replica of
    `tp_size` N needs ranks `rank_offset + tp_rank` for tp_rank < N inside `world_size`
    (`model_executor/model_runner_components/weight_updater.py`); failures are HTTP 400
    with `{"success": false, "message"}`;
  - with `api_key` (SGLang's `--api-key`), every path but `/health*`, `/ready*` and
    `/metrics*` answers 401 without `Authorization: Bearer <key>` (`srt/utils/auth.py`);
  - `/update_weights_from_disk` is given a path the server opens in its own container: a
    folder (or a file it links to) outside `mounts` is not there for it, and the update
    fails as SGLang's loader does for a path that is no local directory;
  - `meta_info.weight_version` is the version named by the last update (`"default"` after a
    start or a `restart()`, which also loses every group and goes back to the base weights).

Every call is recorded in `calls` (path, body, client port) so tests can check what the
client sent and on which connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.common.weights.distributed import WeightsGroup, recv_buckets
from services.common.weights.manifest import (
    TensorSpec,
    WeightManifest,
    WeightsError,
    state_dict_checksum,
)
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from tests.rollout.sglang_media import ImageDataError, decode_image_data

log = logging.getLogger("sglang-standin")

SCHEMA_PATH = Path(__file__).with_name("sglang_schema.json")
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())


def contract_violations(path: str, body: Any) -> list[str]:
    """What in `body` SGLang's request class for `path` would not accept."""
    route = SCHEMA["routes"].get(path)
    if route is None:
        return [f"{path} is not a route of SGLang {SCHEMA['sglang_version']}"]
    if route["body"] is None:
        return []
    if not isinstance(body, dict):
        return [f"{path}: the body must be a JSON object"]
    fields = SCHEMA["classes"][route["body"]]["fields"]
    errors = [f"{path}: unknown field {k!r}" for k in body if k not in fields]
    errors += [
        f"{path}: missing field {k!r}" for k, f in fields.items() if f["required"] and k not in body
    ]
    if path == "/generate":
        sp_fields = SCHEMA["classes"]["api.v1.SamplingParams"]["fields"]
        errors += [
            f"/generate: sampling_params has unknown field {k!r}"
            for k in (body.get("sampling_params") or {})
            if k not in sp_fields
        ]
    return errors


def _sglang_sampling_class() -> type:
    """SGLang's `SamplingParams` as far as `/generate` checks it: the field defaults, its
    own `__post_init__` and `verify`, and the helpers and constants they use, compiled
    from the source pinned in the schema (the wheel's module imports msgspec and more)."""
    rule = SCHEMA["sampling_params"]
    # `normalize_watermark_request` is not pinned: watermarks are not something we send.
    ns: dict[str, Any] = {"math": math, "normalize_watermark_request": lambda w: w}
    for name, expr in rule["constants"].items():
        ns[name] = eval(expr, ns)  # noqa: S307 - literals from the pinned wheel
    for name, source in {**rule["helpers"], **rule["methods"]}.items():
        # Annotations stay unevaluated: the typing names they use are not needed to run.
        code = compile(
            "from __future__ import annotations\n" + source,
            f"<sglang {rule['module']}:{name}>",
            "exec",
        )
        exec(code, ns)  # noqa: S102 - the wheel's own functions
    defaults = {k: eval(v, ns) for k, v in rule["defaults"].items()}  # noqa: S307

    def __init__(self: Any, **kwargs: Any) -> None:
        unknown = sorted(kwargs.keys() - defaults.keys())
        if unknown:  # msgspec refuses a keyword the Struct does not have
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        for k, v in {**defaults, **kwargs}.items():
            setattr(self, k, v)
        self.__post_init__()

    methods = {name: ns[name] for name in rule["methods"]}
    return type(rule["class"], (), {"__init__": __init__, **methods})


SGLANG_SAMPLING_PARAMS = _sglang_sampling_class()


def sampling_error(sampling_params: dict[str, Any], vocab_size: int) -> str | None:
    """What SGLang 0.5.23's `SamplingParams(**sampling_params)` and its `verify(vocab_size)`
    refuse in a `/generate` request's `sampling_params` (None: they accept it)."""
    try:
        SGLANG_SAMPLING_PARAMS(**sampling_params).verify(vocab_size)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


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


def _fail(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


def build_app(standin: SGLangStandIn) -> FastAPI:
    eng = standin.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await eng.start()
        standin._loop = asyncio.get_running_loop()
        standin._unpaused = asyncio.Event()
        standin._unpaused.set()
        yield
        await eng.stop()

    app = FastAPI(lifespan=lifespan)

    if standin.api_key is not None:
        key = standin.api_key

        @app.middleware("http")
        async def api_key(request: Request, call_next: Any) -> Any:
            # SGLang's `--api-key` check (`srt/utils/auth.py`): every path wants the bearer
            # key but /health*, /ready* and /metrics* (so /ping wants it too).
            path = request.url.path
            if path.startswith(("/health", "/ready", "/metrics")):
                return await call_next(request)
            if request.headers.get("authorization") != f"Bearer {key}":
                standin.refused.append(path)
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    async def record(path: str, req: Request) -> tuple[Any, JSONResponse | None]:
        raw = await req.body()
        body = json.loads(raw) if raw else {}
        standin.calls.append((path, body, req.client.port if req.client else 0))
        errors = contract_violations(path, body)
        if errors:
            standin.contract_errors.extend(errors)
            return body, JSONResponse({"error": {"message": "; ".join(errors)}}, status_code=400)
        return body, None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if standin.paused else 200)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=503 if standin.paused else 200)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": str(standin.model_dir),
            "weight_version": standin.weight_version,
            "has_image_understanding": eng.accepts_images,
        }

    @app.post("/generate")
    async def generate(req: Request) -> Any:
        body, bad = await record("/generate", req)
        if bad is not None:
            return bad
        prompt = list(body["input_ids"])
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        if len(prompt) >= standin.context_len or len(prompt) + max_new > standin.context_len:
            return JSONResponse(
                {
                    "error": {
                        "message": (
                            "Requested token count exceeds the model's maximum context length "
                            f"of {standin.context_len} tokens. You requested a total of "
                            f"{len(prompt) + max_new} tokens."
                        )
                    }
                },
                status_code=400,
            )
        refused = sampling_error(sp, standin.vocab_size)
        if refused is not None:
            standin.refused_sampling.append(refused)
            return JSONResponse({"error": {"message": refused}}, status_code=400)
        try:  # SGLang's reading of image_data: sglang_media.py
            images = decode_image_data(body.get("image_data"))
        except ImageDataError as exc:
            standin.refused_images.append(str(exc))
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        if images and not eng.accepts_images:  # a text model has no image processor
            msg = f"{standin.model_dir.name} does not support image inputs"
            standin.refused_images.append(msg)
            return JSONResponse({"error": {"message": msg}}, status_code=400)
        standin.images.append(images)
        meta: dict[str, Any] = {
            "id": body.get("rid", ""),
            "prompt_tokens": len(prompt),
        }
        standin.arrived += 1
        while standin.in_transit.is_set():  # still "on the wire": not seen by the server yet
            await asyncio.sleep(0.005)
        await standin._unpaused.wait()  # a request sent while paused waits for continue
        if standin.hold_prefill.is_set():  # queued before prefill until released or aborted
            epoch = standin.aborts
            standin.waiting += 1
            try:
                while standin.hold_prefill.is_set() and standin.aborts == epoch:
                    await asyncio.sleep(0.005)
            finally:
                standin.waiting -= 1
            if standin.aborts != epoch:
                meta.update(finish_reason={"type": "abort"}, completion_tokens=0)
                meta.update(weight_version=standin.weight_version, output_token_logprobs=[])
                return {"text": "", "output_ids": [], "meta_info": meta}
            await standin._unpaused.wait()
        standin.running += 1
        try:
            extra = {"images": images} if images else {}
            c = await eng.agenerate(prompt, _sampling(sp), **extra)
            meta.update(
                finish_reason={"type": c.stop_reason},
                completion_tokens=len(c.output_ids),
                weight_version=standin.weight_version,  # the version its tokens came from
            )
        finally:
            standin.running -= 1
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(c.logprobs, c.output_ids, strict=True)
            ]
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}

    def _abort_everything() -> None:
        standin.aborts += 1  # requests queued before prefill see it and return empty

    @app.post("/pause_generation")
    async def pause(req: Request) -> Any:
        body, bad = await record("/pause_generation", req)
        if bad is not None:
            return bad
        standin.paused = True
        standin._unpaused.clear()
        if body.get("mode", "abort") == "abort":
            _abort_everything()
            await eng.pause()
            await eng.abort_all()  # what is running returns now with its partial output
            while standin.running:  # SGLang's pause returns once every abort is answered
                await asyncio.sleep(0.002)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(req: Request) -> Any:
        _, bad = await record("/continue_generation", req)
        if bad is not None:
            return bad
        await eng.resume()
        standin.paused = False
        standin._unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort(req: Request) -> Any:
        body, bad = await record("/abort_request", req)
        if bad is not None:
            return bad
        if body.get("abort_all"):
            _abort_everything()
            await eng.abort_all()
        return {}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush(req: Request) -> Any:
        await record("/flush_cache", req)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/update_weight_version")
    async def update_version(req: Request) -> Any:
        body, bad = await record("/update_weight_version", req)
        if bad is not None:
            return bad
        standin.weight_version = body["new_version"]
        return {"success": True, "message": "", "new_version": body["new_version"]}

    async def apply(tensors: dict[str, Any], version: str | None) -> JSONResponse:
        current = eng.current_weights()
        unknown = sorted(tensors.keys() - current.keys())
        if unknown:  # SGLang's load_weights skips names the model does not have
            msg = f"ignoring {len(unknown)} unknown weight names: {unknown[:3]}"
            log.warning(msg)
            standin.warnings.append(msg)
        merged = {**current, **{k: v for k, v in tensors.items() if k in current}}
        v = eng.version + 1  # the torch engine counts updates; the label is SGLang's
        manifest = WeightManifest(v, state_dict_checksum(merged), len(merged), 0)
        r = await eng.update_weights_from_tensors(merged, manifest, verified=True)
        if not r.ok:
            return _fail(r.message)
        if version is not None:
            standin.weight_version = version
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    @app.post("/update_weights_from_disk")
    async def from_disk(req: Request) -> Any:
        from safetensors.torch import load_file

        body, bad = await record("/update_weights_from_disk", req)
        if bad is not None:
            return bad
        path = Path(body["model_path"])
        if not standin.sees(path) or not all(
            standin.sees(f) for f in sorted(path.glob("*.safetensors"))
        ):
            # SGLang's loader takes a path that is not a local directory for a Hub repo id
            # and fails to fetch it (`model_loader/loader.py` `_prepare_weights`;
            # `weight_updater.py` answers "Failed to get weights iterator").
            return _fail(f"Failed to get weights iterator: {path} is not a local directory.")
        if not (path / "config.json").is_file():
            return _fail(f"{path} is not a model directory")
        tensors: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return await apply(tensors, body.get("weight_version"))

    @app.post("/init_weights_update_group")
    async def init_group(req: Request) -> Any:
        body, bad = await record("/init_weights_update_group", req)
        if bad is not None:
            return bad
        name = body.get("group_name", "weight_update_group")
        if name in standin.groups:
            return _fail(
                "Failed to initialize custom process group: The specified group name has "
                "already been used."
            )
        offset, world = int(body["rank_offset"]), int(body["world_size"])
        ranks = [offset + tp_rank for tp_rank in range(standin.tp_size)]
        standin.group_ranks[name] = ranks
        if offset < 1 or ranks[-1] >= world:
            return _fail(f"Failed to initialize custom process group: ranks {ranks} / {world}")
        if standin.tp_size > 1 or not standin.join_groups:
            # The layout is checked, nothing joined (one process cannot hold N ranks).
            standin.groups[name] = None
            return {"success": True, "message": "layout checked, group not joined"}
        try:
            standin.groups[name] = await asyncio.to_thread(
                WeightsGroup,
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank=offset,
                world_size=world,
                backend=body.get("backend", "nccl"),
                group_name=name,
                timeout_s=60,
            )
        except (WeightsError, RuntimeError) as exc:
            return _fail(f"Failed to initialize custom process group: {exc}.")
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: Request) -> Any:
        body, bad = await record("/destroy_weights_update_group", req)
        if bad is not None:
            return bad
        name = body.get("group_name", "weight_update_group")
        if name not in standin.groups:
            return _fail("The group to be destroyed does not exist.")
        standin.groups.pop(name)  # local: SGLang destroys its side without a collective
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/update_weights_from_distributed")
    async def from_distributed(req: Request) -> Any:
        body, bad = await record("/update_weights_from_distributed", req)
        if bad is not None:
            return bad
        name = body.get("group_name", "weight_update_group")
        group = standin.groups.get(name)
        if group is None:
            return _fail(f"Failed to update weights: group {name!r} is not initialized")
        specs = [
            TensorSpec(n, d, tuple(s))
            for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
        ]
        # One broadcast per tensor in its own dtype, as SGLang receives them.
        tensors = await asyncio.to_thread(recv_buckets, group, specs, 0)
        return await apply(tensors, body.get("weight_version"))

    return app


class SGLangStandIn:
    """Runs the stand-in app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(
        self,
        model_dir: Path,
        *,
        tp_size: int = 1,
        context_len: int | None = None,
        join_groups: bool = True,
        mounts: list[Path] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.api_key = api_key
        """Started as with `--api-key`: calls without the bearer key are answered 401."""
        self.refused: list[str] = []
        """Paths of the calls refused for a missing or wrong key."""
        self.mounts = None if mounts is None else [Path(m).resolve() for m in mounts]
        """The folders the server's container mounts (None: all of this machine). A weights
        path, or a file it links to, outside them does not exist for the server: SGLang
        runs in its own container and sees only what is mounted into it."""
        self.tp_size = tp_size
        self.join_groups = join_groups
        """False: `/init_weights_update_group` checks the layout and records the group
        without joining it (tests of the group bookkeeping need no trainer rank 0)."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        text_cfg = cfg.get("text_config") or cfg  # a VLM's language model has its own block
        self.context_len = context_len or int(
            cfg.get("max_position_embeddings", text_cfg.get("max_position_embeddings", 4096))
        )
        self.vocab_size = int(cfg.get("vocab_size") or text_cfg["vocab_size"])
        self.refused_sampling: list[str] = []
        """SGLang's messages for the `/generate` requests its `verify()` refused."""
        self.refused_images: list[str] = []
        """The messages of `/generate` requests refused for their `image_data`."""
        self.images: list[list[bytes]] = []
        """The decoded images of each accepted `/generate` request (empty for text)."""
        self.calls: list[tuple[str, dict[str, Any], int]] = []
        self.contract_errors: list[str] = []
        self.warnings: list[str] = []
        self.in_transit = threading.Event()
        """Set: /generate requests are held as if still on the wire (before the pause check)."""
        self.hold_prefill = threading.Event()
        """Set: /generate requests queue before prefill (until cleared or aborted)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._reset()

    def _reset(self) -> None:
        self.engine = TorchEngine(self.model_dir, max_batch_size=4, device="cpu")
        self.weight_version = "default"
        self.paused = False
        self.groups: dict[str, WeightsGroup | None] = {}
        self.group_ranks: dict[str, list[int]] = {}
        self.arrived = 0
        self.waiting = 0
        self.aborts = 0
        self.running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unpaused: asyncio.Event = asyncio.Event()
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

    def restart(self) -> None:
        """Kill and start again on the same port: base weights, `"default"`, no groups."""
        self.stop()
        self._reset()
        self.start()

    def sees(self, path: Path) -> bool:
        """Whether the server's container could open `path` (links followed)."""
        if not path.exists():
            return False
        if self.mounts is None:
            return True
        real = path.resolve()
        return any(real.is_relative_to(m) for m in self.mounts)

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [c[1] for c in self.calls if c[0] == path]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
