"""The API as a rollout replica serves it (services/rollout/openai_api/replica.py): a real
`RolloutService` with a configured bearer token answers the official `openai` client on its
HTTP port, refuses a wrong token, keeps the probes open, and shares its session store."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from services.common.config import FlywheelConfig
from services.rollout.openai_api.replica import served_model_names
from services.rollout.openai_api.sessions import export_individual
from services.rollout.service import RolloutService

pytestmark = pytest.mark.integration


async def test_a_replica_serves_the_api_behind_its_token(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv("FLYWHEEL_CREDENTIALS", raising=False)
    cfg = FlywheelConfig.model_validate(
        {
            "actor": {"path": str(tiny_model_dir)},
            "gconfig": {"max_new_tokens": 4},
            "rollout": {"torch_device": "cpu", "torch_max_batch_size": 2},
            "services": {
                "rollout": {"port": 0, "metrics_port": 0, "host": "127.0.0.1"},
                "auth_token": "replica-secret",
                "credentials": {},
            },
        }
    )
    replica = RolloutService(cfg, eval_only=True)
    await replica.start()
    try:
        assert replica.http is not None
        url = f"http://127.0.0.1:{replica.http.port}"
        session = replica.sessions.open()
        async with openai.AsyncOpenAI(
            api_key="replica-secret", base_url=f"{url}/sessions/{session.id}/v1", max_retries=0
        ) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == served_model_names(str(tiny_model_dir))
            r = await client.chat.completions.create(
                model="model", messages=[{"role": "user", "content": "1+1="}], seed=1
            )
        (call,) = session.calls
        assert r.usage.completion_tokens == len(call.output_ids) <= 4  # gconfig.max_new_tokens
        (traj,) = export_individual(session, reward=1.0, group_id="g")
        assert traj.input_ids.tolist() == call.prompt_ids + call.output_ids
        async with openai.AsyncOpenAI(
            api_key="wrong", base_url=f"{url}/v1", max_retries=0
        ) as intruder:
            with pytest.raises(openai.AuthenticationError):
                await intruder.models.list()
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/healthz")).status_code == 200
            assert (await http.post(f"{url}/sessions")).status_code == 401
        assert (
            replica.metrics.registry.get_sample_value(
                "flywheel_rollout_openai_requests_total", {"endpoint": "chat", "status": "200"}
            )
            == 1.0
        )
    finally:
        await replica.stop()
