"""Shared base of every configuration block.

Every block forbids unknown keys (a typo must fail at load, not be ignored at step 300),
takes the docstring written under each field as that field's description (so `--help`
style tooling and error messages can show it), and re-validates on attribute
assignment so a config mutated in code cannot drift out of its own rules.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FlywheelModel(BaseModel):
    """Base class of all Flywheel configuration models."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )
