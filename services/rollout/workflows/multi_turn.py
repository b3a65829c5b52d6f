"""Multi-turn: the model answers, is told when it is wrong, and retries up to `max_turns`.

Each sample is one episode. After an answer scored below `success_threshold`, a feedback
message is appended (not trained on: loss_mask 0) and the model answers again. Every turn
is scored, and the per-turn rewards r_0..r_{T-1} are propagated backwards with AReaL's
`turn_discount` walk (`services.core.turn_discount.discount_turn_rewards`, AReaL's
`apply_reward_discount` in areal/experimental/openai/cache.py): from the last turn to the
first, cur = cur * turn_discount + r_i, so turn i is worth
G_i = r_i + γ r_{i+1} + ... + γ^{T-1-i} r_{T-1}. The episode's reward is G_0, the return
seen from its first turn; all G_i are in `metadata["turn_rewards"]` (JSON). When the
failed turns score 0 (a 0/1 reward), G_0 = γ^{T-1} r_{T-1}: AReaL's `MultiTurnWorkflow`
(areal/workflow/multi_turn.py), where an answer right at the first try is worth more than
one found after feedback. `turn_ids` marks the tokens of assistant turn t with t and
everything else with -1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from services.core.contracts import InferenceEngine, WorkflowContext
from services.core.turn_discount import discount_turn_rewards
from services.core.types import SamplingParams, ScoreRequest, Trajectory, TrajectoryGroup
from services.rollout.workflows.base import build_trajectory, make_group, reward_kwargs

DEFAULT_FEEDBACK = "Your answer is either wrong or not parsable. Please try again.\n"


class MultiTurnWorkflow:
    def __init__(
        self,
        ctx: WorkflowContext,
        *,
        max_turns: int = 2,
        turn_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        success_threshold: float = 1.0,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"multi_turn max_turns={max_turns}: must be >= 1")
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"multi_turn turn_discount={turn_discount}: must be in [0, 1]")
        self.ctx = ctx
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.success_threshold = success_threshold
        self._feedback_ids: list[int] | None = None

    def _feedback_tokens(self) -> list[int]:
        """Token ids inserted after a wrong answer: the feedback as a user turn (chat template)
        followed by the generation prompt, or the plain text for template-less tokenizers."""
        if self._feedback_ids is not None:
            return self._feedback_ids
        tok = self.ctx.tokenizer
        if getattr(tok, "chat_template", None):
            base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
            with_fb = [*base, {"role": "user", "content": self.feedback}]
            a = tok.apply_chat_template(base, tokenize=False)
            b = tok.apply_chat_template(with_fb, tokenize=False, add_generation_prompt=True)
            text = b[len(a) :] if b.startswith(a) else self.feedback
        else:
            text = self.feedback
        self._feedback_ids = list(tok(text, add_special_tokens=False)["input_ids"])
        return self._feedback_ids

    async def _episode(
        self, engine: InferenceEngine, data: dict[str, Any], sampling: SamplingParams
    ) -> Trajectory | None:
        prompt_ids = list(data["prompt_ids"])
        context = list(prompt_ids)
        pieces: list[tuple[list[int], list[float], list[int], int]] = []
        kwargs = reward_kwargs(data)
        reward, status, stop_reason, message = 0.0, "OK", "stop", ""
        turn_rewards: list[float] = []
        turns_used = 0
        for turn in range(self.max_turns):
            c = await engine.agenerate(context, sampling)
            turns_used = turn + 1
            pieces.append((c.output_ids, c.logprobs, c.versions, turn))
            context.extend(c.output_ids)
            stop_reason = c.stop_reason
            (score,) = await self.ctx.scorer.score(
                [
                    ScoreRequest(
                        completion=c.text,
                        answer=str(data.get("answer", "")),
                        prompt=str(data.get("prompt_text", "")),
                        prompt_ids=prompt_ids,
                        completion_ids=c.output_ids,
                        kwargs=kwargs,
                    )
                ]
            )
            if not score.ok:
                self.ctx.on_reward_failure(score.status)
                if self.ctx.on_failure == "drop_group":
                    return None
            reward, status, message = (
                (score.reward if score.ok else 0.0),
                score.status,
                score.message,
            )
            turn_rewards.append(reward)
            if reward >= self.success_threshold or turn == self.max_turns - 1:
                break
            if c.stop_reason == "abort":
                break
            fb = self._feedback_tokens()
            pieces.append((fb, [], [], -1))
            context.extend(fb)
        returns = discount_turn_rewards(turn_rewards, self.turn_discount)
        meta = {
            "reward_status": status,
            "turns": str(turns_used),
            "turn_rewards": json.dumps(returns),
        }
        if message:
            meta["reward_error"] = message
        return build_trajectory(
            prompt_ids,
            pieces,
            reward=returns[0] if returns else 0.0,
            stop_reason=stop_reason,
            metadata=meta,
            multi_turn=True,
        )

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None:
        base = self.ctx.sampling
        samples = []
        for i in range(base.n_samples):
            seed = None if base.seed is None else base.seed + 1000 * i
            samples.append(SamplingParams(**{**base.__dict__, "n_samples": 1, "seed": seed}))
        results = await asyncio.gather(*(self._episode(engine, data, s) for s in samples))
        if any(r is None for r in results):
            return None
        return make_group([r for r in results if r is not None], data)
