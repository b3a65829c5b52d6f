"""Generation engines: the `EngineBase` base class, the in-process torch engine and the
SGLang client. Import engines from their modules (`torch_engine` pulls in torch)."""

from services.rollout.engine.base import EngineBase, EngineStats

__all__ = ["EngineStats", "EngineBase"]
