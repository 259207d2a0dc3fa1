"""Infrastructure failures are not rewards: left out of scoring, baselines and the loss; counted."""

from __future__ import annotations

import dataclasses
import logging
import math

import anyio
import torch
from datasets import Dataset

from agentgrpo.learner.advantages import group_advantages
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.reporting.metrics import RewardLayout, episode_stats, round_metrics
from agentgrpo.rewards.calls import RewardFunction
from agentgrpo.rounds.dynamic_sampling import informative_groups
from agentgrpo.rounds.pipeline import RewardShaping
from agentgrpo.rounds.scoring import Scorer, warn_if_unscored
from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine
from tests.support.episodes import COUNTER_ROW, COUNTER_TURNS, scripted_backend
from tests.support.trainer import logged, rank_in_call, short_run_config, tiny_trainer
from tools import InfrastructureError


class Down(Counter):
    """Counter whose sandbox never comes up on rows marked `down` (every row by default)."""

    def reset(self, target: int = 7, down: bool = True) -> str:
        """Reset, unless the row's sandbox is down."""
        if down:
            raise InfrastructureError("the sandbox is down")
        return super().reset(target)


def play(tokenizer, factory, num_generations: int, infra_retries: int = 2):
    engine = RolloutEngine(
        scripted_backend(tokenizer, COUNTER_TURNS),
        tokenizer,
        environment_factory=factory,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
        infra_retries=infra_retries,
    )
    return anyio.run(engine.run, [COUNTER_ROW], num_generations)


def group_with_a_failure(tokenizer):
    """A group of 4: three clean Counter plays, and at index 1 one kept as an infra failure."""
    clean = play(tokenizer, Counter, 3)
    [failed] = play(tokenizer, Down, 1, infra_retries=1)
    members = [clean[0], failed, clean[1], clean[2]]
    return [dataclasses.replace(e, group=0, index=k) for k, e in enumerate(members)]


class Ranked:
    """A reward function that records how many completions it saw, and logs a column."""

    def __init__(self):
        self.seen: list[int] = []

    def __call__(self, completions, log_extra, **kwargs) -> list[float]:
        self.seen.append(len(completions))
        log_extra("note", [f"seen {k}" for k in range(len(completions))])
        return [[1.0, 0.0, 2.0, 3.0][k] for k in range(len(completions))]


def scorer_of(reward: Ranked, tokenizer) -> Scorer:
    return Scorer(
        funcs=[RewardFunction("ranked", reward)],
        env_reward_classes=(),
        with_environments=True,
        text_completions=False,
        decode=tokenizer.decode,
        trainer_state=lambda: None,
    )


def test_an_infra_failure_is_never_scored_and_leaves_its_groups_advantages_as_without_it(
    tokenizer, caplog
):
    episodes = group_with_a_failure(tokenizer)
    assert [e.finish for e in episodes].count(Finish.INFRA) == 1
    reward = Ranked()
    scorer = scorer_of(reward, tokenizer)
    rewards_N_F = anyio.run(scorer.score_group, episodes)
    assert reward.seen == [3]  # the reward function never saw the failed episode
    assert math.isnan(rewards_N_F[1, 0]) and rewards_N_F[[0, 2, 3], 0].tolist() == [1, 0, 2]
    assert scorer.logs.take_extra(1, 4) == {"note": ["seen 0", None, "seen 1", "seen 2"]}
    with caplog.at_level(logging.WARNING, logger="agentgrpo.rounds.scoring"):
        warn_if_unscored(episodes, rewards_N_F, scorer)
    # An infra failure is not an episode whose reward functions all returned None.
    assert not [r for r in caplog.records if r.name == "agentgrpo.rounds.scoring"]

    shaping = RewardShaping()
    rewards_N = shaping.combine(rewards_N_F, 4)
    advantages_N = shaping.advantages(rewards_N, 4)
    without_it = group_advantages(torch.tensor([1.0, 0.0, 2.0]), 3)
    assert advantages_N[1] == 0.0
    assert torch.allclose(advantages_N[[0, 2, 3]], without_it)

    batch = collate_episodes(episodes, advantages_N, tokenizer.pad_token_id)
    assert batch.loss_mask_B_C[batch.episode_B == 1].sum() == 0  # nothing of it is trained
    assert batch.loss_mask_B_C[batch.episode_B != 1].sum() > 0

    metrics = round_metrics(
        episode_stats(episodes), rewards_N_F, rewards_N, RewardLayout(["ranked"], [1.0], 4)
    )
    assert metrics["episodes/infra_failures"] == 1.0
    assert metrics["episodes/infra_retries"] == 1.0  # its one replay; the clean plays had none
    assert metrics["reward"] == 1.0  # the mean of the scored episodes only


def test_a_group_of_infra_failures_calls_no_reward_and_is_uninformative(tokenizer):
    episodes = play(tokenizer, Down, 2, infra_retries=0)
    reward = Ranked()
    rewards_N_F = anyio.run(scorer_of(reward, tokenizer).score_group, episodes)
    assert reward.seen == [] and rewards_N_F.isnan().all()
    rewards_N = RewardShaping().combine(rewards_N_F, 2)
    assert informative_groups(rewards_N, 2).tolist() == [False]  # dynamic sampling replaces it
    one_scored = torch.tensor([1.0, math.nan, math.nan, math.nan])
    assert informative_groups(one_scored, 4).tolist() == [False]


def test_a_training_step_with_a_group_of_infra_failures_trains_on_the_rest(tokenizer, tmp_path):
    rows = Dataset.from_list(
        [{"prompt": "Make the counter reach 3.", "target": 3, "down": down} for down in (0, 1)]
    )
    args = short_run_config(tmp_path, max_steps=1, num_generations=2, chat_template="chatml_tools")
    trainer = tiny_trainer(tokenizer, rank_in_call, args, rows, environment_factory=Down)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert logged(trainer, "episodes/infra_failures") == [2.0]  # the down row's group
    assert logged(trainer, "episodes/infra_retries") == [4.0]  # 2 replays of each (default)
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    after = list(trainer.model.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
