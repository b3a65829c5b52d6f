"""AReaL configs are translated, not rejected (`services/common/config/areal_compat/`).

Two kinds of input:
- AReaL's own `examples/math/gsm8k_*.yaml`, read from an AReaL checkout named by the
  `AREAL_SRC` environment variable (checked against the tags v1.0.4 and v2.0.0). Nothing of
  AReaL is copied here, and no package registry ships these files: the `areal` sdist and
  wheel (1.0.4, the only release on PyPI) hold the `areal/` package only, and `realhf`
  0.3.0 (AReaL's older name) has no `examples/math/*.yaml`; without `AREAL_SRC` the test
  is skipped, saying so;
- AReaL-style files written for these tests (GRPO, PPO, Dr.GRPO, GSPO, DAPO), whose
  resolved algorithm settings are compared with what AReaL would use: the value the file
  sets, else the default of AReaL's `areal/api/cli_args.py` (AReaL 2.0, cbff54d; each
  default named in a comment).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli
from services.common.config import ConfigError
from services.common.config.areal_compat import areal_markers, parse_allocation
from services.common.config.interpolation import resolve_interpolations
from services.common.config.loader import load_with_report

AREAL_SRC = os.environ.get("AREAL_SRC", "")
_EXAMPLES = Path(AREAL_SRC) / "examples" / "math" if AREAL_SRC else None
_AREAL_FILES = sorted(_EXAMPLES.glob("gsm8k_*.yaml")) if _EXAMPLES and _EXAMPLES.is_dir() else []
NO_AREAL_SRC = (
    "AReaL's examples/math/*.yaml are in no registry package (areal 1.0.4 sdist and wheel, "
    "realhf 0.3.0) and are not copied here: set AREAL_SRC to an AReaL checkout to load them"
)

# Keys AReaL's own loader refuses under `actor` or `teacher` before it reads anything else
# (areal/api/cli_args.py: `_LEGACY_REJECTION_SAMPLING_KEYS`, checked by
# `_migrate_legacy_rejection_sampling` in `to_structured_cfg`; v1.0.4 and v2.0.0). A file
# that carries one is not a file AReaL accepts: Flywheel must refuse it too, with the
# migration to `rejection_sampling`.
_AREAL_REFUSED = ("behave_imp_weight_cap", "behave_imp_weight_mode")


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["run", *args, "--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _has_key(tree: Any, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


# --------------------------------------------------------------------------- AReaL's files


def _areal_refuses(raw: dict[str, Any]) -> list[str]:
    """The keys of `raw` that AReaL's loader refuses (see `_AREAL_REFUSED`)."""
    return [
        f"{section}.{key}"
        for section in ("actor", "teacher")
        if isinstance(raw.get(section), dict)
        for key in _AREAL_REFUSED
        if key in raw[section]
    ]


