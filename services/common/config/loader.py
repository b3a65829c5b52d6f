"""Read a YAML file, apply command-line overrides, resolve `${...}`, validate.

Order matters and matches what AReaL (Hydra/OmegaConf) users expect: overrides are
applied to the raw tree first, interpolation is resolved afterwards (so
`gconfig.n_samples=8` also changes every `${gconfig.n_samples}`), and the pydantic
models validate last. Every failure is a `ConfigError` naming the dotted field path,
the bad value and the fix.

A file written for AReaL (recognised by keys only AReaL has, or named so with
`source="areal"`) is translated after interpolation (`areal_compat.translate`), and data
sets named by a Hugging Face id are resolved to their local copy (`dataset`);
`load_with_report` returns what was done next to the config, for the dry-run to print.

A service loads with its name (`service="reward"`): the config is then checked only as far
as that service reads it (`root.SERVICE_BLOCKS`); what it does not read is left unchecked
and reported, so that a reward service starts from a file whose trainer part is still wrong.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from . import areal_compat
from ._base import FlywheelModel, RuleViolation, redact_secrets
from .areal_compat import Translation
from .areal_vision import translate_vision, tree_get, vision_problems, vision_sft_text
from .dataset import is_hub_id, resolve_hub_dataset, reward_for
from .errors import ConfigError, ConfigIssue
from .interpolation import resolve_interpolations
from .key_hints import field_description, unknown_key_issue
from .overrides import MISSING, apply_override
from .root import SERVICE_BLOCKS, FlywheelConfig
from .schema import _child, _is_dict, _is_list, _is_model, _unwrap, flywheel_fields


def _clean_loc(loc: Sequence[Any]) -> list[str]:
    """The field path of a pydantic error location, without union-branch tags."""
    out: list[str] = []
    ann: Any = FlywheelConfig
    last = len(loc) - 1
    for index, item in enumerate(loc):
        key = str(item)
        cur = _unwrap(ann)
        if _is_model(cur):
            if key in cur.model_fields:
                out.append(key)
                ann = cur.model_fields[key].annotation
            elif index == last:
                out.append(key)  # an unknown key (extra_forbidden)
        elif _is_dict(cur) or _is_list(cur) or cur is Any:
            out.append(key)
            ann = Any if cur is Any else _child(cur, key)
        # otherwise `key` is the tag of a union branch of a scalar field: skip it
    return out


def _issues(error: ValidationError) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    seen: dict[str, int] = {}
    for err in error.errors(include_url=False):
        path = _clean_loc(err["loc"])
        dotted = ".".join(path)
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, RuleViolation):
            # Field validators are located at the field itself; model validators at
            # their model, with the field relative to it (root rules: a full path).
            if path and path[-1] == cause.field:
                full = dotted
            else:
                full = f"{dotted}.{cause.field}" if dotted else cause.field
            issue = ConfigIssue(full, cause.value, cause.message)
        elif err["type"] == "extra_forbidden":
            parent_ann: Any = FlywheelConfig
            for key in path[:-1]:
                parent_ann = _child(parent_ann, key)
            parent = _unwrap(parent_ann)
            prefix = ".".join(path[:-1]) + ("." if len(path) > 1 else "")
            issue = (
                unknown_key_issue(parent, path[-1], prefix, err["input"])
                if _is_model(parent)
                else ConfigIssue(dotted, err["input"], "unknown key")
            )
        else:
            desc = field_description(path)
            message = err["msg"].removeprefix("Value error, ")
            if desc:
                message += f" (the field: {desc})"
            issue = ConfigIssue(dotted, err.get("input", MISSING), message)
        if issue.path in seen:  # union branches report the same field twice
            prev = issues[seen[issue.path]]
            if issue.message not in prev.message:
                issues[seen[issue.path]] = ConfigIssue(
                    prev.path, prev.value, f"{prev.message}; or {issue.message}"
                )
            continue
        seen[issue.path] = len(issues)
        issues.append(issue)
    return issues


_BLOCKS = frozenset(
    name for name, f in FlywheelConfig.model_fields.items() if _is_model(_unwrap(f.annotation))
)


def _concerns(issue: ConfigIssue, service: str | None) -> bool:
    """Whether `issue` stops `service` (None: the whole experiment): it lies in a block the
    service reads, or outside every block (root keys such as `experiment_name`)."""
    if service is None:
        return True
    block = issue.path.split(".", 1)[0]
    return block not in _BLOCKS or block in SERVICE_BLOCKS[service]


def validate_for(
    raw: dict[str, Any], service: str | None = None
) -> tuple[FlywheelConfig, list[ConfigIssue]]:
    """Validate a resolved raw tree as `service` reads it (None: all of it), and return the
    problems that stop the whole experiment but not that service (the trainer's rules, a
    block the service does not read). An invalid block the service does not read is left
    at its defaults in the returned config; every other problem is a ConfigError."""
    if service is not None and service not in SERVICE_BLOCKS:
        raise ConfigError(
            ConfigIssue("", service, f"unknown service; use one of {', '.join(SERVICE_BLOCKS)}")
        )
    try:
        return FlywheelConfig.model_validate(raw), []
    except ValidationError as exc:
        everything = _issues(exc)
    if service is None:
        raise ConfigError(everything)
    context = {"service": service}
    try:
        return FlywheelConfig.model_validate(raw, context=context), everything
    except ValidationError as exc:
        issues = _issues(exc)
    own = [i for i in issues if _concerns(i, service)]
    if own:
        raise ConfigError(own)
    unread = {i.path.split(".", 1)[0] for i in issues}
    kept = {key: value for key, value in raw.items() if key not in unread}
    try:
        return FlywheelConfig.model_validate(kept, context=context), everything
    except ValidationError as exc:
        raise ConfigError(_issues(exc)) from None


def validate(raw: dict[str, Any]) -> FlywheelConfig:
    """Validate a resolved raw tree into a `FlywheelConfig` (ConfigError on failure)."""
    return validate_for(raw)[0]


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML mapping stored at `path` (an empty file is an empty mapping)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            ConfigIssue("", str(file), f"cannot read the config file: {exc.strerror}")
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            ConfigIssue("", str(file), f"not valid YAML{where}: {getattr(exc, 'problem', exc)}")
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            ConfigIssue(
                "", str(file), f"the top level must be a mapping, got {type(data).__name__}"
            )
        )
    return data


def load_raw(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The resolved raw tree (file + overrides + interpolation), before validation."""
    raw = read_yaml(path) if path is not None else {}
    for override in overrides:
        apply_override(raw, override)
    return resolve_interpolations(raw)


