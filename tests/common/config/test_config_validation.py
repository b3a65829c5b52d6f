"""Every validation rule: the error names the field path, the bad value and the fix.

Rules AReaL enforces, plus the three traps AReaL leaves open and Flywheel closes:
`kl_ctl > 0` without a reference model, the decoupled loss silently losing its
π_prox/π_behave correction, and `metric: binary_kl` (KPop) not loading.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import (
    ConfigError,
    PPOActorConfig,
    RejectionSamplingConfig,
    load_config,
    to_yaml,
)

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.yaml"
# grpo.yaml uses the decoupled loss; these switch to plain PPO for rules that need it.
PLAIN = ("actor.use_decoupled_loss=false", "actor.rejection_sampling=null")


def error_of(*overrides: str) -> tuple[str, object, str]:
    with pytest.raises(ConfigError) as info:
        load_config(GRPO, overrides)
    assert len(info.value.issues) == 1, str(info.value)
    issue = info.value.issues[0]
    return issue.path, issue.value, issue.message


# (overrides, expected path, expected bad value, words the fix must contain)
RULES = [
    # normalisation levels in {batch, group, null}
    (
        ("actor.adv_norm.mean_level=sample",),
        "actor.adv_norm.mean_level",
        "sample",
        "'batch', 'group' or null",
    ),
    (
        ("actor.reward_norm.std_level=global",),
        "actor.reward_norm.std_level",
        "global",
        "'batch', 'group' or null",
    ),
    # SAPO
    (
        (*PLAIN, "actor.use_sapo_loss=true", "actor.sapo_tau_pos=0"),
        "actor.sapo_tau_pos",
        0.0,
        "> 0",
    ),
    (
        (*PLAIN, "actor.use_sapo_loss=true", "actor.sapo_tau_neg=-1"),
        "actor.sapo_tau_neg",
        -1.0,
        "> 0",
    ),
    (
        ("actor.use_sapo_loss=true", "actor.rejection_sampling=null"),
        "actor.use_sapo_loss",
        True,
        "use_decoupled_loss: false",
    ),
    # CISPO
    (
        (*PLAIN, "actor.use_cispo_loss=true", "actor.use_sapo_loss=true"),
        "actor.use_cispo_loss",
        True,
        "at most one",
    ),
    ((*PLAIN, "actor.use_cispo_loss=true"), "actor.eps_clip_higher", None, "eps_clip_higher"),
    (
        (
            *PLAIN,
            "actor.use_cispo_loss=true",
            "actor.eps_clip_higher=4",
            "actor.importance_sampling_level=sequence",
        ),
        "actor.importance_sampling_level",
        "sequence",
        "token",
    ),
    ((*PLAIN, "actor.eps_clip_higher=0"), "actor.eps_clip_higher", 0.0, "> 0"),
    # dual clip
    (("actor.c_clip=1.0",), "actor.c_clip", 1.0, "> 1"),
    (("actor.c_clip=0.5",), "actor.c_clip", 0.5, "> 1"),
    # M2PO
    (("actor.m2_threshold=0",), "actor.m2_threshold", 0.0, "> 0"),
    # rejection sampling bounds by metric
    (("actor.rejection_sampling.upper=1.0",), "actor.rejection_sampling.upper", 1.0, "> 1"),
    (("actor.rejection_sampling.lower=1.5",), "actor.rejection_sampling.lower", 1.5, "[0, 1)"),
    (("actor.rejection_sampling.lower=-0.5",), "actor.rejection_sampling.lower", -0.5, "[0, 1)"),
    (("actor.rejection_sampling.lower=0",), "actor.rejection_sampling.lower", 0.0, "masks nothing"),
    (
        ("actor.rejection_sampling.lower=6",),
        "actor.rejection_sampling.lower",
        6.0,
        "lower <= upper",
    ),
    (
        ("actor.rejection_sampling.metric=kl_k3", "actor.rejection_sampling.upper=0"),
        "actor.rejection_sampling.upper",
        0.0,
        "> 0",
    ),
    (
        ("actor.rejection_sampling.metric=kl_k2", "actor.rejection_sampling.upper=-1"),
        "actor.rejection_sampling.upper",
        -1.0,
        "> 0",
    ),
    (
        ("actor.rejection_sampling.metric=binary_kl", "actor.rejection_sampling.upper=0"),
        "actor.rejection_sampling.upper",
        0.0,
        "> 0",
    ),
    (
        ("actor.rejection_sampling.metric=kl_k1", "actor.rejection_sampling.action=clamp"),
        "actor.rejection_sampling.action",
        "clamp",
        "action: mask",
    ),
    (
        ("actor.rejection_sampling.metric=kpop",),
        "actor.rejection_sampling.metric",
        "kpop",
        "binary_kl",
    ),
    # rejection sampling acts on π_prox/π_behave: only with the decoupled loss
    (
        ("actor.use_decoupled_loss=false",),
        "actor.rejection_sampling",
        {
            "level": "token",
            "action": "mask",
            "metric": "ratio",
            "agg": "mean",
            "upper": 5.0,
            "lower": None,
        },
        "use_decoupled_loss: true",
    ),
    # reuse_train_logp needs a single minibatch
    (
        ("actor.prox_logp_method=reuse_train_logp", "actor.ppo_n_minibatches=4"),
        "actor.ppo_n_minibatches",
        4,
        "ppo_n_minibatches: 1",
    ),
    (
        (*PLAIN, "actor.prox_logp_method=loglinear"),
        "actor.prox_logp_method",
        "loglinear",
        "use_decoupled_loss: true",
    ),
    # legacy keys with migration
    (("+actor.behave_imp_weight_cap=5",), "actor.behave_imp_weight_cap", 5, "rejection_sampling"),
    (("+actor.behav_imp_weight_cap=5",), "actor.behav_imp_weight_cap", 5, "rejection_sampling"),
    (
        ("+actor.behave_imp_weight_mode=token_mask",),
        "actor.behave_imp_weight_mode",
        "token_mask",
        "action: clamp",
    ),
    (("+actor.group_adv_norm=true",), "actor.group_adv_norm", True, "mean_level: group"),
    # the closed trap: KL without a reference model
    (("actor.kl_ctl=0.05",), "actor.kl_ctl", 0.05, "ref"),
    (("actor.kl_ctl=0.05", "actor.path=/ckpt", "ref.dtype=float32"), "ref.path", "", "ref.path"),
    # the closed trap: the behaviour correction is explicit
    (
        (*PLAIN, "actor.decoupled_correction=none"),
        "actor.decoupled_correction",
        "none",
        "use_decoupled_loss: true",
    ),
    # rewards / advantages
    (
        ("actor.overlong_reward_penalty=true",),
        "actor.overlong_reward_penalty",
        True,
        "overlong_tokens",
    ),
    (
        (
            "actor.overlong_reward_penalty=true",
            "actor.overlong_tokens=64",
            "actor.overlong_penalty_factor=1",
        ),
        "actor.overlong_tokens",
        64,
        "max_new_tokens",
    ),
    (("actor.loss_agg_norm=512",), "actor.loss_agg_norm", 512.0, "seq-mean-token-sum-norm"),
    (
        ("actor.mask_no_eos_with_zero=true", "actor.overlong_filtering=true"),
        "actor.overlong_filtering",
        True,
        "set one of the two",
    ),
    (
        ("actor.gae_lambda_kwargs.alpha=1",),
        "actor.gae_lambda_kwargs",
        {"alpha": 1},
        "function path",
    ),
    (("actor.gae_lambda=1.5",), "actor.gae_lambda", 1.5, "[0, 1]"),
    (("actor.gae_lambda=true",), "actor.gae_lambda", True, "number in [0, 1]"),
    (("actor.gae_lambda=''",), "actor.gae_lambda", "", "empty"),
    (
        ("actor.reward_norm.mean_level=group", "actor.min_usable_group_size=1"),
        "actor.min_usable_group_size",
        1,
        ">= 2",
    ),
    # dtype names
    (("actor.dtype=int8",), "actor.dtype", "int8", "float32"),
    # cross-block rules
    (
        ("gconfig.temperature=0.7", "actor.temperature=1.0"),
        "actor.temperature",
        1.0,
        "gconfig.temperature",
    ),
    (("trainer.backend=nccl",), "trainer.backend", "nccl", "gloo"),
    (("train_dataset.builtin=null",), "train_dataset.path", None, "train_dataset.builtin"),
    (
        ("services.reward.port=50052", "services.buffer.port=50052"),
        "services.buffer.port",
        50052,
        "own ports",
    ),
    # replicas 0 and 1 sit on 50100 and 50101 (port + stride 1 * i)
    (
        ("rollout.n_replicas=2", "services.rollout.port=50100", "services.reward.port=50101"),
        "services.reward.port",
        50101,
        "own ports",
    ),
    # one port for every replica (stride 0) on one loopback host: replica 1 takes 0's port
    (
        (
            "rollout.n_replicas=2",
            "services.rollout.port=50100",
            "services.rollout.port_stride=0",
        ),
        "services.rollout.port",
        50100,
        "own ports",
    ),
    # the metrics port of one service may not be another's gRPC port either
    (
        ("services.buffer.port=9000", "services.trainer.metrics_port=9000"),
        "services.trainer.metrics_port",
        9000,
        "own ports",
    ),
    (("experiment_name=my/run",), "experiment_name", "my/run", "letters, digits"),
    (("buffer.read_cache_bytes=-1",), "buffer.read_cache_bytes", -1, "0"),
]


@pytest.mark.parametrize(("overrides", "path", "value", "fix"), RULES, ids=lambda x: str(x)[:60])
def test_rule(overrides: tuple[str, ...], path: str, value: object, fix: str) -> None:
    got_path, got_value, message = error_of(*overrides)
    assert got_path == path, message
    assert got_value == value
    assert fix in message


def test_valid_variants_of_the_rules_load() -> None:
    ok = [
        (*PLAIN, "actor.use_sapo_loss=true", "actor.sapo_tau_pos=0.5", "actor.sapo_tau_neg=2"),
        (*PLAIN, "actor.use_cispo_loss=true", "actor.eps_clip=1.0", "actor.eps_clip_higher=4.0"),
        ("actor.c_clip=3",),
        ("actor.rejection_sampling.lower=0.5", "actor.rejection_sampling.upper=2"),
        ("actor.rejection_sampling.metric=kl_k1", "actor.rejection_sampling.upper=-0.1"),
        ("actor.prox_logp_method=reuse_train_logp", "actor.ppo_n_minibatches=1"),
        ("actor.prox_logp_method=loglinear",),
        ("actor.prox_logp_method=linear",),
        ("actor.prox_logp_method=metrics",),
        ("actor.gae_lambda=0.95", "actor.discount=0.99"),
        ("actor.dtype=bf16", "actor.optimizer_dtype=fp32"),
        ("actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_agg_norm=512"),
        ("actor.overlong_filtering=true",),
        ("actor.mask_no_eos_with_zero=true",),
        ("actor.kl_ctl=0.05", "ref.path=${actor.path}"),  # both the embedded tiny model
        ("actor.kl_ctl=0.05", "actor.path=/ckpt", "ref.path=/ckpt"),
        (
            "rollout.n_replicas=4",
            "services.rollout.port=7000",
            "services.rollout.port_stride=0",
            "services.rollout.host=r-{i}",
        ),
        ("rollout.n_replicas=2", "services.rollout.port=50100", "services.reward.port=50102"),
        # what a rollout pod of the Helm chart loads: the ConfigMap's per-replica DNS name,
        # overridden by the pod's `services.rollout.host=0.0.0.0`; every pod has its own IP
        (
            "rollout.n_replicas=4",
            "services.rollout.host=r-{i}.r-headless",
            "services.rollout.port=50051",
            "services.rollout.metrics_port=9400",
            "services.rollout.port_stride=0",
            "services.buffer.host=b",
            "services.buffer.port=50051",
            "services.rollout.host=0.0.0.0",
        ),
    ]
    for overrides in ok:
        load_config(GRPO, overrides)


def test_kpop_binary_kl_loads_and_round_trips() -> None:
    cfg = load_config(
        GRPO, ["actor.rejection_sampling.metric=binary_kl", "actor.rejection_sampling.upper=0.5"]
    )
    assert cfg.actor.rejection_sampling.metric == "binary_kl"
    assert cfg.actor.rejection_sampling.upper == 0.5
    assert "metric: binary_kl" in to_yaml(cfg)


def test_decoupled_loss_makes_its_correction_and_prox_source_explicit() -> None:
    cfg = load_config(GRPO, ["actor.recompute_logprob=false", "actor.prox_logp_method=recompute"])
    # use_decoupled_loss implies a π_prox forward pass (AReaL does this silently);
    # Flywheel writes it into the resolved config, next to the explicit correction.
    assert cfg.actor.recompute_logprob is True
    assert cfg.actor.decoupled_correction == "behave_imp_weight"
    text = to_yaml(cfg)
    assert "recompute_logprob: true" in text
    assert "decoupled_correction: behave_imp_weight" in text
    # Approximated π_prox needs no forward pass, so nothing is switched on.
    cfg = load_config(GRPO, ["actor.recompute_logprob=false", "actor.prox_logp_method=loglinear"])
    assert cfg.actor.recompute_logprob is False
    # Dropping the correction is possible, but only when asked for.
    cfg = load_config(GRPO, ["actor.decoupled_correction=none"])
    assert cfg.actor.decoupled_correction == "none"


def test_clamp_defaults_its_lower_bound_to_zero() -> None:
    rs = RejectionSamplingConfig(action="clamp", upper=2.0)
    assert rs.lower == 0.0


def test_token_level_agg_warns() -> None:
    with pytest.warns(UserWarning, match="agg"):
        RejectionSamplingConfig(agg="max")


def test_rules_also_hold_when_models_are_built_in_code() -> None:
    with pytest.raises(ValueError, match="SAPO"):
        PPOActorConfig(use_sapo_loss=True, use_decoupled_loss=True)
    with pytest.raises(ValueError, match="behave_imp_weight_cap"):
        PPOActorConfig(behave_imp_weight_cap=5.0)


def test_several_errors_are_reported_together(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "actor:\n  kl_ctl: 0\n  eps_clip: -1\n  ppo_n_minibatches: 0\nrollout:\n  engine: vllm\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(info.value.paths) == [
        "actor.eps_clip",
        "actor.ppo_n_minibatches",
        "rollout.engine",
    ]
    assert "3 configuration errors" in str(info.value)
