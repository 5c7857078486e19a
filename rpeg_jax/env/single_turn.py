"""`env.name=single_turn` (the default): today's behaviour as an environment. One assistant turn, then
done, rewarded by the run's reward function (data.reward) on exactly the Sample the reward stage
scores (tests/test_env_episodes.py checks the rewards are equal on the same completions). The prompt
is the record's own (its prompt_tokens as the data pipeline rendered them); no observation is ever
appended. DAPO's soft overlong penalty (rl.overlong) stays in the reward stage, as today."""

from __future__ import annotations

from typing import Any

from rpeg_jax.env.base import Environment, Episode, StepResult, Turn


class SingleTurnEpisode(Episode):
    def __init__(self, record: dict[str, Any], env: "SingleTurn"):
        super().__init__(record, env.prompt_messages(record))
        self.env = env

    def respond(self, turn: Turn) -> StepResult:
        reward, errors = self.env.reward(self.record, turn)
        self.stats.reward_errors += errors
        self.stats.truncated = turn.end == "length"
        return StepResult(reward=reward, done=True)


class SingleTurn(Environment):
    def start(self, record: dict[str, Any]) -> Episode:
        return SingleTurnEpisode(record, self)