@dataclass
class LoadReport:
    """What loading did besides validating: the source format, AReaL's keys and their
    translation, and the data sets and reward chosen for them."""

    source: str = "flywheel"
    """`flywheel` or `areal` (how the file was read)."""

    markers: list[str] = dataclass_field(default_factory=list)
    """The AReaL-only keys that identified the file as an AReaL config."""

    translations: list[Translation] = dataclass_field(default_factory=list)
    """One row per AReaL key: mapped to Flywheel keys, or ignored with the reason."""

    data: list[Translation] = dataclass_field(default_factory=list)
    """Data set ids resolved to local copies (or not found), rewards that follow."""

    service: str | None = None
    """The service the config was loaded for (None: the whole experiment)."""

    unchecked: list[ConfigIssue] = dataclass_field(default_factory=list)
    """Problems that do not concern `service` (the trainer's rules, blocks it does not
    read): not fatal for it, fatal for the trainer and `flywheel run`."""

    @property
    def warnings(self) -> list[str]:
        """One line per ignored key, missing data set or unread invalid block, each naming
        the key."""
        return [
            f"{r.key}: {r.action}: {r.flywheel}"
            for r in (*self.translations, *self.data)
            if r.action in (areal_compat.IGNORED, "missing")
        ] + self.unchecked_lines()

    def unchecked_lines(self) -> list[str]:
        """One line per problem left unchecked for `service`, naming the key."""
        return [
            f"{i.path}: not checked for the {self.service} service, which does not use it "
            f"(the trainer refuses it): {i.message}"
            for i in self.unchecked
        ]

    def lines(self) -> list[str]:
        """The report as text: the translation table, then data sets and reward."""
        out: list[str] = []
        if self.source == "areal":
            why = ", ".join(self.markers[:6]) + (", ..." if len(self.markers) > 6 else "")
            out.append(
                "read as an AReaL config"
                + (f" (AReaL-only keys: {why})" if why else " (--from areal)")
            )
            mapped = sum(r.action == areal_compat.MAPPED for r in self.translations)
            ignored = len(self.translations) - mapped
            out.append(
                f"{mapped} AReaL keys mapped, {ignored} ignored; all other keys have the "
                "same meaning in Flywheel and are kept"
            )
            out += areal_compat.format_table(self.translations)
        for r in self.data:
            out.append(f"{r.key} = {r.value}: {r.action}: {r.flywheel}")
        return out


_SOURCES = ("auto", "areal", "flywheel")


def load_with_report(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    *,
    source: str = "auto",
    require_data: bool = True,
    service: str | None = None,
) -> tuple[FlywheelConfig, LoadReport]:
    """Load like `load_config` and say what was translated and resolved.

    `source`: `auto` reads a file with AReaL-only keys as AReaL's, `areal` always
    translates, `flywheel` never does. With `require_data`, a data set id without a local
    copy is a `ConfigError` carrying the fetch command; without it (the dry-run), a
    warning in the report. `service`: check only what that service reads (see
    `validate_for`); None checks the whole experiment.
    """
    if source not in _SOURCES:
        raise ConfigError(
            ConfigIssue("", source, f"unknown config source; use one of {', '.join(_SOURCES)}")
        )
    raw = read_yaml(path) if path is not None else {}
    report = LoadReport(markers=areal_compat.areal_markers(raw))
    report.source = ("areal" if report.markers else "flywheel") if source == "auto" else source
    if report.source == "areal":
        later = [o for o in overrides if _flywheel_only_override(o)]
        for override in overrides:
            if override not in later:
                apply_override(raw, override, check=False)
        tree, report.translations = areal_compat.translate(resolve_interpolations(raw))
        vision = translate_vision(tree)
        if vision is not None:  # AReaL's VLM examples pick their workflow in Python
            key, text = vision
            report.translations.append(Translation(key, tree_get(tree, key), "mapped", text))
            report.translations = [
                replace(r, flywheel=vision_sft_text(r.value))
                if r.key == "train_dataset.type"
                else r
                for r in report.translations
            ]
        for override in later:
            apply_override(tree, override)
        tree = resolve_interpolations(tree)
    else:
        tree = _apply_all(raw, overrides)
    problems = [p for p in _resolve_data(tree, report) if _concerns(p, service)]
    config, report.unchecked = validate_for(tree, service)
    refused = [p for p in vision_problems(tree) if _concerns(p, service)]
    if refused:  # images would be dropped (or asked of a text model): never a warning
        raise ConfigError(refused)
    report.service = service
    if problems and require_data:
        raise ConfigError(problems)
    return config, report


def _apply_all(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for override in overrides:
        apply_override(raw, override)
    return resolve_interpolations(raw)


def _flywheel_only_override(override: str) -> bool:
    """An override of an AReaL file that names a Flywheel-only key (`trainer.n_ranks=2`):
    applied after the translation, so that it wins over what the translation set."""
    key = override.strip().lstrip("+~").partition("=")[0].strip()
    parts = key.split(".")
    root = areal_compat.AREAL_FIELDS[""]
    if parts[0] not in root:
        return parts[0] in (flywheel_fields("") or set())
    if len(parts) > 1 and parts[0] in areal_compat.AREAL_FIELDS:
        block = flywheel_fields(parts[0]) or set()
        return parts[1] not in areal_compat.AREAL_FIELDS[parts[0]] and parts[1] in block
    return False


def _resolve_data(tree: dict[str, Any], report: LoadReport) -> list[ConfigIssue]:
    """Point data set ids at their local copies; pick the reward of a known data set."""
    problems: list[ConfigIssue] = []
    named: str | None = None
    for block, default_split in (("train_dataset", "train"), ("valid_dataset", "test")):
        ds = tree.get(block)
        if not isinstance(ds, dict) or not isinstance(ds.get("path"), str):
            continue
        hub_id = ds["path"]
        if block == "train_dataset":
            named = hub_id
        if not is_hub_id(hub_id):
            continue
        split = ds.get("split") or default_split
        found = resolve_hub_dataset(hub_id, split)
        key = f"{block}.path"
        shown = f"{hub_id} (split {split})"
        if found.local is not None:
            ds["path"] = str(found.local)
            report.data.append(Translation(key, shown, "resolved", f"local copy {found.local}"))
        else:
            report.data.append(Translation(key, shown, "missing", found.problem))
            problems.append(ConfigIssue(key, hub_id, found.problem))
    reward = tree.get("reward")
    if named and not (isinstance(reward, dict) and "fn" in reward):
        fn = reward_for(named)
        if fn is not None:
            tree.setdefault("reward", {})
            if isinstance(tree["reward"], dict):
                tree["reward"]["fn"] = fn
                report.data.append(
                    Translation(
                        "reward.fn",
                        fn,
                        "chosen",
                        f"the reward of the data set {named} "
                        "(as AReaL's examples pair them); set reward.fn to change it",
                    )
                )
    return problems


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    *,
    source: str = "auto",
    service: str | None = None,
) -> FlywheelConfig:
    """Load `path` (or only defaults when None), apply `overrides`, resolve, validate.
    An AReaL file is translated (see `load_with_report`). A service passes its name
    (`reward`, `buffer`, `rollout`) to be checked only on the blocks it reads; what it
    leaves unchecked is logged as a warning."""
    config, report = load_with_report(path, overrides, source=source, service=service)
    for line in report.unchecked_lines():
        logging.getLogger(f"flywheel.{service}").warning("config: %s", line)
    return config


def to_yaml(config: FlywheelModel, *, redact: bool = True) -> str:
    """The config as YAML in field order; every credential (the tokens, the Redis password:
    fields marked `SECRET`) is masked unless `redact=False`."""
    data = config.model_dump(mode="json")
    if redact:
        data = redact_secrets(config, data)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
