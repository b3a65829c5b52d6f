"""The generation and training model behind `benchmarks/scale.py`, as plain arithmetic.

Decode rate: `sglang.bench_latency` on Meta-Llama-3-8B (bf16, one H100, batch 1, 128 prompt
tokens) decodes one token in 9.0 ms, 111 tokens/s per sequence (a public run of SGLang's own
latency benchmark). Decoding is memory-bound, so the sequences of one group decoded together
are taken to advance at that rate each; the group is done when its longest sample is
(the straggler decides).

Response lengths: log-normal, median 2,048 tokens, sigma 0.6, clipped to [1,024, 8,192]: the
1-8k range of reasoning rollouts, with a long tail. Stragglers: with probability 2 % a
replica's group takes 3 times as long (a slow node, a preempted batch).

Training: the trainer takes `batch_groups` groups a step and consumes `trainer_share` (80 %)
of what the whole fleet offers: one step lasts the time the fleet needs to offer a batch,
divided by that share. A fleet that works at its rate then offers 25 % more than the trainer
takes, and the trainer should never wait on the buffer, unless the staleness bound stops
the fleet first (`staleness_bound_share`).

Scaling for one small machine: simulated time runs `time_scale` times faster than real
time, and every sample carries `1 / token_scale` of its tokens on the wire (1-8k tokens
become 32-256 at the default 32), each with a log-probability and a version, as the real
payload has. Rates in the output are converted back to real (unscaled) seconds and tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SGLANG_DECODE_S_PER_TOKEN = 0.0090
"""Meta-Llama-3-8B, one H100, batch 1: sglang.bench_latency's median decode latency."""


@dataclass(frozen=True)
class FleetModel:
    samples: int = 16
    median_tokens: float = 2048.0
    sigma: float = 0.6
    min_tokens: int = 1024
    max_tokens: int = 8192
    straggler_p: float = 0.02
    straggler_factor: float = 3.0
    decode_s_per_token: float = SGLANG_DECODE_S_PER_TOKEN
    weight_update_s: float = 5.0
    """Real seconds a replica needs to take new weights once it has seen a new version."""
    batch_groups: int = 16
    trainer_share: float = 0.8
    """The share of the fleet's offered groups the trainer consumes."""
    time_scale: float = 20.0
    token_scale: int = 32

    def lengths(self, rng: np.random.Generator) -> np.ndarray:
        """Response lengths (real tokens) of one group's samples."""
        raw = rng.lognormal(math.log(self.median_tokens), self.sigma, self.samples)
        return np.clip(raw, self.min_tokens, self.max_tokens).astype(np.int64)

    def group_seconds(self, lengths: np.ndarray, straggler: bool) -> float:
        """Real seconds to generate one group: its longest sample at the decode rate."""
        t = float(lengths.max()) * self.decode_s_per_token
        return t * self.straggler_factor if straggler else t

    def mean_group_seconds(self, rng: np.random.Generator, n: int = 4000) -> float:
        """Monte Carlo mean of `group_seconds` (stragglers included)."""
        return float(
            np.mean(
                [
                    self.group_seconds(self.lengths(rng), rng.random() < self.straggler_p)
                    for _ in range(n)
                ]
            )
        )

    def offered_groups_per_s(self, replicas: int, mean_group_s: float) -> float:
        """Real groups/s a fleet of `replicas` (one group in flight each) offers."""
        return replicas / mean_group_s

    def step_seconds(self, replicas: int, mean_group_s: float) -> float:
        """Real seconds of one trainer step: the time the fleet takes to offer one batch,
        divided by `trainer_share` (the trainer takes that share of the offer)."""
        return self.batch_groups / (
            self.trainer_share * self.offered_groups_per_s(replicas, mean_group_s)
        )

    def staleness_bound_share(self, replicas: int, eta: int) -> float:
        """The most of its time the trainer can be busy when the staleness bound, not the
        fleet's size, limits generation (an upper bound; 1 means the bound does not bind).

        The buffer grants while `accepted + running <= (eta + version + 1) * batch`, where
        `accepted` counts every group ever put and the trainer has consumed `version` batches.
        So groups queued or being generated number at most `eta * batch` while the trainer
        works on a batch (claimed, version not yet bumped), and `(eta + 1) * batch` while it
        waits. With `u` the busy share, at most `(eta + 1 - u) * batch` groups are in flight
        on average, and by Little's law the fleet admits at most that over `mean_group_s`
        groups a second; the trainer takes `u * batch / step_seconds`. Equal at
        `u = (eta + 1) / (1 + k)`, where `k = mean_group_s / step_seconds =
        trainer_share * replicas / batch` is how many steps one group's generation spans.
        """
        k = self.trainer_share * replicas / self.batch_groups
        return min(1.0, (eta + 1) / (1 + k))

    def wire_tokens(self, real_tokens: int) -> int:
        return max(1, real_tokens // self.token_scale)
