"""Assembly of one rollout replica from a `FlywheelConfig`: engine, loop, gRPC, metrics.

`RolloutService(cfg, replica_index=i)` serves on `services.rollout.replica_port(i)` with
rollout_id `rollout-i`. Start order: engine (model loaded, newest published weights applied
when `trainer.weight_dir` holds some), gRPC + HTTP side app, then the data loop (unless
`eval_only`). SIGTERM: health NOT_SERVING, drain the loop (groups in flight finish and are
put), stop the server, the engine and the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from flywheel_proto.v1 import rollout_pb2_grpc
from services.common.aio import stop_task
from services.common.grpc_server import ServiceServer
from services.common.http_app import MetricsServer
from services.common.weights.disk import MANIFEST_FILE, read_manifest
from services.core.types import SamplingParams
from services.rollout.engine.base import EngineBase
from services.rollout.metrics import RolloutMetrics
from services.rollout.openai_api.replica import replica_api
from services.rollout.openai_api.sessions import SessionStore
from services.rollout.servicer import RolloutServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "flywheel.v1.RolloutService"


def model_path(cfg: Any) -> str:
    path = cfg.actor.path
    if not path:
        raise ValueError(
            "actor.path is empty: the launcher writes the tiny model and sets it; "
            "set actor.path to a Hugging Face model directory"
        )
    return str(path)


def build_engine(cfg: Any, replica_index: int = 0) -> EngineBase:
    r = cfg.rollout
    tokenizer_path = r.tokenizer_path or cfg.tokenizer_path or model_path(cfg)
    if r.engine == "torch":
        from services.rollout.engine.torch_engine import TorchEngine

        return TorchEngine(
            model_path(cfg),
            max_batch_size=r.torch_max_batch_size,
            seed=cfg.seed * 1000 + replica_index,
            tokenizer_path=tokenizer_path,
            device=None if r.torch_device == "auto" else r.torch_device,
            runner=r.torch_runner,
        )
    from services.rollout.engine.sglang_engine import SGLangEngine

    return SGLangEngine.from_config(cfg, replica_index=replica_index, tokenizer_path=tokenizer_path)


def weights_root(cfg: Any) -> Path:
    """Where this replica loads disk updates from: `trainer.weight_dir`, or the trainer's
    default for it, `<cluster.fileroot>/<experiment>/<trial>/weights`."""
    if cfg.trainer.weight_dir:
        return Path(cfg.trainer.weight_dir)
    return Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name / "weights"


def newest_published_weights(weight_dir: str | None) -> Path | None:
    """The directory under `weight_dir` (or itself) whose manifest has the highest version."""
    if not weight_dir:
        return None
    root = Path(weight_dir)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for cand in [root, *(p for p in root.iterdir() if p.is_dir())]:
        if not (cand / MANIFEST_FILE).is_file():
            continue
        try:
            v = read_manifest(cand).version
        except ValueError:
            continue
        if best is None or v > best[0]:
            best = (v, cand)
    return best[1] if best else None


class RolloutService:
    def __init__(self, cfg: Any, *, replica_index: int = 0, eval_only: bool = False) -> None:
        self.cfg = cfg
        self.replica_index = replica_index
        self.eval_only = eval_only
        self.rollout_id = f"rollout-{replica_index}"
        self.metrics = RolloutMetrics()
        self.engine = build_engine(cfg, replica_index)
        ep = cfg.services.rollout
        self.server = ServiceServer(
            "rollout",
            host=ep.replica_host(replica_index),
            port=ep.replica_port(replica_index),
            max_message_bytes=cfg.services.max_message_bytes,
            auth_token=cfg.services.auth_token,
            service_names=[SERVICE_NAME],
            credentials=cfg.services.credentials,
            tls=cfg.services.tls,
            auth_metrics=self.metrics.auth,
        )
        self.loop: Any = None
        self.servicer: RolloutServicer | None = None
        self.http: MetricsServer | None = None
        self._ready = False
        self._serving = False  # what the servicer last asked (False while applying weights)
        self._behind = False  # more than eta stale with nothing newer to load (the loop)
        self._clients: list[Any] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.port = 0
        # Episodes recorded by the OpenAI-compatible API on the HTTP port (`/sessions/{id}/v1`);
        # in-process agent workflows open and export sessions here directly.
        self.sessions = SessionStore()

    def ready(self) -> bool:
        return self._ready

    async def start(self) -> int:
        await self.engine.start()
        await self.catch_up()  # a replica starting late serves the newest published weights
        if not self.eval_only:
            self.loop = self._build_loop()
        self.servicer = RolloutServicer(
            self.engine,
            rollout_id=self.rollout_id,
            metrics=self.metrics,
            loop=self.loop,
            set_serving=self._set_serving,
            max_weight_bytes=self.cfg.rollout.max_weight_bytes,
            weights_root=weights_root(self.cfg),
        )
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.servicer, self.server.server)
        self.port = await self.server.start()
        ep = self.cfg.services.rollout
        self.http = MetricsServer(
            "rollout",
            self.metrics.registry,
            self.ready,
            host=ep.replica_host(self.replica_index),
            port=ep.replica_port(self.replica_index, "metrics_port"),
            extra=replica_api(
                self.cfg,
                self.engine,
                self.sessions,
                loop=asyncio.get_running_loop(),
                metrics=self.metrics.openai_api,
            ),
        )
        self.http.start()
        self._set_serving(True)
        self._sync_task = asyncio.create_task(self._sync_metrics())
        if self.loop is not None:
            self._loop_task = self.loop.start()
        log.info(
            "rollout serving",
            extra={
                "port": self.port,
                "metrics_port": self.http.port,
                "rollout_id": self.rollout_id,
            },
        )
        return self.port

    def _set_serving(self, serving: bool) -> None:
        """Ready (gRPC health SERVING, /readyz 200) when serving and not stuck behind: a
        replica too stale to be admitted that cannot load newer weights is not Ready, so
        its pod shows it instead of looking healthy while the run waits for it."""
        self._serving = serving
        self._ready = serving and not self._behind
        self.server.set_serving(self._ready)

    def _on_behind(self, behind: bool) -> None:
        self._behind = behind
        self._set_serving(self._serving)

    def _build_loop(self) -> Any:
        from services.core.contracts import WorkflowContext
        from services.rollout.data.datasets import PromptDataset
        from services.rollout.loop import RolloutLoop
        from services.rollout.workflows.base import RewardServiceScorer, load_workflow
        from services.wire.buffer_client import BufferClient
        from services.wire.reward_client import RewardClient

        cfg = self.cfg
        s = cfg.services
        buffer = BufferClient(
            s.buffer.address,
            auth_token=s.auth_token,
            max_message_bytes=s.max_message_bytes,
            outage_budget_s=s.peer_outage_budget_s,
            peer=self.metrics.peers.peer("buffer", s.buffer.address),
            tls=s.tls,
        )
        reward = RewardClient(
            s.reward.address,
            auth_token=s.auth_token,
            max_message_bytes=s.max_message_bytes,
            timeout=max(60.0, cfg.reward.deadline_ms / 1000.0 * 4),
            outage_budget_s=s.peer_outage_budget_s,
            peer=self.metrics.peers.peer("reward", s.reward.address),
            tls=s.tls,
        )
        self._clients = [buffer, reward]
        sampling = SamplingParams.from_gconfig(cfg.gconfig)
        processor = None
        if cfg.rollout.workflow == "vision_rlvr":  # the model's processor renders the prompts
            from services.common.vision_inputs import load_vision_processor

            processor = load_vision_processor(model_path(cfg))
        ctx = WorkflowContext(
            tokenizer=self.engine.tokenizer,
            sampling=sampling,
            scorer=RewardServiceScorer(reward, fn=cfg.reward.fn),
            on_failure=cfg.reward.on_failure,
            on_reward_failure=lambda status: self.metrics.reward_failures.labels(
                status=status
            ).inc(),
            processor=processor,
            on_images=self.metrics.observe_images,
        )
        kwargs = dict(cfg.rollout.workflow_kwargs)
        if cfg.rollout.workflow == "multi_turn":
            kwargs.setdefault("max_turns", cfg.rollout.max_turns)
            kwargs.setdefault("turn_discount", cfg.rollout.turn_discount)
        if cfg.rollout.workflow == "agent":
            kwargs.update(self._agent_workflow_kwargs())
        workflow = load_workflow(cfg.rollout.workflow, ctx, **kwargs)
        seed = cfg.seed * 1000 + self.replica_index
        if processor is not None:
            from services.rollout.data.vision import VisionPromptDataset

            dataset: PromptDataset = VisionPromptDataset.from_vision_config(
                cfg.train_dataset, processor, seed=seed
            )
        else:
            dataset = PromptDataset.from_config(cfg.train_dataset, self.engine.tokenizer, seed=seed)
        r = cfg.rollout
        return RolloutLoop(
            engine=self.engine,
            workflow=workflow,
            dataset=dataset,
            buffer=buffer,
            rollout_id=self.rollout_id,
            max_concurrent=r.max_concurrent_rollouts or r.consumer_batch_size,
            request_timeout=r.request_timeout,
            put_retries=r.request_retries,
            metrics=self.metrics,
            check_trajectory_format=r.check_trajectory_format,
            max_head_offpolicyness=r.max_head_offpolicyness,
            catch_up=self.catch_up,
            on_behind=self._on_behind,
        )

    def _agent_workflow_kwargs(self) -> dict[str, Any]:
        """What the agent workflow takes from the replica: its sessions (so in-process
        episodes show on the HTTP API too), its served model name and its metrics."""
        from services.rollout.openai_api.replica import served_model_names

        cfg = self.cfg
        return {
            "agent": cfg.rollout.agent,
            "sessions": self.sessions,
            "model_name": served_model_names(str(cfg.actor.path))[0],
            "turn_discount": cfg.rollout.turn_discount,
            "metrics": self.metrics.agent,
            "api_metrics": self.metrics.openai_api,
        }

    async def catch_up(self) -> bool:
        """Load the newest published weights when they are newer than what is served.

        Pushes from the trainer are the normal path; this is the pull that heals a replica
        that missed them (restarted while the trainer published, or marked unhealthy and
        skipped): without it, everything it generates is too stale to admit, the trainer
        waits for data, and no further push ever comes."""
        latest = newest_published_weights(getattr(self.cfg.trainer, "weight_dir", None))
        if latest is None:
            return False
        result = await self.engine.update_weights_from_disk(str(latest), None)
        log.info(
            "caught up with published weights",
            extra={"path": str(latest), "ok": result.ok, "version": result.version},
        )
        return bool(result.ok)

    async def _sync_metrics(self) -> None:
        while True:
            e = self.engine
            paused = e.paused or (self.loop is not None and self.loop.paused)
            self.metrics.sync_engine(
                e.stats.tokens_generated, e.requests_in_flight, e.version, paused
            )
            await asyncio.sleep(1.0)

    async def stop(self, drain_timeout: float = 60.0) -> None:
        """Graceful: NOT_SERVING, drain the loop, stop serving, release everything."""
        self._ready = self._serving = False
        if self.servicer is not None:
            self.servicer.draining = True
        self.server.set_serving(False)
        if self.loop is not None:
            await self.loop.drain(timeout=drain_timeout)
        await self.server.stop(grace=5.0)
        if self._sync_task is not None:
            await stop_task(self._sync_task)
        await self.engine.stop()
        for c in self._clients:
            with contextlib.suppress(Exception):
                await c.close()
        if self.http is not None:
            self.http.stop()

    async def serve_forever(self) -> None:
        """Start, then run until SIGTERM/SIGINT, then stop gracefully."""
        import signal

        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received: draining")
        await self.stop()
