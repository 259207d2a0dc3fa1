"""The curriculum: training rows drawn by how much they can still teach, p(1 - p).

The pool's draws are seeded, so counts over many draws are fixed numbers, not sampling luck.
The rounds here score each row by its own `rewards` column, so which rows pass is the test's
choice; the trainer's runs (through the tiny model) at the end check the wiring, checkpoints
included.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig
from agentgrpo.asynchronous.buffer import RowStream
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.rounds.curriculum import CURRICULUM_FILE, Curriculum, RowPool
from agentgrpo.rounds.pipeline import RewardShaping, RoundParts, RoundPlan, play_and_batch
from agentgrpo.rounds.sampler import curriculum_of
from tests.support.episodes import scripted_episode
from tests.support.runs import one_step
from tests.support.trainer import StopAfter, tiny_trainer

G = 2


def draw_counts(pool: RowPool, draws: int) -> collections.Counter:
    """How often each row is drawn, one row a draw, over `draws` seeded draws."""
    return collections.Counter(pool.draw(1, seed)[0] for seed in range(draws))


def test_a_row_solved_every_time_is_drawn_less_than_the_rows_still_learned():
    pool = RowPool(4, floor=0.05)
    for _ in range(3):  # three rounds: row 0 always passes, rows 1-3 half the time
        pool.record([0, 1, 2, 3], passes_Q=[G, 1, 1, 1], episodes_Q=[G, G, G, G])
    counts = draw_counts(pool, 800)
    # weights 0.05 / 0.25 / 0.25 / 0.25: row 0 expected 50 times, each other 250 times
    assert counts[0] < min(counts[1], counts[2], counts[3]) / 2


def test_without_results_every_row_is_drawn_alike():
    counts = draw_counts(RowPool(4, floor=0.05), 800)
    assert min(counts.values()) > 150  # 200 expected each


def test_the_floor_keeps_rows_always_or_never_solved_in_play():
    pool = RowPool(3, floor=0.05)
    pool.record([0, 1, 2], passes_Q=[4, 0, 2], episodes_Q=[4, 4, 4])
    assert pool.weights().tolist() == [0.05, 0.05, 0.25]
    counts = draw_counts(pool, 700)
    assert counts[0] > 0 and counts[1] > 0


def test_a_floor_outside_its_range_is_refused_naming_the_option():
    for floor in (0.0, 0.3):
        with pytest.raises(ValueError, match=r"curriculum_floor=.* must be in \(0, 0.25\]"):
            GRPOConfig(output_dir="out", curriculum=True, curriculum_floor=floor)
        with pytest.raises(ValueError, match="curriculum_floor"):
            RowPool(3, floor)


def test_every_process_draws_the_same_rows_and_plays_its_own_slice():
    rows = [{"name": i} for i in range(8)]
    process_0 = Curriculum(rows, RowPool(8, 0.05), pass_reward=1.0, seed=3)
    process_1 = Curriculum(rows, RowPool(8, 0.05), pass_reward=1.0, seed=3)
    mine, theirs = process_0.draw_rows(2, 2, 0), process_1.draw_rows(2, 2, 1)
    names = [row["name"] for row in mine + theirs]
    assert len(set(names)) == 4
    assert names[2:] == [rows[i]["name"] for i in process_0._drawn[2:]]  # p1's slice of p0's draw


def test_a_pass_is_a_weighted_reward_at_the_threshold_and_unscored_episodes_do_not_count():
    curriculum = Curriculum([{}] * 2, RowPool(2, 0.05), pass_reward=1.0, seed=0)
    curriculum.draw_rows(2, 1, 0)
    nan = math.nan
    # columns weighted 1 and 0.5: sums 1.0, 0.5 | 1.5, (unscored)
    rewards_N_F = torch.tensor([[1.0, nan], [0.0, 1.0], [1.0, 1.0], [nan, nan]])
    curriculum.record(rewards_N_F, [1.0, 0.5], G)
    first, second = curriculum._drawn
    assert curriculum.pool.passes_R[[first, second]].tolist() == [1, 1]
    assert curriculum.pool.episodes_R[[first, second]].tolist() == [2, 1]


# ------------------------------------------------------------------ rounds


@pytest.fixture(scope="module")
def episode(tokenizer):
    return scripted_episode(tokenizer, ["Done."])


def round_parts(episode, tokenizer, curriculum, plays: list) -> RoundParts:
    """Round parts whose play scores row r's G episodes with its `rewards` column."""

    def play(rows, num_generations, seed):
        plays.append([row["name"] for row in rows])
        episodes = [
            dataclasses.replace(episode, group=q, index=q * num_generations + k)
            for q in range(len(rows))
            for k in range(num_generations)
        ]
        return episodes, torch.tensor([r for row in rows for r in row["rewards"]]).unsqueeze(1)

    return RoundParts(
        play=play,
        shaping=RewardShaping(),
        collate=lambda episodes, advantages_N: collate_episodes(
            episodes, advantages_N, tokenizer.pad_token_id
        ),
        old_logprobs=lambda batch: torch.zeros(batch.completion_ids_B_C.shape),
        curriculum=curriculum,
    )