@pytest.mark.skipif(not _AREAL_FILES, reason=NO_AREAL_SRC)
@pytest.mark.parametrize("path", _AREAL_FILES, ids=lambda p: p.name)
def test_areals_own_gsm8k_examples_load_with_dry_run(
    path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATASETS_DIR", str(tmp_path))  # no local GSM8K copy
    raw = yaml.safe_load(path.read_text())
    code, out, err = _dry_run(capsys, "--config", str(path))
    refused = _areal_refuses(raw)
    if refused:
        # AReaL stops on these (gsm8k_grpo_megatron_lora*.yaml): so does the dry-run, with
        # the migration instead of a translation.
        assert code == 2, out
        assert any(f"{key} = " in err for key in refused), err
        assert "rejection_sampling" in err
        return
    assert code == 0, err
    resolved = yaml.safe_load(out)  # the table is YAML comments: stdout stays YAML
    actor = resolve_interpolations(raw).get("actor") or {}
    if actor.get("use_lora") is True:
        # AReaL trains LoRA adapters (gsm8k_grpo_lora.yaml): so does Flywheel, with the
        # file's rank, alpha and targets; rollout serves the merged weights, so SGLang's
        # LoRA serving arguments stay out of its launch arguments.
        for key in ("use_lora", "lora_rank", "lora_alpha", "target_modules", "peft_type"):
            if key in actor:
                assert resolved["actor"][key] == actor[key], key
                assert f"# actor.{key} " in out, key  # a table row, mapped
        launch = resolved["rollout"]["sglang"].get("launch_args") or {}
        assert not {"enable_lora", "max_lora_rank"} & set(launch), launch
        assert "rollout serves merged weights" in err
    assert resolved["experiment_name"] == raw["experiment_name"]
    warnings = [line for line in err.splitlines() if ": warning: " in line]
    assert warnings, "ignored AReaL keys are reported"
    for line in warnings:
        key = line.split(": warning: ", 1)[1].split(":", 1)[0]
        assert _has_key(raw, key), f"the warning names a key of the file: {line}"
    # The table names every AReaL-only key the file has.
    rows = [line[2:].split(" ", 1)[0] for line in out.splitlines() if line.startswith("# ")]
    for marker in areal_markers(raw):
        assert any(r == marker or r.startswith(marker + ".") for r in rows), marker
    assert resolved["reward"]["fn"] == "gsm8k"  # train_dataset.path: openai/gsm8k


# --------------------------------------------------------------------------- written here

# The common part of AReaL's gsm8k examples, as a user writes it (not copied).
_BASE: dict[str, Any] = {
    "experiment_name": "written-for-test",
    "trial_name": "t0",
    "cluster": {"n_nodes": 1, "n_gpus_per_node": 4, "fileroot": "/tmp/exp"},
    "gconfig": {"n_samples": 4, "max_new_tokens": 512, "temperature": 1.0},
    "rollout": {"backend": "sglang:d2t1", "max_head_offpolicyness": 2},
    "actor": {
        "backend": "fsdp:d2",
        "path": "/models/policy",
        "temperature": "${gconfig.temperature}",
        "kl_ctl": 0.0,
        "ppo_n_minibatches": 1,
        "reward_scaling": 10.0,
        "reward_bias": -0.5,
        "recompute_logprob": True,
        "use_decoupled_loss": True,
        "adv_norm": {"mean_level": "batch", "std_level": "batch"},
    },
    "train_dataset": {"path": "/data/train.jsonl", "batch_size": 8, "type": "rl"},
    "saver": {"freq_epochs": 1, "freq_steps": 20},
    "recover": {"mode": "auto", "freq_steps": 10, "retries": 5},
    "stats_logger": {"wandb": {"mode": "offline", "project": "p"}},
}

_GROUP_NORM = {"mean_level": "group", "std_level": "group", "group_size": "${gconfig.n_samples}"}


def _variant(actor: dict[str, Any], **root: Any) -> dict[str, Any]:
    tree = yaml.safe_load(yaml.safe_dump(_BASE))
    tree["actor"].update(actor)
    tree.update(root)
    return tree


# Per algorithm: the AReaL-style file, then the settings AReaL would run with.
# AReaL defaults used where a file is silent (areal/api/cli_args.py, PPOActorConfig):
# eps_clip 0.2, eps_clip_higher None, reward_norm None, discount 1.0, gae_lambda 1.0,
# importance_sampling_level "token", overlong_reward_penalty False; NormConfig: eps 1e-5,
# std_unbiased True, group_size 1; PPOCriticConfig.eps_clip 0.5; dynamic_bs False.
ALGORITHMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # examples/math/gsm8k_grpo.yaml: group reward norm, batch adv norm, eps_clip 0.4.
    "grpo": (
        _variant({"eps_clip": 0.4, "reward_norm": _GROUP_NORM}),
        {
            "actor.eps_clip": 0.4,
            "actor.eps_clip_higher": None,
            "actor.reward_norm.mean_level": "group",
            "actor.reward_norm.std_level": "group",
            "actor.reward_norm.group_size": 4,
            "actor.reward_norm.eps": 1e-5,
            "actor.adv_norm.mean_level": "batch",
            "actor.importance_sampling_level": "token",
            "actor.discount": 1.0,
            "actor.gae_lambda": 1.0,
            "actor.dynamic_sampling": False,
            "critic": None,
        },
    ),
    # examples/math/gsm8k_ppo.yaml: a critic (eps_clip 0.5), no reward_norm (default None).
    "ppo": (
        _variant(
            {"eps_clip": 0.4},
            critic={"backend": "fsdp:d2", "path": "${actor.path}", "eps_clip": 0.5},
        ),
        {
            "actor.reward_norm": None,
            "actor.adv_norm.std_level": "batch",
            "critic.eps_clip": 0.5,
            "critic.ppo_n_minibatches": 4,  # PPOCriticConfig default
            "actor.gae_lambda": 1.0,
        },
    ),
    # examples/math/gsm8k_drgrpo.yaml: the group reward norm without std.
    "drgrpo": (
        _variant({"eps_clip": 0.4, "reward_norm": {**_GROUP_NORM, "std_level": None}}),
        {
            "actor.reward_norm.mean_level": "group",
            "actor.reward_norm.std_level": None,
            "actor.adv_norm.mean_level": "batch",
        },
    ),
    # examples/math/gsm8k_gspo.yaml: sequence-level importance ratio.
    "gspo": (
        _variant({"eps_clip": 0.4, "importance_sampling_level": "sequence"}),
        {"actor.importance_sampling_level": "sequence", "actor.eps_clip": 0.4},
    ),
    # examples/math/gsm8k_dapo_dynamic_bs.yaml: clip-higher, overlong penalty, dynamic_bs.
    "dapo": (
        _variant(
            {
                "eps_clip": 0.2,
                "eps_clip_higher": 0.28,
                "overlong_reward_penalty": True,
                "overlong_tokens": 512,
                "overlong_penalty_factor": 1.0,
                "reward_norm": _GROUP_NORM,
            },
            dynamic_bs=True,
        ),
        {
            "actor.eps_clip": 0.2,
            "actor.eps_clip_higher": 0.28,
            "actor.overlong_reward_penalty": True,
            "actor.overlong_tokens": 512,
            "actor.overlong_penalty_factor": 1.0,
            "actor.dynamic_sampling": True,
        },
    ),
}


def _get(model: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        model = getattr(model, part)
        if model is None:
            return None
    return model


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_written_areal_files_resolve_to_areals_algorithm_settings(
    name: str, tmp_path: Path
) -> None:
    tree, expected = ALGORITHMS[name]
    path = tmp_path / f"gsm8k_{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, report = load_with_report(path)
    assert report.source == "areal"
    for key, want in expected.items():
        got = _get(config, key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=0, abs=1e-12), key
        else:
            assert got == want, key
    # The settings every variant shares (from the file, mapped keys included).
    assert config.actor.reward_scaling == 10.0 and config.actor.reward_bias == -0.5
    assert config.actor.use_decoupled_loss and config.actor.kl_ctl == 0.0
    assert config.trainer.n_ranks == 2  # fsdp:d2
    assert (config.rollout.engine, config.rollout.n_replicas) == ("sglang", 2)  # sglang:d2t1
    assert config.trainer.backend == "nccl"  # n_gpus_per_node: 4
    assert config.trainer.weight_transport == "distributed"  # AReaL's default xccl
    assert config.trainer.save_freq_steps == 10  # min(saver 20, recover 10)
    assert config.trainer.recover == "auto" and config.launcher.max_restarts == 5
    assert config.tracking.wandb.mode == "offline" and config.tracking.wandb.project == "p"


def test_translation_names_each_areal_key_with_what_flywheel_does(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(ALGORITHMS["grpo"][0]))
    _, report = load_with_report(path)
    rows = {r.key: r for r in report.translations}
    assert rows["actor.backend"].action == "mapped"
    assert "trainer.n_ranks: 2" in rows["actor.backend"].flywheel
    assert rows["saver.freq_epochs"].action == "ignored"
    assert "by trainer step" in rows["saver.freq_epochs"].flywheel
    assert rows["cluster.n_nodes"].action == "ignored"
    text = "\n".join(report.lines())
    assert "AReaL key" in text and "saver.freq_steps" in text


def test_overrides_of_an_areal_file_take_areal_and_flywheel_keys(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(ALGORITHMS["grpo"][0]))
    config, _ = load_with_report(path, ["actor.backend=fsdp:d3", "rollout.backend=sglang:d1t2"])
    assert config.trainer.n_ranks == 3
    assert (config.rollout.n_replicas, config.rollout.sglang.tp_size) == (1, 2)
    # A Flywheel-only key wins over what the translation derived.
    config, _ = load_with_report(path, ["trainer.n_ranks=5"])
    assert config.trainer.n_ranks == 5


def test_a_typo_in_an_areal_file_still_fails(tmp_path: Path) -> None:
    tree = yaml.safe_load(yaml.safe_dump(ALGORITHMS["grpo"][0]))
    tree["actor"]["eps_clipp"] = 0.3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as err:
        load_with_report(path)
    assert err.value.paths == ["actor.eps_clipp"]
    assert "did you mean 'actor.eps_clip'" in str(err.value)


def test_cpu_template_runs_the_torch_engine_on_cpu(tmp_path: Path) -> None:
    # AReaL's gsm8k_grpo_cpu.yaml idea: no GPUs, vllm:d1p1t1 rollout.
    tree = yaml.safe_load(yaml.safe_dump(ALGORITHMS["grpo"][0]))
    tree["cluster"]["n_gpus_per_node"] = 0
    tree["rollout"]["backend"] = "vllm:d1p1t1"
    tree["actor"]["backend"] = "fsdp:d1p1t1"
    tree["actor"]["weight_update_mode"] = "disk"
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, _ = load_with_report(path)
    assert (config.trainer.backend, config.trainer.device) == ("gloo", "cpu")
    assert (config.rollout.engine, config.rollout.torch_device) == ("torch", "cpu")
    assert config.trainer.weight_transport == "disk"


def test_lora_keys_map_and_lora_serving_keys_are_reported(tmp_path: Path) -> None:
    # The LoRA part of AReaL's gsm8k_grpo_lora.yaml, written here: rollout.use_lora feeds
    # actor.use_lora and sglang.enable_lora by interpolation, gconfig.lora_name names the
    # adapter SGLang would serve.
    tree = _variant(
        {
            "use_lora": "${rollout.use_lora}",
            "peft_type": "lora",
            "lora_rank": 16,
            "lora_alpha": 32,
            "target_modules": ["all-linear"],
            "weight_update_mode": "disk",
        },
        sglang={"enable_lora": "${actor.use_lora}", "max_lora_rank": "${actor.lora_rank}"},
    )
    tree["rollout"]["use_lora"] = True
    tree["gconfig"]["lora_name"] = "lora-gsm8k"
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, report = load_with_report(path)
    actor = config.actor
    assert (actor.use_lora, actor.peft_type, actor.lora_rank, actor.lora_alpha) == (
        True,
        "lora",
        16,
        32,
    )
    assert actor.target_modules == ["all-linear"]
    rows = {r.key: r for r in report.translations}
    for key in ("use_lora", "peft_type", "lora_rank", "lora_alpha", "target_modules"):
        assert rows[f"actor.{key}"].action == "mapped", key
    assert "32/16" in rows["actor.lora_alpha"].flywheel  # scale alpha / r
    for key in (
        "rollout.use_lora",
        "gconfig.lora_name",
        "sglang.enable_lora",
        "sglang.max_lora_rank",
    ):
        assert rows[key].action == "ignored", key
        assert "rollout serves merged weights" in rows[key].flywheel, key
    # SGLang is not asked to serve adapters: it gets the merged weights.
    assert not {"enable_lora", "max_lora_rank"} & set(config.rollout.sglang.launch_args)


def test_sapo_rejection_sampling_is_dropped_as_areal_does(tmp_path: Path) -> None:
    # AReaL's PPOActorConfig.__post_init__: rejection_sampling without
    # use_decoupled_loss is ignored (a warning); gsm8k_sapo.yaml keeps the block.
    tree = _variant(
        {
            "use_sapo_loss": True,
            "use_decoupled_loss": False,
            "recompute_logprob": False,
            "rejection_sampling": {"metric": "ratio", "upper": 5.0},
        }
    )
    path = tmp_path / "sapo.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, report = load_with_report(path)
    assert config.actor.rejection_sampling is None and config.actor.use_sapo_loss
    assert any(
        r.key == "actor.rejection_sampling" and r.action == "ignored" for r in report.translations
    )


def test_allocation_strings() -> None:
    assert parse_allocation("fsdp:d4p1t1", "fsdp").world == 4
    assert parse_allocation("megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)", "fsdp").world == 6
    alloc = parse_allocation("sglang:d2t4", "sglang")
    assert (alloc.backend, alloc.dims) == ("sglang", {"d": 2, "t": 4})
    assert parse_allocation("d8", "fsdp").backend == "fsdp"
    with pytest.raises(ValueError, match="parallel dimensions"):
        parse_allocation("fsdp:", "fsdp")


def test_legacy_allocation_mode(tmp_path: Path) -> None:
    tree = yaml.safe_load(yaml.safe_dump(_BASE))
    del tree["actor"]["backend"], tree["rollout"]["backend"]
    tree["allocation_mode"] = "sglang:d3p1t2+fsdp:d5"
    path = tmp_path / "legacy.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, _ = load_with_report(path)
    assert (config.rollout.n_replicas, config.rollout.sglang.tp_size) == (3, 2)
    assert config.trainer.n_ranks == 5


# --------------------------------------------------------------------------- detection


def test_flywheel_files_are_not_translated() -> None:
    config, report = load_with_report(Path("examples/grpo.yaml"))
    assert report.source == "flywheel" and not report.translations and not report.markers


def test_forced_flywheel_reading_explains_collisions_without_did_you_mean(
    tmp_path: Path,
) -> None:
    path = tmp_path / "areal.yaml"
    path.write_text(
        yaml.safe_dump({"recover": {"mode": "auto"}, "rollout": {"backend": "sglang:d1"}})
    )
    with pytest.raises(ConfigError) as err:
        load_with_report(path, source="flywheel")
    text = str(err.value)
    assert set(err.value.paths) == {"recover", "rollout.backend"}
    # `trainer.recover` and `trainer.backend` exist with other meanings: never suggested.
    assert "did you mean" not in text
    assert "--from areal" in text and "trainer.recover: auto|disabled" in text


def test_from_areal_flag_translates(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A file with no AReaL-only key is read as AReaL's only when told so.
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"actor": {"eps_clip": 0.3}}))
    code, out, _ = _dry_run(capsys, "--config", str(path), "--from", "areal")
    assert code == 0
    assert "# read as an AReaL config (--from areal)" in out
    # AReaL's default weight_update_mode xccl applies: the distributed transport.
    assert yaml.safe_load(out)["trainer"]["weight_transport"] == "distributed"


@pytest.mark.parametrize(
    ("tree", "key"),
    [
        ({"launcher": {"trainer_cpus_per_gpu": 4}}, "launcher.trainer_cpus_per_gpu"),
        ({"teacher": {"path": "/m", "backend": "fsdp:d1"}}, "teacher.backend"),
        ({"actor": {"scheduling_spec": []}}, "actor.scheduling_spec"),
    ],
)
def test_areal_keys_in_a_flywheel_file_are_named_not_misdirected(
    tree: dict[str, Any], key: str, tmp_path: Path
) -> None:
    # launcher.trainer_cpus and trainer.backend exist in Flywheel with other meanings.
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as err:
        load_with_report(path, source="flywheel")
    assert err.value.paths == [key]
    assert "did you mean" not in str(err.value) and "AReaL" in str(err.value)


def test_a_key_areal_refuses_is_refused_with_its_migration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Runs without AReaL's files: the shape of gsm8k_grpo_megatron_lora.yaml's actor block,
    # written here (AReaL's loader raises on it, see `_AREAL_REFUSED`).
    tree = _variant({"behave_imp_weight_cap": 5.0})
    assert _areal_refuses(tree) == ["actor.behave_imp_weight_cap"]
    path = tmp_path / "legacy.yaml"
    path.write_text(yaml.safe_dump(tree))
    code, out, err = _dry_run(capsys, "--config", str(path))
    assert code == 2, out
    assert "actor.behave_imp_weight_cap = 5.0" in err
    assert "rejection_sampling" in err


