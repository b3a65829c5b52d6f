"""The generic runner: the HF model's own forward over a shared, left-padded cache.

`HFRunner` calls the HF model's forward with a left-padded `DynamicCache`, so any causal LM
works, including those the native runner (`native_runner.py`) refuses. New sequences are
prefilled as a batch and merged into the running batch. It fulfils the contract of
`runner_contract.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.rollout.engine.runner_contract import RunnerSeq, model_max_positions


class HFRunner:
    """Generic runner over the HF forward with a left-padded `DynamicCache`.

    The running batch shares one cache whose rows are left-padded to a common length. New
    (or invalidated) sequences are prefilled together and merged in by left-padding the
    shorter cache; a finished sequence is dropped by selecting the remaining rows.
    """

    def __init__(self, model: torch.nn.Module, *, max_slots: int, pad_id: int = 0) -> None:
        self.model = model
        self.max_slots = max_slots
        self.pad_id = pad_id
        self.max_positions = model_max_positions(model)
        self.device = next(model.parameters()).device
        self._batch: list[RunnerSeq] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cache: Any = None
        self._mask: torch.Tensor | None = None

    def invalidate(self, seqs: Sequence[RunnerSeq]) -> None:
        for s in seqs:
            s.cache_len = 0
            s.slot = None
        self._batch, self._cache, self._mask = [], None, None

    def remove(self, seq: RunnerSeq) -> None:
        if seq.slot is None:
            return
        keep = [i for i, s in enumerate(self._batch) if s is not seq]
        seq.slot = None
        if not keep:
            self._batch, self._cache, self._mask = [], None, None
            return
        idx = torch.tensor(keep, device=self.device)
        kv = [(k[idx], v[idx]) for k, v in _legacy(self._cache)]
        self._batch = [self._batch[i] for i in keep]
        self._cache = _from_legacy(kv)
        assert self._mask is not None
        self._mask = self._mask[idx]

    @torch.no_grad()
    def forward(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor:
        in_batch = {id(s) for s in self._batch}
        new = [s for s in seqs if id(s) not in in_batch]
        if new:
            if len(new) != len(seqs):
                raise ValueError("HFRunner: new and running sequences in one forward")
            return self._prefill(new)
        if len(seqs) != len(self._batch) or any(len(s.tokens) - s.cache_len != 1 for s in seqs):
            raise ValueError("HFRunner: a decode step must cover the whole running batch")
        pos = {id(s): i for i, s in enumerate(self._batch)}
        ids = torch.tensor([[s.tokens[-1]] for s in self._batch], device=self.device)
        assert self._mask is not None
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=self._decode_positions(self._batch),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache, self._mask = out.past_key_values, mask
        for s in self._batch:
            s.cache_len = len(s.tokens)
        logits = out.logits[:, -1]
        return logits[torch.tensor([pos[id(s)] for s in seqs], device=self.device)]

    def _prefill(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor:
        from transformers import DynamicCache

        if len(self._batch) + len(seqs) > self.max_slots:
            raise RuntimeError(f"all {self.max_slots} batch rows are in use")
        lens = [len(s.tokens) for s in seqs]
        lmax = max(lens)
        ids = torch.full((len(seqs), lmax), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(seqs), lmax, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, lmax - lens[i] :] = torch.tensor(s.tokens, device=self.device)
            mask[i, lmax - lens[i] :] = 1
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=DynamicCache(),
            use_cache=True,
            **self._prefill_inputs(seqs, ids, mask),
        )
        for s in seqs:
            s.cache_len = len(s.tokens)
            s.slot = True
        if not self._batch:
            self._batch, self._cache, self._mask = list(seqs), out.past_key_values, mask
        else:
            assert self._mask is not None
            old_kv, new_kv = _legacy(self._cache), _legacy(out.past_key_values)
            t_old, t_new = self._mask.shape[1], mask.shape[1]
            t = max(t_old, t_new)
            merged = []
            for (ko, vo), (kn, vn) in zip(old_kv, new_kv, strict=True):
                merged.append(
                    (
                        torch.cat([_left_pad(ko, t), _left_pad(kn, t)]),
                        torch.cat([_left_pad(vo, t), _left_pad(vn, t)]),
                    )
                )
            self._mask = torch.cat([_left_pad(self._mask, t, dim=1), _left_pad(mask, t, dim=1)])
            self._cache = _from_legacy(merged)
            self._batch = [*self._batch, *seqs]
        return out.logits[:, -1]

    def _decode_positions(self, batch: Sequence[RunnerSeq]) -> torch.Tensor:
        """Position ids `[B, 1]` of the one new token of every row (its index in its own,
        unpadded sequence). A multimodal runner overrides it (3-axis RoPE positions)."""
        return torch.tensor([[s.cache_len] for s in batch], device=self.device)

    def _prefill_inputs(
        self, seqs: Sequence[RunnerSeq], ids: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        """Model inputs of a prefill besides ids, mask and cache: positions counting real
        tokens only (left padding takes none). A multimodal runner adds its images."""
        return {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _left_pad(x: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim=dim)


def _legacy(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k, v) for k, v in cache]


def _from_legacy(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache
