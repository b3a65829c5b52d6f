"""Batched next-token sampling with per-row settings, and the log-probabilities it reports.

Pure tensor functions (no model, no state) so they can be tested in isolation.

The reported log-probability of a sampled token is `log_softmax(logits / T)[token]` over the
full vocabulary, T the row's temperature (T = 1 for greedy rows). That is what the trainer
recomputes from its own forward pass (`actor.temperature` = T), so the importance ratio is 1
for unchanged weights. Top-k, top-p, min-new-tokens masking and the frequency penalty shape
which token is drawn but are not folded into the reported value: the trainer cannot
reproduce them, and AReaL's recomputation ignores them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling settings of one row in a step, already resolved by the engine."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    generator: torch.Generator | None = None
    # Token ids masked out this step (EOS/stop ids while below min_new_tokens).
    banned_ids: tuple[int, ...] = ()
    frequency_penalty: float = 0.0
    # Tokens generated so far (only read when frequency_penalty != 0).
    history: Sequence[int] = ()

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0.0


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus (top-p) set.

    `logits` [B, V] are already temperature-scaled; `top_k` [B] int (<= 0 = no limit) and
    `top_p` [B] float in (0, 1]. A token is kept by top-p when the probability mass of the
    tokens strictly more likely than it is below `top_p`, so the most likely token always
    survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    drop = ranks >= k.unsqueeze(-1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (mass_before >= top_p.unsqueeze(-1))
    drop_unsorted = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(drop_unsorted, float("-inf"))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V]: argmax(probs / E), E ~ Exponential(1) per entry,
    which draws token v with probability probs[v] / sum(probs) (the exponential race).

    On CPU this is exactly what `torch.multinomial(probs, 1)` computes, draw for draw from
    the same generator state (tested); called directly it skips multinomial's input checks,
    a third of the sampling time of a decode step with a small vocabulary. `probs` must be
    non-negative with a positive sum per row, as softmax output is.
    """
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.div(probs, race, out=race).argmax(dim=-1)


def sample_next(
    logits: torch.Tensor, rows: Sequence[RowSampling], shared_generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V] (float32 recommended).

    Returns `(tokens [B] int64, logprobs [B] float32)`; see the module docstring for what the
    log-probability is. Rows with their own generator (a request seed) draw from it alone, so
    their samples do not depend on which other requests share the batch; the others draw
    together from `shared_generator`.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    logits = logits.float()
    device = logits.device
    temp_list = [1.0 if r.is_greedy else r.temperature for r in rows]
    if all(t == temp_list[0] for t in temp_list):  # common case: one scalar division
        temps = torch.full((len(rows),), temp_list[0], device=device)
        scaled = logits if temp_list[0] == 1.0 else logits / temp_list[0]
    else:
        temps = torch.tensor(temp_list, device=device, dtype=torch.float32)
        scaled = logits / temps.unsqueeze(-1)
    logprobs_all = torch.log_softmax(scaled, dim=-1)

    shaped = scaled
    if any(r.frequency_penalty or r.banned_ids for r in rows):
        shaped = scaled.clone()
        for i, r in enumerate(rows):
            if r.frequency_penalty and r.history:
                counts = torch.bincount(
                    torch.as_tensor(list(r.history), device=device), minlength=shaped.shape[-1]
                )[: shaped.shape[-1]]
                shaped[i] -= r.frequency_penalty * counts.to(shaped.dtype) / temps[i]
            if r.banned_ids:
                shaped[i, list(r.banned_ids)] = float("-inf")
    if any((r.top_k > 0 or r.top_p < 1.0) and not r.is_greedy for r in rows):
        top_k = torch.tensor([r.top_k for r in rows], device=device)
        top_p = torch.tensor([r.top_p for r in rows], device=device, dtype=torch.float32)
        shaped = filter_top_k_top_p(shaped, top_k, top_p)

    sampled_rows = [i for i, r in enumerate(rows) if not r.is_greedy]
    if len(sampled_rows) == len(rows) and all(r.generator is None for r in rows):
        # Every row draws from the shared generator: one batched draw.
        probs = torch.softmax(shaped, dim=-1) if shaped is not scaled else logprobs_all.exp()
        tokens = draw(probs, shared_generator)
        return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tokens = torch.argmax(shaped, dim=-1)
    if sampled_rows:
        probs = torch.softmax(shaped, dim=-1)
        shared = [i for i in sampled_rows if rows[i].generator is None]
        if shared:
            idx = torch.tensor(shared, device=device)
            drawn = draw(probs[idx], shared_generator)
            tokens[idx] = drawn
        for i in sampled_rows:
            gen = rows[i].generator
            if gen is not None:
                tokens[i] = draw(probs[i : i + 1], gen)[0]
    logprobs = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
