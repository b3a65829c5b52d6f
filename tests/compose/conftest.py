"""The compose tests need root, a Docker engine and minutes: they run only when selected
(`make test-compose`, i.e. `pytest tests/compose -m compose`), never in a plain `make test`."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr", "") or ""
    if "compose" in markexpr and "not compose" not in markexpr:
        return
    skip = pytest.mark.skip(reason="a real Docker engine stack: run `make test-compose`")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)
