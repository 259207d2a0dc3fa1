"""Credit per turn through a round and a training step: turn rewards reach the loss per token."""

from __future__ import annotations

from functools import partial

import anyio
import pytest
import torch

from agentgrpo import GRPOConfig
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.rewards.calls import reward_functions
from agentgrpo.rounds.pipeline import RewardShaping, RoundParts, RoundPlan, play_and_batch
from agentgrpo.rounds.scoring import play_round
from agentgrpo.rounds.wiring import build_parts
from tests.support.episodes import scripted_backend, tool_call
from tests.support.trainer import logged, rank_in_call, short_run_config, tiny_trainer


class Steps:
    """Two `step` calls then an answer; the first step earns 1 when asked for a 'good' row."""

    def reset(self, good: bool = False, **row):
        self.good, self.calls = good, 0

    def step(self) -> str:
        """Take a step.

        Returns:
            Which step it was.
        """
        self.calls += 1
        return str(self.calls)

    def turn_reward(self) -> float | None:
        return 1.0 if self.good and self.calls == 1 else None

    def reward(self) -> float:
        return 1.0


def config(tmp_path, **fields) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
        num_generations=2, max_completion_length=256, chat_template="chatml_tools",
        scale_rewards="none", **fields,
    )  # fmt: skip


def test_a_round_gives_each_turn_its_return_against_the_same_turn_of_the_group(tmp_path, tokenizer):
    args = config(tmp_path, turn_advantage="return")
    backend = scripted_backend(tokenizer, [tool_call("step"), tool_call("step"), "Done."])
    run = build_parts(args, backend, tokenizer, Steps, (), reward_functions([]))
    parts = RoundParts(
        play=lambda rows, g, seed: anyio.run(play_round, run.engine, rows, g, seed, run.scorer),
        shaping=RewardShaping.from_config(args),
        collate=partial(collate_episodes, pad_token_id=tokenizer.pad_token_id),
        old_logprobs=lambda batch: batch.sampler_logprobs_B_C,
    )
    plan = RoundPlan.from_config(args, num_processes=1)
    # One group of two: the first member's row is 'good' (its first step earns 1).
    rows = [{"prompt": "Take two steps.", "good": True}]
    round_ = play_and_batch(parts, plan, rows, seed=0)
    assert round_.advantages_N.tolist() == [0.0, 0.0]  # the same episode reward

    turns = [[t.reward for t in e.turns] for e in round_.episodes]
    assert turns == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]  # both reset from the same good row
    # Equal returns in the group: every turn's advantage is 0, and so is every token's.
    [batch] = round_.micro_batches
    assert batch.advantages_B_C is not None and not batch.advantages_B_C.any()


def test_turn_credit_changes_the_tokens_of_the_rewarded_turn_only(tmp_path, tokenizer):
    args = config(tmp_path, turn_advantage="return")
    backend = scripted_backend(tokenizer, [tool_call("step"), tool_call("step"), "Done."])
    run = build_parts(args, backend, tokenizer, Steps, (), reward_functions([]))
    [first] = anyio.run(run.engine.run, [{"prompt": "Go.", "good": True}])
    [second] = anyio.run(run.engine.run, [{"prompt": "Go.", "good": False}])
    shaping = RewardShaping.from_config(args)
    assert shaping.turns is not None
    rows_C = shaping.turns.token_advantages(
        [first, second], torch.tensor([1.0, 1.0]), torch.zeros(2), lambda t: t, 0, 2
    )
    # Returns: good [2, 1, 1], other [1, 1, 1]: only turn 0 differs, by +-0.5 (centred).
    spans = [(t.start, t.end) for t in first.turns]
    for row_C, sign in zip(rows_C, (1.0, -1.0), strict=True):
        assert set(row_C[spans[0][0] : spans[0][1]].tolist()) == {0.5 * sign}
        assert not row_C[spans[0][1] :].any()


def test_a_training_step_with_credit_per_turn_trains(tmp_path, tokenizer):
    args = short_run_config(tmp_path, max_steps=1, turn_advantage="same_state")
    rows = [{"prompt": p} for p in ("The sky is", "Hello")]
    trainer = tiny_trainer(tokenizer, rank_in_call, args, rows)
    trainer.train()
    assert trainer._round.micro_batches[0].advantages_B_C is not None
    assert logged(trainer, "loss") and logged(trainer, "grad_norm")[0] > 0


def test_vespo_refuses_credit_per_turn(tmp_path):
    with pytest.raises(ValueError, match=r"turn_advantage=.return..*vespo"):
        config(tmp_path, turn_advantage="return", loss_type="vespo")


class SummedSteps(Steps):
    """`Steps` whose reward is its turns' rewards summed, as the gymnasium adapter's is."""

    reward_sums_turns = True

    def reward(self) -> float:
        return 1.0 if self.good else 0.0


@pytest.mark.parametrize(
    ("environment", "returns"), [(Steps, [2.0, 1.0, 1.0]), (SummedSteps, [1.0, 0.0, 0.0])]
)
def test_a_reward_that_sums_the_turns_is_not_credited_twice(
    tmp_path, tokenizer, environment, returns
):
    args = config(tmp_path, turn_advantage="return")
    backend = scripted_backend(tokenizer, [tool_call("step"), tool_call("step"), "Done."])
    run = build_parts(args, backend, tokenizer, environment, (), reward_functions([]))
    [episode] = anyio.run(run.engine.run, [{"prompt": "Go.", "good": True}])
    assert [t.reward for t in episode.turns] == [1.0, 0.0, 0.0] and episode.env_reward == 1.0
    turns = RewardShaping.from_config(args).turns
    assert turns is not None
    returns_N_T, _ = turns.tables([episode], torch.tensor([1.0]), width=3)
    assert returns_N_T.tolist() == [returns]  # Steps' reward comes on top of its turns'
