"""Weight-sync parity probe: after an update, does each replica compute what the trainer does?

A checksum proves the replica received the bytes the trainer sent. It cannot prove that
the replica's engine then computes with them as the trainer does: a name mapped to the
wrong module, a transposed or mis-sharded tensor, a dtype cast in the wrong place, weights
loaded into a model whose architecture differs. The probe checks the computation itself.

After an update, every replica that took it decodes a fixed probe greedily through the
ordinary `Generate` RPC (a few fixed token-id prompts, `ignore_eos`, a fixed number of new
tokens) and returns the log-probability of each token it produced; for greedy rows that is
`log_softmax(logits)[token]` at temperature 1 (services/rollout/engine/sampling.py). The
trainer then scores the same prompt + completion teacher-forced under the weights it
published (`token_logprobs` of services/trainer/logprobs.py on a reference copy of the
model) and takes the largest absolute difference over all probe tokens. Both sides score
the same tokens, so whatever the replica produced the comparison is like for like.

A replica whose difference exceeds the tolerance (or that does not answer the probe with
the new version) is unhealthy: it is paused, so it generates nothing from weights that
compute differently, and it stays paused until a later update passes its probe (it is
resumed for that probe and paused again if it fails once more).

Tolerance (`DEFAULT_TOLERANCE`, by the published `trainer.weight_dtype`): in float32 on CPU
the two sides differ only by summation order (the replica's KV-cached incremental decoding
against one full-sequence forward), measured at about 1e-6 on the tiny test model
(tests/trainer/test_parity.py prints it); 1e-3 leaves three orders of magnitude of room and
is still a hundred times below what one corrupted tensor causes there. In 16-bit the
replica computes in bf16/fp16 while the reference computes in float32 from the same rounded
weights: 0.5 nats, a margin for kernels that accumulate in 16 bits, not a measurement.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from services.common.config import FlywheelConfig
from services.core.types import SamplingParams
from services.trainer.logprobs import token_logprobs
from services.trainer.metrics import TrainerMetrics
from services.wire.rollout_client import RolloutClient

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.5}
"""Largest |log p_replica - log p_trainer| (nats) a healthy replica shows, by weight dtype."""
PARITY_FILE = "weight_parity.jsonl"
"""One line per probed replica and version, in the run directory (read by `flywheel doctor`)."""


@dataclass
class ParityResult:
    replica: str
    version: int
    max_abs_logprob_diff: float | None
    """None when the replica gave no comparable answer (see `reason`)."""
    tolerance: float
    ok: bool
    reason: str = ""
    tokens: int = 0


def probe_prompts(
    vocab_size: int, *, n_prompts: int = 3, length: int = 12, seed: int = 0
) -> list[list[int]]:
    """Fixed token-id prompts drawn from the whole vocabulary with a fixed seed: the same on
    every run and every replica, and independent of any tokenizer or chat template."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n_prompts, length), generator=g)
    return [row.tolist() for row in ids]


class Reference(Protocol):
    """The trainer's side of the probe: a model that computes under published weights."""

    vocab_size: int

    def load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Compute under `state_dict` (the published tensors, any float dtype) from now on."""

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [1, T] -> logits [1, T, V] under the last loaded weights. Called from
        several threads at once (one per probed replica); it must not change the model."""


