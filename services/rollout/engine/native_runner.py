"""The native runner: a hand-written decoder pass for Llama-family HF models.

`NativeDecoderRunner` runs the decoder of Llama-family models (Qwen2, Qwen3, Llama, Mistral
without sliding window) itself, reading the HF modules' weights, over a slot-based KV cache
(one slot per sequence, slots kept contiguous so a decode step attends over one view without
gathering). It exists because it skips the per-step work of the generic HF forward (mask
building, cache objects, output classes), which is what dominates small-model decoding. It
fulfils the contract of `runner_contract.py`; models it cannot run go to `HFRunner`
(`hf_runner.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from services.rollout.engine.runner_contract import RunnerSeq, model_max_positions

_STATIC_ROPE = {None, "default", "linear", "llama3", "yarn"}
_NATIVE_TYPES = {"qwen2", "qwen3", "llama", "mistral"}


class NativeDecoderRunner:
    """Slot-based KV cache and a hand-written decoder pass for Llama-family HF models."""

    @staticmethod
    def supports(model: torch.nn.Module) -> tuple[bool, str]:
        cfg: Any = model.config  # an HF PretrainedConfig: attributes vary by model type
        if cfg.model_type not in _NATIVE_TYPES:
            return False, f"model_type {cfg.model_type!r} is not one of {sorted(_NATIVE_TYPES)}"
        if getattr(cfg, "use_sliding_window", False) or (
            cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)
        ):
            return False, "sliding-window attention"
        rope = getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _STATIC_ROPE:
            return False, f"rope type {rope_type!r} depends on sequence length"
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            return False, "model has no .model.layers / .model.rotary_emb"
        return True, ""

    def __init__(
        self, model: torch.nn.Module, *, max_slots: int, initial_capacity: int = 256
    ) -> None:
        ok, why = self.supports(model)
        if not ok:
            raise ValueError(f"native runner cannot run this model: {why}")
        # The HF model's submodules and config fields are dynamic attributes (nn.Module's
        # __getattr__ types them Tensor | Module): typed Any here, checked by supports().
        hf: Any = model
        cfg: Any = hf.config
        self.model = model
        base: Any = hf.model
        self.embed: Any = base.embed_tokens
        self.layers: list[Any] = list(base.layers)
        self.norm: Any = base.norm
        self.lm_head: Any = hf.lm_head
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.max_positions = model_max_positions(model)
        self.max_slots = max_slots
        self._silu = getattr(cfg, "hidden_act", "silu") == "silu"
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # RoPE tables for every position, computed once by the model's own rotary module
        # (float32 inside, cast to the activation dtype exactly as the HF forward does).
        positions = torch.arange(self.max_positions, device=self.device).unsqueeze(0)
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = base.rotary_emb(probe, positions)
        self.cos = cos[0]
        self.sin = sin[0]
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._grow(min(initial_capacity, self.max_positions))
        self._owner: list[RunnerSeq | None] = [None] * max_slots
        self._qk_norm = [getattr(x.self_attn, "q_norm", None) is not None for x in self.layers]
        self._paired = self._pairing()
        self.refresh_weights()

    @torch.inference_mode()
    def refresh_weights(self) -> None:
        """Rebuild the fused projection weights from the model's parameters.

        q/k/v and gate/up projections are concatenated so a decode step runs one matmul
        for each group instead of three and two; the engine calls this after every weight
        update (the copies would otherwise keep serving the old weights).
        """
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # Plain references per layer: a decode step of a tiny model is short enough that
        # nn.Module attribute lookups (a few thousand per step) show up in its profile.
        self._o = [(x.self_attn.o_proj.weight, x.self_attn.o_proj.bias) for x in self.layers]
        self._down = [(x.mlp.down_proj.weight, x.mlp.down_proj.bias) for x in self.layers]
        self._ln = [
            (
                (x.input_layernorm, x.input_layernorm.weight, x.input_layernorm.variance_epsilon),
                (
                    x.post_attention_layernorm,
                    x.post_attention_layernorm.weight,
                    x.post_attention_layernorm.variance_epsilon,
                ),
            )
            for x in self.layers
        ]
        self._final_ln = (self.norm, self.norm.weight, self.norm.variance_epsilon)
        self._head = (self.lm_head.weight, self.lm_head.bias)
        self._q_size = self.num_heads * self.head_dim
        self._kv_size = self.num_kv_heads * self.head_dim
        for layer in self.layers:
            a = layer.self_attn
            projections = [a.q_proj, a.k_proj, a.v_proj]
            w = torch.cat([x.weight for x in projections])
            bias = _fused_bias(projections)
            if self._paired:  # see _pairing(): pair RoPE halves, fold the softmax scale into q
                rows = self._paired_rows
                scale = torch.ones(len(rows), dtype=w.dtype, device=w.device)
                scale[: self._q_size] = self.scaling
                w = w[rows] * scale.unsqueeze(1)
                bias = None if bias is None else bias[rows] * scale
            self._qkv.append((w.contiguous(), bias))
            m = layer.mlp
            self._gate_up.append(
                (
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                    _fused_bias([m.gate_proj, m.up_proj]),  # Llama's mlp_bias
                )
            )
        # Without biases the residual add rides in the GEMM (addmm): one op fewer, twice a layer.
        self._o_t = [w.t() if b is None else None for w, b in self._o]
        self._down_t = [w.t() if b is None else None for w, b in self._down]

    def _pairing(self) -> bool:
        """Whether q/k rows are stored in paired order, so RoPE is one complex product.

        HF's RoPE rotates dimension i of a head together with i + head_dim/2 (`rotate_half`,
        five ops). Storing the q and k projection rows of each head as (0, h, 1, h+1, ...)
        makes every rotated pair adjacent, and RoPE becomes a complex multiplication by
        cos + i sin. Attention only ever uses q . k, which the same permutation of both
        leaves unchanged, and values are not permuted, so the outputs are the same up to
        float rounding; the softmax scale is folded into the q rows at the same time. Only
        for float32/64 (complex dtypes), without per-head q/k norms (their weights would
        need the permutation too) and when both halves of the RoPE tables are equal (true of
        HF's rotary modules, checked).
        """
        if self.dtype not in (torch.float32, torch.float64) or any(self._qk_norm):
            return False
        half = self.head_dim // 2
        if self.head_dim % 2 or not (
            torch.equal(self.cos[:, :half], self.cos[:, half:])
            and torch.equal(self.sin[:, :half], self.sin[:, half:])
        ):
            return False
        within = torch.stack([torch.arange(half), torch.arange(half) + half], 1).reshape(-1)
        heads = torch.arange(self.num_heads + self.num_kv_heads).unsqueeze(1) * self.head_dim
        q_and_k = (heads + within).reshape(-1)  # q heads, then k heads, each in paired order
        v_start = len(q_and_k)
        v = torch.arange(v_start, v_start + self.num_kv_heads * self.head_dim)
        self._paired_rows = torch.cat([q_and_k, v])  # rows of the fused q/k/v weight
        self._rot = torch.complex(self.cos[:, :half], self.sin[:, :half])  # [positions, half]
        return True

    # ----------------------------------------------------------------- cache

    @torch.inference_mode()
    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if needed > self.max_positions:
            raise ValueError(f"sequence of {needed} tokens exceeds {self.max_positions} positions")
        cap = min(self.max_positions, max(needed, 2 * self.capacity))
        shape = (self.max_slots, self.num_kv_heads, cap, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        for i in range(len(self.k)):
            new_k[i][:, :, : self.capacity] = self.k[i]
            new_v[i][:, :, : self.capacity] = self.v[i]
        self.k, self.v, self.capacity = new_k, new_v, cap

    def _alloc(self, seq: RunnerSeq) -> None:
        for slot, owner in enumerate(self._owner):
            if owner is None:
                self._owner[slot] = seq
                seq.slot = slot
                return
        raise RuntimeError(f"all {self.max_slots} KV slots are in use")

    @torch.inference_mode()
    def remove(self, seq: RunnerSeq) -> None:
        """Free the sequence's slot; the highest occupied slot moves into it (contiguity)."""
        slot = seq.slot
        if slot is None:
            return
        seq.slot = None
        self._owner[slot] = None
        last = max((i for i, o in enumerate(self._owner) if o is not None), default=-1)
        if last > slot:
            mover = self._owner[last]
            assert mover is not None
            n = mover.cache_len
            for i in range(len(self.layers)):
                self.k[i][slot, :, :n] = self.k[i][last, :, :n]
                self.v[i][slot, :, :n] = self.v[i][last, :, :n]
            self._owner[slot], self._owner[last] = mover, None
            mover.slot = slot

    def adopt(self, old: RunnerSeq, new: RunnerSeq) -> None:
        """Give `old`'s slot, with its cached keys/values, to `new` (prefix reuse: the
        engine then sets `new.cache_len` to the length of the prefix they share)."""
        slot = old.slot
        if slot is None:
            raise ValueError("adopt(): the old sequence has no slot")
        old.slot = None
        self._owner[slot] = new
        new.slot = slot

    def invalidate(self, seqs: Sequence[RunnerSeq]) -> None:
        """Weights changed: every sequence recomputes its keys/values from position 0."""
        for s in seqs:
            s.cache_len = 0

    # --------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor:
        if not seqs:
            raise ValueError("forward() needs at least one sequence")
        for s in seqs:
            if s.slot is None:
                self._alloc(s)
            if s.cache_len >= len(s.tokens):
                raise ValueError("sequence has no pending tokens")
        self._grow(max(len(s.tokens) for s in seqs))
        if all(len(s.tokens) - s.cache_len == 1 for s in seqs):
            logits = self._decode(seqs)
        else:
            logits = self._extend(seqs)
        for s in seqs:
            s.cache_len = len(s.tokens)
        return logits

    @staticmethod
    def _rms(norm: tuple[Any, torch.Tensor, float], x: torch.Tensor) -> torch.Tensor:
        """RMSNorm from the (module, weight, eps) cached by `refresh_weights`: the fused
        kernel in float32 (same formula as HF's), the module otherwise."""
        module, weight, eps = norm
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return module(x)

    def _rope_at(self, positions: torch.Tensor) -> Any:
        """What `_attn_qkv` rotates with at `positions` [B, L]: the complex factors
        [B, L, head_dim/2] with paired rows, else the (cos, sin) tables [B, L, head_dim]."""
        if self._paired:
            return self._rot[positions]
        return self.cos[positions], self.sin[positions]

    def _attn_qkv(
        self, i: int, layer: Any, h: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `h` [B, L, H] as [B, heads, L, head_dim], RoPE (from `_rope_at`) applied."""
        b, length, _ = h.shape
        w, bias = self._qkv[i]
        qkv = F.linear(h, w, bias)
        nq, nkv = self.num_heads, self.num_kv_heads
        if self._paired:
            pairs = qkv[..., : self._q_size + self._kv_size].view(
                b, length, nq + nkv, self.head_dim // 2, 2
            )
            qk = torch.view_as_real(torch.view_as_complex(pairs) * rope.unsqueeze(2))
            qk = qk.view(b, length, nq + nkv, self.head_dim)
            v = qkv[..., self._q_size + self._kv_size :]
            q = qk[:, :, :nq].transpose(1, 2)
            k = qk[:, :, nq:].transpose(1, 2)
            return q, k, v.reshape(b, length, nkv, self.head_dim).transpose(1, 2)
        if self._qk_norm[i]:  # Qwen3: per-head norms before RoPE
            attn = layer.self_attn
            q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
            qk = torch.cat(
                [
                    attn.q_norm(q.view(b, length, nq, self.head_dim)),
                    attn.k_norm(k.view(b, length, nkv, self.head_dim)),
                ],
                dim=2,
            )
        else:
            qk = qkv[..., : self._q_size + self._kv_size].view(b, length, nq + nkv, self.head_dim)
            v = qkv[..., self._q_size + self._kv_size :]
        # RoPE on q and k together (one set of ops): x * cos + rotate_half(x) * sin
        cos, sin = rope[0].unsqueeze(2), rope[1].unsqueeze(2)
        qk = qk * cos + _rotate_half(qk) * sin
        q = qk[:, :, :nq].transpose(1, 2)
        k = qk[:, :, nq:].transpose(1, 2)
        v = v.reshape(b, length, nkv, self.head_dim).transpose(1, 2)
        return q, k, v

    def _finish_layer(
        self, i: int, layer: Any, x: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        b, _, length, _ = attn_out.shape
        o = attn_out.transpose(1, 2).reshape(b * length, self.num_heads * self.head_dim)
        shape = x.shape
        x = x.reshape(b * length, shape[-1])
        o_t, down_t = self._o_t[i], self._down_t[i]
        x = torch.addmm(x, o, o_t) if o_t is not None else x + F.linear(o, *self._o[i])
        gate, up = F.linear(self._rms(self._ln[i][1], x), *self._gate_up[i]).chunk(2, dim=-1)
        act = (F.silu(gate) if self._silu else layer.mlp.act_fn(gate)).mul_(up)
        x = torch.addmm(x, act, down_t) if down_t is not None else x + F.linear(act, *self._down[i])
        return x.view(shape)

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of one query per row: plain matmuls beat the SDPA kernels at this size.

        Grouped-query attention without expanding the cache: query head h reads key/value
        head h // rep (as `repeat_interleave` would give it), so the `rep` query heads of
        one group go in as `rep` rows against their shared keys. Expanding copied the whole
        cache every layer and step (~7.5 % of SmolLM2's decode CPU time,
        benchmarks/smollm2_decode_profile.py). `bias` is [b, 1, 1, L] and broadcasts."""
        b, heads, _, dim = q.shape
        grouped = self.num_kv_heads != self.num_heads
        if grouped:
            q = q.reshape(b, self.num_kv_heads, heads // self.num_kv_heads, dim)
        scores = torch.matmul(q, keys.transpose(-1, -2))
        if not self._paired:  # else the scale is folded into q
            scores = scores.mul_(self.scaling)
        if bias is not None:
            scores = scores.add_(bias)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)
        return out.reshape(b, heads, 1, dim) if grouped else out

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            scale=1.0 if self._paired else self.scaling,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )

    def _decode(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor:
        b = len(seqs)
        dev = self.device
        slots = [s.slot for s in seqs]
        order: list[int] | None = None  # None: rows already in slot order 0..b-1
        if slots != list(range(b)):
            order = sorted(range(b), key=slots.__getitem__)
            seqs = [seqs[i] for i in order]
        contiguous = order is None or all(s.slot == i for i, s in enumerate(seqs))
        pos_list = [s.cache_len for s in seqs]
        pos = torch.tensor(pos_list, device=dev)
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=dev).view(b, 1)
        length = max(pos_list) + 1
        uniform = min(pos_list) + 1 == length  # every row at the same position: no mask
        bias = None
        if not uniform:
            bias = torch.zeros(b, 1, 1, length, dtype=self.dtype, device=dev)
            bias.masked_fill_(
                (torch.arange(length, device=dev).unsqueeze(0) > pos.unsqueeze(1)).view(
                    b, 1, 1, length
                ),
                float("-inf"),
            )
        rope = self._rope_at(pos.view(b, 1))
        rows = torch.arange(b, device=dev)
        slot_ids = rows if contiguous else torch.tensor([s.slot for s in seqs], device=dev)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attn_qkv(i, layer, self._rms(self._ln[i][0], x), rope)
            if contiguous and uniform:
                kc, vc = self.k[i][:b], self.v[i][:b]
                kc[:, :, length - 1] = k[:, :, 0]
                vc[:, :, length - 1] = v[:, :, 0]
                keys, values = kc[:, :, :length], vc[:, :, :length]
            elif contiguous:
                kc, vc = self.k[i][:b], self.v[i][:b]
                kc[rows, :, pos] = k[:, :, 0]
                vc[rows, :, pos] = v[:, :, 0]
                keys, values = kc[:, :, :length], vc[:, :, :length]
            else:
                self.k[i][slot_ids, :, pos] = k[:, :, 0]
                self.v[i][slot_ids, :, pos] = v[:, :, 0]
                keys, values = self.k[i][slot_ids, :, :length], self.v[i][slot_ids, :, :length]
            x = self._finish_layer(i, layer, x, self._attend_one(q, keys, values, bias))
        logits = F.linear(self._rms(self._final_ln, x[:, -1]), *self._head)
        if order is None:
            return logits
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=dev)] = logits
        return out

    def _extend(self, seqs: Sequence[RunnerSeq]) -> torch.Tensor:
        dev = self.device
        r = len(seqs)
        starts = [s.cache_len for s in seqs]
        news = [s.tokens[s.cache_len :] for s in seqs]
        lens = [len(n) for n in news]
        lmax = max(lens)
        ids = torch.zeros(r, lmax, dtype=torch.long, device=dev)
        positions = torch.empty(r, lmax, dtype=torch.long, device=dev)
        for i, (st, n) in enumerate(zip(starts, news, strict=True)):
            ids[i, : len(n)] = torch.tensor(n, device=dev)
            positions[i] = torch.clamp(torch.arange(st, st + lmax), max=st + len(n) - 1)
        total = max(st + n for st, n in zip(starts, lens, strict=True))
        mask = (
            torch.arange(total, device=dev).view(1, 1, total) <= positions.unsqueeze(-1)
        ).unsqueeze(1)
        rope = self._rope_at(positions)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attn_qkv(i, layer, self._rms(self._ln[i][0], x), rope)
            for j, s in enumerate(seqs):
                st, width = starts[j], lens[j]
                self.k[i][s.slot, :, st : st + width] = k[j, :, :width]
                self.v[i][s.slot, :, st : st + width] = v[j, :, :width]
            keys, values = self.k[i][slots, :, :total], self.v[i][slots, :, :total]
            x = self._finish_layer(i, layer, x, self._sdpa(q, keys, values, mask))
        last = x[torch.arange(r, device=dev), torch.tensor(lens, device=dev) - 1]
        return F.linear(self._rms(self._final_ln, last), *self._head)


def _fused_bias(linears: Sequence[Any]) -> torch.Tensor | None:
    """The concatenated biases of linears fused into one, zeros for those without one;
    None when none has a bias."""
    if all(x.bias is None for x in linears):
        return None
    return torch.cat(
        [x.bias if x.bias is not None else torch.zeros_like(x.weight[:, 0]) for x in linears]
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