# Row 0 passes every episode; the others pass one episode of two.
ROWS = [{"name": 0, "rewards": [1.0, 1.0]}] + [
    {"name": n, "rewards": [1.0, 0.0]} for n in (1, 2, 3)
]
PLAN = RoundPlan(prompts_per_process=2, num_generations=G, micro_batch_size=4)


def test_rounds_draw_their_rows_and_play_a_row_always_solved_less(episode, tokenizer):
    curriculum = Curriculum(ROWS, RowPool(4, 0.05), pass_reward=1.0, seed=0)
    plays: list = []
    parts = round_parts(episode, tokenizer, curriculum, plays)
    for _ in range(60):
        round_ = play_and_batch(parts, PLAN, ROWS[:2], seed=0)
    played = collections.Counter(name for names in plays for name in names)
    assert sum(played.values()) == 120 and curriculum.pool.draws == 60
    assert played[0] < min(played[1], played[2], played[3]) / 2
    assert round_.curriculum["curriculum/rows_solved_always"] == 1.0
    assert round_.curriculum["curriculum/rows_unseen"] == 0.0
    assert round_.curriculum["curriculum/weight_min"] == 0.05


def test_evaluation_rounds_play_the_rows_given_and_leave_the_pool_alone(episode, tokenizer):
    curriculum = Curriculum(ROWS, RowPool(4, 0.05), pass_reward=1.0, seed=0)
    plays: list = []
    parts = round_parts(episode, tokenizer, curriculum, plays)
    eval_plan = dataclasses.replace(PLAN, train=False)
    round_ = play_and_batch(parts, eval_plan, [ROWS[3], ROWS[0]], seed=0)
    assert plays == [[3, 0]] and round_.curriculum == {}
    assert curriculum.pool.draws == 0 and int(curriculum.pool.episodes_R.sum()) == 0


def test_without_a_curriculum_the_rows_given_are_played():
    args = GRPOConfig(output_dir="out")
    assert not args.curriculum and curriculum_of(args, ROWS) is None


def test_rows_without_columns_are_refused_naming_the_option():
    args = GRPOConfig(output_dir="out", curriculum=True)
    with pytest.raises(ValueError, match=r"curriculum=True .* rows have no columns"):
        curriculum_of(args, [{}, {}])


# ------------------------------------------------------------------ the trainer


def by_row_column(completions, rewards, **kwargs):
    """Each row's `rewards` column, one per episode of its group (in order within the group)."""
    return [group[k % G] for k, group in enumerate(rewards)]


def curriculum_run(tokenizer, output_dir, played: list, callbacks=(), max_steps=4):
    """A tiny-model run of 2 rows a step whose rewards are the rows' (row 0 always passes)."""
    rows = Dataset.from_list(
        [{"prompt": f"Say {r['name']}.", "rewards": r["rewards"]} for r in ROWS]
    )

    def reward(prompts, rewards, **kwargs):
        played.extend(prompts[::G])
        return by_row_column(prompts, rewards)

    args = GRPOConfig(**one_step(output_dir, curriculum=True, max_steps=max_steps, seed=0))
    trainer = tiny_trainer(tokenizer, reward, args, rows, callbacks=list(callbacks))
    return trainer