class HFReference:
    """A reference forward over published weights: the model of `actor.path`, built once
    (on CPU, float32).

    `load` copies the published tensors into the model's own float32 parameters, once per
    probed version; `logits` only reads them, so the forwards of all probed replicas can run
    at once. (Swapping the published tensors in for the length of each forward, as
    `torch.func.functional_call` does, changes the one shared model while other forwards
    run on it: a forward that ends puts the model's own tensors back under the forwards
    still running, which then compute partly with other weights; a healthy replica fails.)
    It costs one extra model in rank 0's CPU memory and no copy per update.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)

    def load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            result = self.model.load_state_dict(dict(state_dict), strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"the published weights name tensors the reference model of actor.path does "
                f"not have: {sorted(result.unexpected_keys)[:5]}"
            )

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=input_ids, use_cache=False).logits


def hf_reference(cfg: FlywheelConfig) -> HFReference:
    """The reference of `cfg`: the HF model of `actor.path` on CPU in float32."""
    from services.trainer.model import load_hf_model

    model: Any = load_hf_model(cfg.actor.model_copy(update={"optimizer_dtype": "float32"}))
    model.eval()
    model.requires_grad_(False)
    return HFReference(model)


class ParityProbe:
    """Probes replicas after each update; remembers which ones it paused."""

    def __init__(
        self,
        reference: Callable[[], Reference],
        *,
        weight_dtype: str = "float32",
        tolerance: float | None = None,
        new_tokens: int = 8,
        n_prompts: int = 3,
        prompt_len: int = 12,
        timeout: float = 60.0,
        log_path: Path | None = None,
        metrics: TrainerMetrics | None = None,
    ) -> None:
        self._reference_factory = reference
        self._reference_model: Reference | None = None
        self._lock = asyncio.Lock()
        self.prompts: list[list[int]] = []
        self.n_prompts, self.prompt_len = n_prompts, prompt_len
        self.weight_dtype = weight_dtype
        self.tolerance = DEFAULT_TOLERANCE[weight_dtype] if tolerance is None else tolerance
        self.new_tokens = new_tokens
        self.timeout = timeout
        self.log_path = log_path
        self.metrics = metrics
        if metrics is not None:
            metrics.weight_parity_tolerance.set(self.tolerance)
        self.excluded: set[str] = set()
        self.last: dict[str, ParityResult] = {}

    @classmethod
    def from_config(
        cls,
        cfg: FlywheelConfig,
        *,
        log_path: Path | None = None,
        metrics: TrainerMetrics | None = None,
    ) -> ParityProbe:
        return cls(
            lambda: hf_reference(cfg),
            weight_dtype=cfg.trainer.weight_dtype,
            timeout=min(60.0, cfg.rollout.weight_update_timeout),
            log_path=log_path,
            metrics=metrics,
        )

    def _ensure(self) -> Reference:
        """Build the reference on first use (not at start-up: loading a model may take
        longer than the trainer's start-up deadline)."""
        if self._reference_model is None:
            ref = self._reference_factory()
            self.prompts = probe_prompts(
                ref.vocab_size, n_prompts=self.n_prompts, length=self.prompt_len
            )
            self._reference_model = ref
        return self._reference_model

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._ensure().load(state_dict)

    def _sampling(self) -> SamplingParams:
        return SamplingParams(
            greedy=True,
            max_new_tokens=self.new_tokens,
            ignore_eos=True,
            n_samples=1,
        )

    def _reference(self, prompt: list[int], out: list[int]) -> torch.Tensor:
        ids = torch.tensor([[*prompt, *out]], dtype=torch.long)
        lp, _ = token_logprobs(self._ensure().logits(ids), ids)
        return lp[0, len(prompt) :]

    async def _one(self, addr: str, client: RolloutClient, version: int) -> ParityResult:
        def result(diff: float | None, reason: str, tokens: int = 0) -> ParityResult:
            ok = diff is not None and math.isfinite(diff) and diff <= self.tolerance
            if not ok and not reason:
                reason = f"max |logp diff| {diff:.3g} > tolerance {self.tolerance:g}"
            return ParityResult(addr, version, diff, self.tolerance, ok, reason, tokens)

        try:
            if addr in self.excluded:  # paused by an earlier failure: its engine must decode
                await client.resume()
            answer = await client.generate(
                prompt_ids=self.prompts,
                sampling=self._sampling(),
                request_id=f"parity-v{version}-{addr}",
                timeout=self.timeout,
            )
        except Exception as exc:  # noqa: BLE001 - reported per replica
            return result(None, f"probe failed: {type(exc).__name__}: {exc}")
        if answer.version != version:
            return result(None, f"answered the probe with version {answer.version}, not {version}")
        if len(answer.completions) != len(self.prompts):
            return result(
                None, f"{len(answer.completions)} completions for {len(self.prompts)} prompts"
            )
        diff, tokens = 0.0, 0
        for prompt, comp in zip(self.prompts, answer.completions, strict=True):
            served = torch.tensor(comp.logprobs, dtype=torch.float32)
            ref = await asyncio.to_thread(self._reference, prompt, list(comp.output_ids))
            if served.shape != ref.shape:
                return result(None, f"{served.numel()} logprobs for {ref.numel()} tokens")
            if served.numel():
                diff = max(diff, float((served - ref).abs().max()))
            tokens += served.numel()
        return result(diff, "", tokens)

    async def check(
        self,
        clients: Mapping[str, RolloutClient],
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        addresses: Sequence[str],
    ) -> dict[str, ParityResult]:
        """Probe `addresses` (replicas that took `version`) and pause those that fail.
        `state_dict` is what was published, cast as it was sent.

        The reference model holds one version at a time: it is loaded once, then the
        replicas are probed at once (their reference forwards only read it), and a second
        check waits until the first one is done with it."""
        async with self._lock:
            await asyncio.to_thread(self._load, state_dict)
            results = await asyncio.gather(*(self._one(a, clients[a], version) for a in addresses))
        out: dict[str, ParityResult] = {}
        for r in results:
            out[r.replica] = r
            self.last[r.replica] = r
            if self.metrics is not None and r.max_abs_logprob_diff is not None:
                self.metrics.weight_parity.labels(replica=r.replica).set(r.max_abs_logprob_diff)
            if r.ok:
                if r.replica in self.excluded:
                    log.info("replica passed the parity probe; serving again", extra=asdict(r))
                self.excluded.discard(r.replica)
                continue
            self.excluded.add(r.replica)
            log.error("replica failed the weight parity probe; paused", extra=asdict(r))
            try:
                await clients[r.replica].pause()
            except Exception as exc:  # noqa: BLE001 - an unreachable replica generates nothing
                log.warning(
                    "could not pause the replica", extra={"replica": r.replica, "error": str(exc)}
                )
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                for r in results:
                    f.write(json.dumps(asdict(r) | {"time": time.time()}) + "\n")
        return out
