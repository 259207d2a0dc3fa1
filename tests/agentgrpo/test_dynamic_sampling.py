"""Dynamic sampling: a round's uninformative groups replaced by fresh, informative ones.

The play here scores each row by its own `rewards` column, so which groups teach is the test's
choice; the trainer's run with the real engine is at the end.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.rounds.dynamic_sampling import (
    DynamicSampling,
    GroupFilter,
    informative_groups,
    resample,
)
from agentgrpo.rounds.scoring import RewardLogs
from tests.support.episodes import scripted_episode
from tests.support.runs import one_step
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config

G = 2


@pytest.fixture(scope="module")
def episode(tokenizer):
    return scripted_episode(tokenizer, ["Done."])


def player(episode, plays: list):
    """A play scoring each row's episodes with its `rewards` column; `plays` records the rows."""

    def play(rows, num_generations, seed):
        plays.append([row["name"] for row in rows])
        episodes = [
            dataclasses.replace(episode, group=q, index=q * num_generations + k)
            for q in range(len(rows))
            for k in range(num_generations)
        ]
        rewards = [r for row in rows for r in row["rewards"]]
        logs = RewardLogs()
        for q, row in enumerate(rows):
            logs.add_extra(q, num_generations, "row", [row["name"]] * num_generations)
        return episodes, torch.tensor(rewards).unsqueeze(1), logs

    return play


def fresh_rows(pool):
    """Draw rows from `pool` in order, as many as asked (the seed is recorded)."""
    drawn = iter(pool)
    seeds = []

    def draw(count, seed):
        seeds.append(seed)
        return [next(drawn) for _ in range(count)]

    draw.seeds = seeds
    return draw


def row(name, *rewards):
    return {"name": name, "rewards": list(rewards)}


def test_a_group_informs_when_two_of_its_scored_rewards_differ():
    nan = math.nan
    rewards_N = torch.tensor([1.0, 1.0, 0.0, 2.0, nan, 1.0, nan, nan, 0.5, 0.25])
    assert informative_groups(rewards_N, 2).tolist() == [False, True, False, False, True]


def test_equal_groups_are_replaced_by_fresh_informative_ones_up_to_the_budget(episode):
    plays = []
    play = player(episode, plays)
    draw = fresh_rows([row("f1", 1, 1), row("f2", 0, 1), row("f3", 0, 0), row("f4", 1, 0)])
    logs = RewardLogs()
    sampling = DynamicSampling(draw, play, max_rounds=3, logs=logs)
    round_rows = [row("a", 1, 1), row("b", 0, 1), row("c", 0, 0)]
    episodes, rewards_N_F, round_logs = play(round_rows, G, 7)
    logs.extra = round_logs.extra
    done = resample(sampling, lambda r: r[:, 0], lambda t: t, (episodes, rewards_N_F), G, 7)
    # a and c teach nothing: f1 (equal) is played and dropped, f2 takes a's place; then c's
    # replacement is drawn: f3 (equal) and f4 takes it.
    assert plays == [["a", "b", "c"], ["f1", "f2"], ["f3"], ["f4"]]
    assert done.rewards_N_F[:, 0].tolist() == [0, 1, 0, 1, 1, 0]
    assert (done.replaced, done.rounds, done.informative) == (2, 3, 3)
    placed = [(e.group, e.index) for e in done.episodes]
    assert placed == [(q, q * G + k) for q in range(3) for k in range(G)]
    assert logs.take_extra(3, G)["row"] == ["f2", "f2", "b", "b", "f4", "f4"]
    assert len(set(draw.seeds)) == 3  # a seed of its own per attempt, fixed by the round's


def test_past_the_budget_the_uninformative_groups_stay(episode):
    plays = []
    draw = fresh_rows([row(f"f{i}", 1, 1) for i in range(9)])
    sampling = DynamicSampling(draw, player(episode, plays), max_rounds=2, logs=RewardLogs())
    played = player(episode, [])([row("a", 1, 1), row("b", 0, 1)], G, 0)[:2]
    done = resample(sampling, lambda r: r[:, 0], lambda t: t, played, G, 0)
    assert plays == [["f0"], ["f1"]]  # two plays of one row, none informative
    assert done.rewards_N_F[:, 0].tolist() == [1, 1, 0, 1]  # the round keeps its size
    assert (done.replaced, done.rounds, done.informative) == (0, 2, 1)


def test_a_full_process_plays_as_often_as_one_that_still_misses_and_keeps_nothing(episode):
    """Generation may be collective: a full process plays the fresh rows another still needs."""
    gathered = []

    def other_process_misses(tensor):  # this process, and another one short of a group
        gathered.append(int(tensor))
        return torch.cat([tensor, torch.tensor([1])])

    plays = []
    draw = fresh_rows([row("x0", 0, 1), row("x1", 0, 1)])
    sampling = DynamicSampling(draw, player(episode, plays), 2, RewardLogs())
    played = player(episode, [])([row("a", 0, 1)], G, 0)[:2]
    done = resample(sampling, lambda r: r[:, 0], other_process_misses, played, G, 0)
    assert gathered == [0, 0] and plays == [["x0"], ["x1"]]
    assert (done.rounds, done.replaced) == (2, 0) and done.rewards_N_F[:, 0].tolist() == [0, 1]