@pytest.mark.parametrize(
    ("teacher", "rows"),
    [
        # AReaL 2.0's train-engine teacher nests its engine fields under `train`
        # (areal/api/cli_args.py, TeacherConfig.train: PPOActorConfig).
        (
            {"engine_type": "train", "train": {"path": "/models/teacher", "dtype": "float32"}},
            ["teacher.train"],
        ),
        # AReaL's default engine_type is `rollout` (an inference engine scores the teacher):
        # Flywheel computes the same log-probabilities in the trainer.
        (
            {"path": "/models/teacher", "rollout": {"max_concurrent_rollouts": 8}},
            ["teacher.engine_type", "teacher.rollout"],
        ),
    ],
)
def test_an_areal_teacher_keeps_its_model(
    teacher: dict[str, Any],
    rows: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(_variant({}, teacher=teacher)))
    code, out, err = _dry_run(capsys, "--config", str(path))
    assert code == 0, err
    resolved = yaml.safe_load(out)["teacher"]
    assert (resolved["path"], resolved["engine_type"]) == ("/models/teacher", "train")
    table = [line[2:].split(" ", 1)[0] for line in out.splitlines() if line.startswith("# ")]
    for row in rows:
        assert row in table, out
    assert not any(": warning: teacher.train" in line for line in err.splitlines())
