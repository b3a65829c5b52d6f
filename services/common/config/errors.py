"""`ConfigError`: every configuration problem, with the field path, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: where (dotted path), what was given, and what to do."""

    path: str
    """Dotted field path, e.g. `actor.rejection_sampling.upper` (empty for the file)."""

    value: Any
    """The offending value as given (or `<missing>`)."""

    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        where = self.path or "<config>"
        return f"{where} = {self.value!r}: {self.message}"


class ConfigError(ValueError):
    """Raised by `load_config` for any invalid file, override or value."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue | str):
        if isinstance(issues, str):
            issues = [ConfigIssue("", "<config>", issues)]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        lines = [str(i) for i in self.issues]
        head = "invalid configuration" if len(lines) == 1 else f"{len(lines)} configuration errors"
        super().__init__(head + ":\n  " + "\n  ".join(lines))

    @property
    def paths(self) -> list[str]:
        """Field paths of all issues (handy in tests and tooling)."""
        return [i.path for i in self.issues]
