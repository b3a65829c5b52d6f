"""In-process generation on a Hugging Face causal LM: the embedded default and the test engine.

One background thread runs the decode loop; the asyncio side only enqueues requests and
awaits futures. Each iteration of the loop is one *step* under `_step_lock`:

1. admit waiting requests while there are free batch rows (continuous batching: requests
   join between steps, finished ones leave at once);
2. if any sequence has more than one pending token (new prompts, or every sequence after a
   weight update) run those alone (prefill); otherwise run one decode step for all;
3. sample per row, record token, log-probability and the version of the weights in use,
   check stop conditions, resolve finished futures.

A weight update takes `_step_lock` between two steps, copies the new tensors into the
parameters and bumps the version; sequences in flight keep their tokens and recompute their
KV cache under the new weights on the next step (as SGLang's abort-and-resubmit does), so
every token after the switch is exactly what the new weights produce. `pause()` holds the
loop between steps until `resume()`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.model_source import auto_model_class, load_tokenizer, resolve_model_path
from services.common.vision_inputs import (
    VisionProcessor,
    is_vision_config,
    load_vision_processor,
    vision_tower_names,
)
from services.common.weights.manifest import (
    WeightManifest,
    WeightsError,
    named_parameters_for_update,
    state_dict_checksum,
)
from services.core.types import Completion, SamplingParams, StopReason
from services.rollout.engine.base import EngineBase
from services.rollout.engine.hf_runner import HFRunner
from services.rollout.engine.native_runner import NativeDecoderRunner
from services.rollout.engine.runner_contract import ModelRunner
from services.rollout.engine.sampling import RowSampling, sample_next
from services.rollout.engine.vlm_runner import VisionRunner

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_len: int
    sampling: SamplingParams
    limit: int  # most new tokens
    stop_ids: frozenset[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    generator: torch.Generator | None
    tokens: list[int]
    cache_len: int = 0
    slot: Any = None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    aborted: bool = False
    max_stop_chars: int = 0
    row: RowSampling | None = None
    cache_key: str | None = None  # keep the KV cache under this key when finished
    vision: Any = None  # VisionInputs of the prompt's images (a VLM's prefill reads them)

    @property
    def n_out(self) -> int:
        return len(self.tokens) - self.prompt_len


class TorchEngine(EngineBase):
    """Batched, interruptible generation with a KV cache on CPU or CUDA."""

    name = "torch"

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size: int = 16,
        seed: int = 0,
        runner: str = "auto",
        tokenizer_path: str | Path | None = None,
        compute_checksum: bool = True,
    ) -> None:
        super().__init__()
        self.model_path = str(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype_name = dtype
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.runner_kind = runner
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.compute_checksum = compute_checksum
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()
        self._paused = False
        self._stopping = False
        # Weight swaps waiting for the step lock: the loop yields to them (a plain Lock is
        # not fair, and the loop would otherwise re-take it step after step).
        self._swaps_waiting = 0
        self._thread: threading.Thread | None = None
        self._shared_gen: torch.Generator | None = None
        # Called in the engine thread after every step (tracing, tests that need to act at
        # an exact point of a generation, e.g. pause after the fifth token).
        self.on_step: Any = None
        # Prefix reuse (see `agenerate(cache_key=...)`): finished sequences whose KV cache is
        # kept in their slot for the next call of the same key, least recently used first.
        self._parked: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self.max_parked = max(1, max_batch_size // 2)
        self.prefill_tokens = 0  # prompt tokens run through the model at admission
        self.reused_prefix_tokens = 0  # prompt tokens whose kept KV cache was reused
        # The image processor of a vision-language model (None for a text model).
        self.vision: VisionProcessor | None = None
        self._never_ids: tuple[int, ...] = ()  # token ids no sample may take

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
        if self.dtype_name:
            # `dtype`, not `torch_dtype`: transformers 5 deprecates the old name.
            kwargs["dtype"] = getattr(torch, self.dtype_name)
        model_cls = auto_model_class(self.model_path)  # a VLM loads as image-text-to-text
        model = model_cls.from_pretrained(resolve_model_path(self.model_path), **kwargs)
        model.to(self.device).eval()  # type: ignore[arg-type]
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        if is_vision_config(model.config):
            self.vision = load_vision_processor(self.model_path)
            self.accepts_images = True
            # Placeholders are never sampled: a generated `<|image_pad|>` stands for no
            # image, and the trainer could not score the sequence (the model matches image
            # tokens to images). The recorded log-probabilities stay the model's own.
            names = ("image_token_id", "video_token_id", "vision_start_token_id")
            ids = {getattr(model.config, n, None) for n in (*names, "vision_end_token_id")}
            self._never_ids = tuple(sorted(int(i) for i in ids if i is not None))
        eos: set[int] = set()
        for src in (model.config, getattr(model, "generation_config", None)):
            val = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(val, int):
                eos.add(val)
            elif isinstance(val, list | tuple):
                eos.update(int(v) for v in val)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos_ids = frozenset(eos)
        self.runner = self._make_runner(model)
        self._shared_gen = torch.Generator(device=self.device).manual_seed(self.seed)
        if self.compute_checksum:
            self.checksum = state_dict_checksum(named_parameters_for_update(model))
        log.info(
            "torch engine ready",
            extra={
                "model": self.model_path,
                "device": str(self.device),
                "runner": type(self.runner).__name__,
                "max_batch_size": self.max_batch_size,
            },
        )

    def _make_runner(self, model: torch.nn.Module) -> ModelRunner:
        kind = self.runner_kind
        if kind not in ("auto", "native", "hf"):
            raise ValueError(f"runner={kind!r}: use 'auto', 'native' or 'hf'")
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        if self.vision is not None:
            if kind == "native":
                raise ValueError("runner='native' cannot run a vision-language model; use 'auto'")
            return VisionRunner(model, max_slots=self.max_batch_size, pad_id=int(pad or 0))
        ok, why = NativeDecoderRunner.supports(model)
        if kind == "native" and not ok:
            raise ValueError(f"runner='native' cannot run this model: {why}")
        if kind in ("auto", "native") and ok:
            return NativeDecoderRunner(model, max_slots=self.max_batch_size)
        return HFRunner(model, max_slots=self.max_batch_size, pad_id=int(pad or 0))

    async def stop(self) -> None:
        await self.abort_all()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        await self.close_weights_group()

    # -------------------------------------------------------------- generation

    @property
    def max_positions(self) -> int:
        assert self.runner is not None, "engine not started"
        return self.runner.max_positions

    @property
    def keeps_prefix_cache(self) -> bool:
        """Whether `cache_key` reuses KV caches (the native runner can hand a slot over)."""
        return callable(getattr(self.runner, "adopt", None))

    async def agenerate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
        cache_key: str | None = None,
    ) -> Completion:
        """One completion. With `cache_key` (a session id), the finished sequence's KV cache
        stays in its slot, and the next call with the same key prefills only what its
        prompt adds beyond the longest common prefix with that sequence (the KV of a
        prefix depends on nothing after it). Kept caches are dropped on a weight update and
        evicted, least recently used first, when a request needs their slot; requests with
        images keep nothing."""
        if self.runner is None:
            raise RuntimeError("torch engine not started")
        self.refuse_images(images)
        sampling.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        vocab = int(self.model.config.vocab_size)  # type: ignore[union-attr, arg-type]
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_ids contains ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_positions:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in {self.max_positions} positions"
            )
        vision = None
        if self.vision is not None:
            if images:
                vision = await asyncio.to_thread(self.vision.pixel_inputs, list(images))
            self.vision.check_prompt(prompt, vision)
        limit = min(sampling.max_new_tokens, self.max_positions - len(prompt))
        if sampling.max_tokens > 0:
            limit = min(limit, sampling.max_tokens - len(prompt))
        if limit <= 0:
            return Completion([], [], [], "length", "", prompt)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self._eos_ids
        gen = None
        if sampling.seed is not None and not sampling.is_greedy:
            gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        loop = asyncio.get_running_loop()
        req = _Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_len=len(prompt),
            sampling=sampling,
            limit=limit,
            stop_ids=frozenset(stop_ids),
            loop=loop,
            future=loop.create_future(),
            generator=gen,
            tokens=prompt,
            max_stop_chars=max((len(s) for s in sampling.stop), default=0),
            vision=vision,
            cache_key=cache_key if vision is None and self.keeps_prefix_cache else None,
        )
        with self._cv:
            self._waiting.append(req)
            self._cv.notify_all()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.aborted = True  # the loop frees its row at the next step
            with self._cv:
                self._cv.notify_all()
            raise

    def request_pause(self) -> None:
        """Pause from any thread (e.g. an `on_step` hook) without waiting: the loop holds
        before its next step."""
        with self._cv:
            self._paused = True

    def active_outputs(self) -> list[list[int]]:
        """Tokens generated so far by each request in the batch (inspection)."""
        return [r.tokens[r.prompt_len :] for r in self._active]

    async def pause(self) -> None:
        with self._cv:
            self._paused = True
        # Wait for the step in progress (if any) to end: after this, nothing decodes.
        await asyncio.to_thread(self._step_lock.acquire)
        self._step_lock.release()

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def requests_in_flight(self) -> int:
        return len(self._waiting) + len(self._active)

    async def abort_all(self) -> None:
        with self._cv:
            for req in [*self._waiting, *self._active]:
                req.aborted = True
            self._cv.notify_all()
            if self._paused or self._thread is None:
                # The loop is not stepping: finish them here.
                for req in list(self._waiting):
                    self._finish(req, "abort")
                self._waiting.clear()
        if self._paused:
            with self._step_lock:
                for req in list(self._active):
                    self._finish(req, "abort")

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (self._paused or not (self._waiting or self._active)):
                    self._cv.wait()
                if self._stopping:
                    break
            with self._step_lock:
                if self._paused:
                    continue
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                    log.exception("decode step failed; failing the requests in it")
                    for req in list(self._active):
                        self._finish(req, "abort", error=exc)
                hook = self.on_step
                if hook is not None:
                    hook(self)
        with self._step_lock:
            for req in [*self._waiting, *self._active]:
                self._finish(req, "abort")
            self._waiting.clear()
            for key in list(self._parked):
                self._drop_kept(key)

    def _admit(self) -> None:
        with self._cv:
            while self._waiting and len(self._active) < self.max_batch_size:
                req = self._waiting.popleft()
                if req.aborted:
                    self._finish(req, "abort")
                    continue
                self._reuse_kept(req)
                while self._parked and len(self._active) + len(self._parked) >= self.max_batch_size:
                    self._drop_kept(next(iter(self._parked)))
                self.prefill_tokens += len(req.tokens) - req.cache_len
                self._active.append(req)

    def _reuse_kept(self, req: _Request) -> None:
        """Hand the kept sequence of `req.cache_key` (if any) over to `req`: its slot and
        the KV of the longest common prefix, leaving at least one token to run."""
        kept = self._parked.pop(req.cache_key, None) if req.cache_key else None
        if kept is None:
            return
        n, limit = 0, min(kept.cache_len, len(req.tokens) - 1)
        while n < limit and kept.tokens[n] == req.tokens[n]:
            n += 1
        if n == 0:
            self.runner.remove(kept)  # type: ignore[union-attr]
            return
        self.runner.adopt(kept, req)  # type: ignore[union-attr]
        req.cache_len = n
        self.reused_prefix_tokens += n

    def _drop_kept(self, key: str) -> None:
        kept = self._parked.pop(key, None)
        if kept is not None and self.runner is not None:
            self.runner.remove(kept)

    def _step(self) -> None:
        assert self.runner is not None
        self._admit()
        for req in [r for r in self._active if r.aborted]:
            self._finish(req, "abort")
        if not self._active:
            return
        rows = [r for r in self._active if r.slot is None or len(r.tokens) - r.cache_len > 1]
        if not rows:
            rows = list(self._active)
        logits = self.runner.forward(rows)
        specs = [self._row_sampling(r) for r in rows]
        tokens, logprobs = sample_next(logits, specs, self._shared_gen)
        version = self.version
        # Counted before any request finishes: its caller may read the stats at once.
        self.stats.tokens_generated += len(rows)
        for req, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            req.tokens.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)

    def _row_sampling(self, req: _Request) -> RowSampling:
        """The row's settings; built once per request unless they change with its length."""
        s = req.sampling
        static = not s.frequency_penalty and req.n_out >= s.min_new_tokens
        if static and req.row is not None and req.row.banned_ids == self._never_ids:
            return req.row
        banned: tuple[int, ...] = self._never_ids
        if req.n_out < s.min_new_tokens and req.stop_ids:
            banned = tuple(sorted({*req.stop_ids, *self._never_ids}))
        req.row = RowSampling(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            greedy=s.greedy,
            generator=req.generator,
            banned_ids=banned,
            frequency_penalty=s.frequency_penalty,
            history=req.tokens[req.prompt_len :] if s.frequency_penalty else (),
        )
        return req.row

    def _stop_reason(self, req: _Request, tok: int) -> StopReason | None:
        n = req.n_out
        if tok in req.stop_ids and n >= req.sampling.min_new_tokens:
            return "stop"
        if req.max_stop_chars and n >= req.sampling.min_new_tokens:
            window = req.tokens[max(req.prompt_len, len(req.tokens) - req.max_stop_chars - 2) :]
            tail = self.decode(window, skip_special_tokens=False)
            if any(stop in tail for stop in req.sampling.stop):
                return "stop"
        if n >= req.limit:
            return "length"
        return None

    def _finish(
        self, req: _Request, reason: StopReason, error: BaseException | None = None
    ) -> None:
        if req in self._active:
            self._active.remove(req)
        if self.runner is not None:
            key = req.cache_key
            if key and error is None and reason != "abort" and req.slot is not None:
                self._drop_kept(key)
                self._parked[key] = req
                while len(self._parked) > self.max_parked:
                    self._drop_kept(next(iter(self._parked)))
            else:
                self.runner.remove(req)
        self.stats.requests_finished += 1
        if error is not None:
            req.loop.call_soon_threadsafe(_set_exception, req.future, error)
            return
        out = req.tokens[req.prompt_len :]
        completion = Completion(
            output_ids=out,
            logprobs=req.logprobs,
            versions=req.versions,
            stop_reason=reason,
            text=self.decode(out, req.sampling.skip_special_tokens),
            prompt_ids=req.tokens[: req.prompt_len],
        )
        req.loop.call_soon_threadsafe(_set_result, req.future, completion)

    # ----------------------------------------------------------------- weights

    async def _apply_verified(self, tensors: Mapping[str, Any], manifest: WeightManifest) -> float:
        model = self.model
        if model is None:
            raise WeightsError("engine not started")
        params = dict(model.named_parameters())
        if self.vision is not None and not tensors.keys() & vision_tower_names(model):
            # A trainer with a frozen vision tower sends everything but the tower.
            params = {n: p for n, p in params.items() if n not in vision_tower_names(model)}
        missing = sorted(params.keys() - tensors.keys())
        extra = sorted(tensors.keys() - params.keys())
        if missing or extra:
            raise WeightsError(
                f"parameter names differ from the served model: missing {missing[:3]}"
                f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                f"{'...' if len(extra) > 3 else ''}"
            )
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise WeightsError(
                    f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(p.shape)}"
                )
            if not (t.is_floating_point() and p.is_floating_point()) and t.dtype != p.dtype:
                raise WeightsError(f"{name}: dtype {t.dtype} cannot replace {p.dtype}")
        # Stage on the device outside the pause, so the pause is only the copy.
        staged = {
            n: tensors[n].to(device=p.device, dtype=p.dtype, non_blocking=True)
            for n, p in params.items()
        }
        return await asyncio.to_thread(self._swap, params, staged, manifest)

    def _swap(
        self,
        params: dict[str, torch.nn.Parameter],
        staged: dict[str, torch.Tensor],
        manifest: WeightManifest,
    ) -> float:
        with self._cv:
            self._swaps_waiting += 1
        try:
            with self._step_lock:
                return self._swap_locked(params, staged, manifest)
        finally:
            with self._cv:
                self._swaps_waiting -= 1
                self._cv.notify_all()

    def _swap_locked(
        self,
        params: dict[str, torch.nn.Parameter],
        staged: dict[str, torch.Tensor],
        manifest: WeightManifest,
    ) -> float:
        """Runs holding the step lock: decoding is held from here to the return."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(staged[name])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        assert self.runner is not None
        refresh = getattr(self.runner, "refresh_weights", None)
        if refresh is not None:
            refresh()
        for key in list(self._parked):  # computed by the old weights
            self._drop_kept(key)
        self.runner.invalidate(self._active)
        self.version = manifest.version
        self.checksum = manifest.checksum
        return time.perf_counter() - t0

    def current_weights(self) -> dict[str, torch.Tensor]:
        """The served parameters by name (detached views; tests and checks)."""
        assert self.model is not None
        return named_parameters_for_update(self.model)


def _set_result(fut: asyncio.Future[Completion], value: Completion) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Completion], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
