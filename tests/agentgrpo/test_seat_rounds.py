"""Rounds of a game with seats: a group per (row, seat), each seat with its own advantage."""

from __future__ import annotations

import re
from functools import partial

import anyio
import pytest
import torch

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.doctor import Setup, Status, check_environment_runs
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.reporting import view_data
from agentgrpo.rounds.pipeline import (
    RewardShaping,
    RoundParts,
    RoundPlan,
    play_and_batch,
    trained_seats,
)
from agentgrpo.rounds.scoring import play_round
from agentgrpo.rounds.wiring import build_parts
from environments import Counter
from environments.tictactoe import TicTacToe
from rollout import load_template
from rollout.match import MatchEngine
from tests.rollout.test_match import ROW, marks, seat_script
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config, tiny_trainer


def config(tmp_path, **fields) -> GRPOConfig:
    run = dict(
        per_device_train_batch_size=4, num_generations=2, max_completion_length=512,
        chat_template="chatml_tools",
    )  # fmt: skip
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **(run | fields))


def test_a_round_plays_fewer_rows_when_each_game_trains_several_seats(tmp_path):
    args = config(tmp_path, max_steps=3)
    assert trained_seats(TicTacToe, None) == 2
    assert trained_seats(TicTacToe, {"o": "random"}) == 1
    assert trained_seats(Counter, None) == 1
    plan = RoundPlan.from_config(args, 1, TicTacToe)
    assert (plan.prompts_per_process, plan.episodes_per_process) == (1, 4)
    assert plan.rows_needed == 3
    evaluation = RoundPlan.for_eval(config(tmp_path, per_device_eval_batch_size=4), 1, plan.seats)
    assert (evaluation.prompts_per_process, evaluation.episodes_per_process) == (1, 4)
    assert evaluation.micro_batch_size == 4
    odd = config(tmp_path, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=re.escape("x 2 seats trained per game")):
        RoundPlan.from_config(odd, 1, TicTacToe)


def test_each_seat_is_its_own_group_with_its_own_reward_and_advantage(tmp_path, tokenizer):
    args = config(tmp_path, scale_rewards="none")
    backend = seat_script(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    run = build_parts(args, backend, tokenizer, TicTacToe)
    assert isinstance(run.engine, MatchEngine)
    plan = RoundPlan.from_config(args, 1, TicTacToe)
    parts = RoundParts(
        play=lambda rows, g, seed: anyio.run(play_round, run.engine, rows, g, seed, run.scorer),
        shaping=RewardShaping.from_config(args),
        collate=partial(collate_episodes, pad_token_id=tokenizer.pad_token_id),
        old_logprobs=lambda batch: torch.zeros_like(batch.loss_mask_B_C, dtype=torch.float32),
    )
    round_ = play_and_batch(parts, plan, [ROW], seed=0)
    assert [(e.group, e.row["seat"]) for e in round_.episodes] == [
        (0, "x"), (0, "x"), (1, "o"), (1, "o")
    ]  # fmt: skip
    assert round_.rewards_N.tolist() == [1.0, 1.0, -1.0, -1.0]  # zero-sum: x wins every game
    # Within a seat's group every game went alike: no advantage. Mixing seats in one group
    # would have given the winner +1 and the loser -1.
    assert round_.advantages_N.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert sum(len(b) for b in round_.micro_batches) == 4


def test_seat_players_need_a_game_with_seats(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "random"})
    backend = seat_script(tokenizer, {"x": marks(1)})
    with pytest.raises(ValueError, match="needs one environment class with seats"):
        build_parts(args, backend, tokenizer, Counter)
    config(tmp_path, seat_players={"o": "random"}, async_grpo=True)  # played asynchronously
    for frozen in ("model:runs/old/model", "snapshot:2", "league:2:2", "adapter:solver"):
        config(tmp_path, seat_players={"o": frozen}, async_grpo=True)  # every player plays async


def test_self_play_trains_two_steps_in_process_with_a_tiny_model(tmp_path, tokenizer):
    args = short_run_config(
        tmp_path, num_generations=2, max_completion_length=96, max_turns=5,
        chat_template="chatml_tools", log_episodes=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        None,
        args,
        TicTacToe.dataset("train").select(range(4)),
        processing_class=tokenizer,
        environment_factory=TicTacToe,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    records, problems = view_data.read_step(tmp_path, 1)
    views = [view_data.episode_view(record) for record in records]
    assert not problems and [v["seat"] for v in views] == ["x", "x", "o", "o"]
    assert [v["row_kinds"][0] for v in views] == ["seat x's side"] * 2 + ["seat o's side"] * 2


def test_asynchronous_self_play_trains_a_group_per_seat_of_each_row(tmp_path, tokenizer):
    args = short_run_config(
        tmp_path, num_generations=2, per_device_train_batch_size=8, max_completion_length=96,
        max_turns=5, chat_template="chatml_tools", log_episodes=True, async_grpo=True,
    )  # fmt: skip
    rows = TicTacToe.dataset("train").select(range(8))
    trainer = tiny_trainer(tokenizer, None, args, rows, environment_factory=TicTacToe)
    trainer.train()
    assert trainer.state.global_step == 2
    for step in (1, 2):  # 2 rows a step: the producer's played rows, renumbered in order
        records, problems = view_data.read_step(tmp_path, step)
        episodes = [record.episode for record in records]
        assert not problems and [e.index for e in episodes] == list(range(8))
        assert [(e.group, e.row["seat"]) for e in episodes] == [
            (0, "x"), (0, "x"), (1, "o"), (1, "o"), (2, "x"), (2, "x"), (3, "o"), (3, "o")
        ]  # fmt: skip
        openings = [e.row["opening"] for e in episodes]
        assert openings[:4] == [openings[0]] * 4 and openings[4:] == [openings[4]] * 4
    assert trainer._async.generation.seats == 2
    args.queue_maxsize = 3  # holds a group, but not a row's two seats' groups: refused, no hang
    with pytest.raises(ValueError, match=re.escape("queue_maxsize=3 cannot hold one row's games")):
        tiny_trainer(tokenizer, None, args, rows, environment_factory=TicTacToe)


def test_doctor_says_who_moves_first_and_fails_a_game_over_before_it_starts(tokenizer):
    setup = Setup(tokenizer, load_template(tokenizer, "chatml_tools"), frozenset({0}))
    rows = lambda: [ROW]  # noqa: E731
    result = check_environment_runs(TicTacToe, rows, setup)
    assert result.status is Status.OK, result.line()
    assert "seats x, o: x moves first and is told" in result.message

    class Over(TicTacToe):
        def to_move(self):
            return None

    result = check_environment_runs(Over, rows, setup)
    assert result.status is Status.FAIL and "is None right after reset()" in result.message