def test_a_run_logs_its_row_pool_and_saves_it_in_its_checkpoints(tokenizer, tmp_path):
    played: list = []
    trainer = curriculum_run(tokenizer, tmp_path, played, [StopAfter(2, save=True)])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2 and all("curriculum/rows_solved_always" in log for log in logs)
    saved = torch.load(tmp_path / "checkpoint-2" / CURRICULUM_FILE, weights_only=True)
    assert saved["draws"] == 2 and int(saved["episodes_R"].sum()) == 2 * 2 * G


@pytest.mark.slow
def by_step(played: list) -> list[list]:
    """The rows each step played (2 a step), sorted."""
    return [sorted(played[i : i + 2]) for i in range(0, len(played), 2)]


def test_a_resumed_run_draws_the_rows_the_uninterrupted_run_drew(tokenizer, tmp_path):
    """Rewards are the rows' own, whatever was sampled: the draws depend on the pool alone."""
    straight: list = []
    curriculum_run(tokenizer, tmp_path / "straight", straight).train()
    first: list = []
    cut = tmp_path / "cut"
    curriculum_run(tokenizer, cut, first, [StopAfter(2, save=True)]).train()
    resumed: list = []
    trainer = curriculum_run(tokenizer, cut, resumed)
    trainer.train(resume_from_checkpoint=str(cut / "checkpoint-2"))
    # Groups are scored as they end, in any order: compare each step's rows, not their order.
    assert len(straight) == 8 and by_step(first) == by_step(straight)[:2]
    assert by_step(resumed) == by_step(straight)[2:]
    assert trainer.checkpoints.curriculum is not None
    assert trainer.checkpoints.curriculum.pool.draws == 4

    (cut / "checkpoint-2" / CURRICULUM_FILE).unlink()  # as a run without the curriculum saves
    trainer = curriculum_run(tokenizer, cut, [])
    with pytest.warns(UserWarning, match="holds no curriculum pass counts"):
        trainer.train(resume_from_checkpoint=str(cut / "checkpoint-2"))
    assert trainer.state.global_step == 4


# ------------------------------------------------------------------ asynchronous


def test_the_producers_rows_are_drawn_by_the_pool():
    curriculum = Curriculum(ROWS, RowPool(4, 0.05), pass_reward=1.0, seed=0)
    curriculum.pool.record([0, 1, 2, 3], passes_Q=[G, 1, 1, 1], episodes_Q=[G, G, G, G])
    stream = RowStream(ROWS, shuffle=False, seed=0, curriculum=curriculum)
    drawn = [stream.next() for _ in range(400)]
    assert all(row is ROWS[key] for row, _, key in drawn)
    played = collections.Counter(key for _, _, key in drawn)
    assert played[0] < min(played[1], played[2], played[3]) / 2
    curriculum.record_group(0, torch.tensor([[1.0], [0.0]]), [1.0])
    assert curriculum.pool.passes_R[0] == G + 1 and curriculum.pool.episodes_R[0] == 2 * G


def test_an_async_run_draws_its_producers_rows_from_the_pool_and_logs_it(tokenizer, tmp_path):
    rows = Dataset.from_list(
        [{"prompt": f"Say {r['name']}.", "rewards": r["rewards"]} for r in ROWS]
    )
    args = GRPOConfig(
        **one_step(tmp_path, curriculum=True, async_grpo=True, max_steps=2, queue_maxsize=64)
    )
    trainer = tiny_trainer(tokenizer, by_row_column, args, rows)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2 and all("curriculum/weight_mean" in log for log in logs)
    pool = trainer.checkpoints.curriculum.pool
    assert pool.draws >= 4 and int(pool.episodes_R.sum()) >= 4 * G  # 2 groups a step, at least
