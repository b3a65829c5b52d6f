"""A rollout replica beside an SGLang server started with `--api-key` (as the Helm chart
starts it): the client sends `$SGLANG_API_KEY` as a bearer token on every call.
The stand-in is wrapped in the check SGLang makes: every path but /health wants
`Authorization: Bearer <key>`, else 401."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core.types import SamplingParams
from services.rollout.engine.sglang_engine import SGLangEngine
from tests.rollout.engine.test_torch_engine import PROMPTS
from tests.rollout.sglang_standin import SGLangStandIn

pytestmark = pytest.mark.integration

KEY = "k-0123456789"


@pytest.fixture
def keyed_standin(tiny_model_dir: Path) -> Iterator[tuple[SGLangStandIn, list[str]]]:
    from starlette.responses import JSONResponse

    s = SGLangStandIn(tiny_model_dir)
    refused: list[str] = []
    app = s._server.config.app

    @app.middleware("http")
    async def api_key(request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path.startswith("/health"):
            return await call_next(request)
        if request.headers.get("authorization") != f"Bearer {KEY}":
            refused.append(request.url.path)
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    s.start()
    try:
        yield s, refused
    finally:
        s.stop()


async def test_the_client_sends_the_api_key(
    keyed_standin: tuple[SGLangStandIn, list[str]],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standin, refused = keyed_standin
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await eng.start()
    try:
        c = await eng.agenerate(PROMPTS[0], SamplingParams(greedy=True, max_new_tokens=4))
    finally:
        await eng.stop()
    assert len(c.output_ids) == 4
    assert refused == []
    assert "/generate" in standin.paths()


async def test_without_the_key_the_server_refuses(
    keyed_standin: tuple[SGLangStandIn, list[str]],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standin, refused = keyed_standin
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    with pytest.raises(Exception):  # noqa: B017 - whichever call comes first is refused
        await eng.start()
        await eng.agenerate(PROMPTS[0], SamplingParams(greedy=True, max_new_tokens=4))
    await eng.stop()
    assert refused  # the stand-in really checks