def test_a_run_with_dynamic_sampling_logs_what_it_replaced(tokenizer, tmp_path):
    """The tiny model through the trainer: a reward equal for every episode makes every group
    uninformative, so each round plays `max_resample_rounds` fresh rows, and keeps its size."""
    args = GRPOConfig(
        **one_step(tmp_path, dynamic_sampling=True, max_resample_rounds=2, max_steps=1)
    )
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        args=args,
        processing_class=tokenizer,
        reward_funcs=lambda completions, **kwargs: [1.0] * len(completions),
        train_dataset=Dataset.from_dict({"prompt": [f"Say {i}." for i in range(8)]}),
    )
    trainer.train()
    [log] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert log["dynamic_sampling/resample_rounds"] == 2.0
    assert log["dynamic_sampling/groups_replaced"] == 0.0
    assert log["dynamic_sampling/effective_batch"] == 0.0
    assert trainer.state.global_step == 1


def test_a_run_replaces_its_flat_groups_with_rows_whose_episodes_differ(tokenizer, tmp_path):
    """Rows 0 and 1 (the first round's, unshuffled) score every completion 1.0; the others
    score each completion by its tokens, so their groups differ: both flat groups are replaced."""
    seen_prompts = []

    def reward(prompts, completion_ids, flat, **kwargs):
        seen_prompts.extend(prompts)
        scores = zip(flat, completion_ids, strict=True)
        return [1.0 if f else float(sum(ids) % 997) for f, ids in scores]

    rows = {"prompt": [f"Say {i}." for i in range(8)], "flat": [True, True] + [False] * 6}
    args = GRPOConfig(
        **one_step(tmp_path, dynamic_sampling=True, shuffle_dataset=False, max_steps=1)
    )
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        args=args,
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=Dataset.from_dict(rows),
    )
    trainer.train()
    [log] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert log["dynamic_sampling/groups_replaced"] == 2.0
    assert log["dynamic_sampling/effective_batch"] == 4.0 and log["frac_reward_zero_std"] == 0.0
    assert {"Say 0.", "Say 1."} <= set(seen_prompts)  # played first, then replaced
    trained = {episode.row["prompt"] for episode, _ in trainer.last_episodes}
    assert len(trained) == 2 and not trained & {"Say 0.", "Say 1."}


def test_the_producers_filter_drops_flat_groups_and_keeps_one_past_its_budget():
    drops = GroupFilter(lambda r: r[:, 0], 2, max_in_a_row=2)
    flat, varied = torch.tensor([[1.0], [1.0]]), torch.tensor([[0.0], [1.0]])
    assert [drops.drops(flat), drops.drops(flat), drops.drops(flat)] == [True, True, False]
    assert [drops.drops(flat), drops.drops(varied), drops.drops(flat)] == [True, False, True]
    assert drops.dropped == 4


def test_a_games_row_is_dropped_only_when_no_seats_group_informs():
    drops = GroupFilter(lambda r: r[:, 0], 2, max_in_a_row=9)
    x_ties_o_differs = torch.tensor([[1.0], [1.0], [-1.0], [0.0]])  # seat x's group, then o's
    both_tie = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]])
    assert [drops.drops(x_ties_o_differs), drops.drops(both_tie)] == [False, True]


def test_an_async_run_trains_only_on_groups_whose_rewards_differ(tokenizer, tmp_path):
    """Half the rows score every completion alike; the producer drops their groups and plays
    the next rows, so the learner never takes one (`frac_reward_zero_std` is 0)."""

    def reward(completion_ids, flat, **kwargs):
        scores = zip(flat, completion_ids, strict=True)
        return [1.0 if f else float(sum(ids) % 997) for f, ids in scores]

    rows = {"prompt": [f"Say {i}." for i in range(64)], "flat": [True, False] * 32}
    args = short_run_config(
        tmp_path,
        async_grpo=True,
        dynamic_sampling=True,
        per_device_train_batch_size=8,
        num_generations=2,
        queue_maxsize=64,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        args=args,
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=Dataset.from_dict(rows),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2 and all(log["frac_reward_zero_std"] == 0.0 for log in logs)
    assert sum(log["dynamic_sampling/groups_replaced"] for log in logs) >= 4  # 4 groups a step
    trained = {episode.row["prompt"] for episode, _ in trainer.last_episodes}
    assert all(int(p.split()[1].rstrip(".")) % 2 for p in trained)  # odd rows: not flat
