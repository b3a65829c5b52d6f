"""Generation engines: the `InferenceEngine` contract, the in-process torch engine and the
SGLang client. Import engines from their modules (`torch_engine` pulls in torch)."""

from services.rollout.engine.base import EngineStats, InferenceEngine

__all__ = ["EngineStats", "InferenceEngine"]
