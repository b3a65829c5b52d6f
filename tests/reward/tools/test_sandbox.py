"""Tool calls in worker processes (`services/reward/tools/sandbox.py` and `worker.py`):
deadline, memory limit, scrubbed environment, and the listener that counts calls."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from services.core.tool_events import set_tool_listener
from services.reward.tools.sandbox import SandboxConfig, ToolSandbox

pytestmark = pytest.mark.integration


@pytest.fixture
async def sandbox() -> AsyncIterator[ToolSandbox]:
    box = ToolSandbox(SandboxConfig(deadline_s=3.0, memory_bytes=512 << 20, num_workers=1))
    yield box
    await box.close()


async def test_calculator_and_python_answer_from_a_worker(sandbox: ToolSandbox) -> None:
    heard: list[tuple[str, str]] = []
    set_tool_listener(lambda tool, outcome, seconds: heard.append((tool, outcome)))
    product = await sandbox.call("calculator", {"expression": "847 * 63"})
    assert (product.ok, product.content) == (True, str(847 * 63))
    printed = await sandbox.call("python", {"code": "import os\nprint(os.getpid())\n6 * 7"})
    pid, value = printed.content.split()
    assert int(pid) != os.getpid() and value == "42"  # another process ran it
    bad = await sandbox.call("calculator", {"expression": "__import__('os')"})
    assert (bad.ok, bad.outcome) == (False, "error")
    assert "not arithmetic" in bad.content
    unknown = await sandbox.call("shell", {"cmd": "ls"})
    assert (unknown.ok, unknown.content) == (False, "unknown tool 'shell'")
    assert heard == [
        ("calculator", "ok"),
        ("python", "ok"),
        ("calculator", "error"),
        ("unknown", "error"),
    ]


async def test_a_tool_that_loops_forever_is_killed_at_its_deadline(sandbox: ToolSandbox) -> None:
    first = await sandbox.call("python", {"code": "import os\nprint(os.getpid())"})
    looping = await sandbox.call("python", {"code": "while True:\n    pass"}, deadline_s=0.5)
    assert (looping.ok, looping.outcome) == (False, "timeout")
    assert "timed out after 0.5 s" in looping.content
    with pytest.raises(ProcessLookupError):  # the looping worker is gone, not left spinning
        os.kill(int(first.content), 0)
    after = await sandbox.call("calculator", {"expression": "2 + 2"})
    assert (after.ok, after.content) == (True, "4")  # a fresh worker took its place


async def test_a_tool_that_allocates_too_much_fails_cleanly(sandbox: ToolSandbox) -> None:
    hog = await sandbox.call("python", {"code": "x = bytearray(2 << 30)"})
    assert (hog.ok, hog.outcome) == (False, "memory")
    assert "512 MiB" in hog.content
    after = await sandbox.call("python", {"code": "print(len(bytearray(1 << 20)))"})
    assert after.content.strip() == str(1 << 20)


async def test_the_tool_environment_holds_no_flywheel_credentials(
    sandbox: ToolSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_AUTH_TOKEN", "s3cret-token")
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret-redis")
    monkeypatch.setenv("FLYWHEEL_TOOL_VISIBLE", "plain")
    code = "import os\nprint(sorted(k for k in os.environ if 'FLYWHEEL' in k or 'REDIS' in k))"
    seen = await sandbox.call("python", {"code": code})
    assert "FLYWHEEL_AUTH_TOKEN" not in seen.content
    assert "REDIS_PASSWORD" not in seen.content
    assert "FLYWHEEL_TOOL_VISIBLE" in seen.content  # scrubbing is by name, not everything
