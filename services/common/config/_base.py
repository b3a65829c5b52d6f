"""Shared base of every configuration block and the error type of its rules.

Every block forbids unknown keys (a typo must fail at load, not be ignored at step 300)
and takes the docstring written under each field as that field's description, so error
messages and tooling can show it. Cross-field rules raise `RuleViolation`, which carries
the field, the bad value and the fix; the loader turns it into a `ConfigIssue` with the
full dotted path.
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict


class RuleViolation(ValueError):
    """A broken configuration rule: `field` (relative to the model that checks it, or a
    full dotted path for root rules), the offending `value`, and a `message` that says
    what is wrong and how to fix it."""

    def __init__(self, field: str, value: Any, message: str):
        self.field = field
        self.value = value
        self.message = message
        super().__init__(f"{field} = {value!r}: {message}")


class FlywheelModel(BaseModel):
    """Base class of all Flywheel configuration models."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    legacy_keys: ClassVar[dict[str, str]] = {}
    """Keys this block used to have (here or in AReaL), mapped to the migration text shown
    when a file still uses them."""


SECRET: dict[str, Any] = {"secret": True}
"""`json_schema_extra` of a field that holds a credential: `redact_secrets` masks it in every
dump (`to_yaml`, `--dry-run`, logs)."""

SECRET_IN_URL: dict[str, Any] = {"secret_in_url": True}
"""`json_schema_extra` of a URL field that may carry a password (`redis://:pw@host/0`):
`redact_secrets` masks the password and keeps the rest of the URL."""

REDACTED = "***"


def masked_url(url: str) -> str:
    """`url` with the password of its user info replaced by `REDACTED`
    (`redis://user:pw@host:6379/0` -> `redis://user:***@host:6379/0`); a URL without a
    password, or a string that is no URL, comes back unchanged."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL (an unbalanced `[`, a bad port): nothing to mask
        return url
    if password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:{REDACTED}@{host}"))


def redact_secrets(model: BaseModel, data: Any) -> Any:
    """`data` (a `model_dump` of `model`) with every set credential field replaced by
    `REDACTED` (a mapping of credentials keeps its keys, each value masked)."""
    if not isinstance(data, dict):
        return data
    for name, info in type(model).model_fields.items():
        if name not in data:
            continue
        extra = info.json_schema_extra
        if isinstance(extra, dict) and extra.get("secret_in_url"):
            if isinstance(data[name], str):
                data[name] = masked_url(data[name])
            continue
        if isinstance(extra, dict) and extra.get("secret"):
            value = data[name]
            if isinstance(value, dict):
                data[name] = {k: REDACTED for k in value}
            elif value:
                data[name] = REDACTED
            continue
        child = getattr(model, name, None)
        if isinstance(child, BaseModel):
            data[name] = redact_secrets(child, data[name])
        elif isinstance(child, list | tuple) and isinstance(data[name], list):
            data[name] = [
                redact_secrets(c, d) if isinstance(c, BaseModel) else d
                for c, d in zip(child, data[name], strict=False)
            ]
        elif isinstance(child, dict) and isinstance(data[name], dict):
            data[name] = {
                k: redact_secrets(child[k], v) if isinstance(child.get(k), BaseModel) else v
                for k, v in data[name].items()
            }
    return data
