"""Seats a frozen snapshot of the policy plays, and seats that sat out their game."""

from __future__ import annotations

import math
import re
from functools import partial
from types import SimpleNamespace

import anyio
import pytest
import torch
from peft import LoraConfig, get_peft_model

from agentgrpo import GRPOTrainer
from agentgrpo.generation.local import CopiedWeights, SharedWeights, transformers_backend
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.placement import Placement
from agentgrpo.reporting import view_data
from agentgrpo.rounds.pipeline import RewardShaping, RoundParts, RoundPlan, play_and_batch
from agentgrpo.rounds.scoring import play_round
from agentgrpo.rounds.wiring import build_parts
from agentgrpo.training.seat_snapshots import RefreshedOnPush, SeatSnapshots
from environments.tictactoe import TicTacToe
from rollout import SamplingParams, ScriptedBackend
from rollout.match import MatchEngine, sat_out
from tests.agentgrpo.test_seat_rounds import config
from tests.rollout.test_match import ROW, marks, play, seat_script
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config, tiny_trainer


def test_a_seat_that_sat_out_is_left_out_of_its_groups_baseline(tmp_path, tokenizer):
    args = config(tmp_path, scale_rewards="none")
    script = seat_script(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    first_turns_of_x: list[int] = []

    def respond(context: list[int]) -> list[int]:  # x passes on the first match's first turn
        text = tokenizer.decode(context)
        if "You play x." in text and text.count("<|im_start|>assistant\n") == 1:
            first_turns_of_x.append(1)
            if len(first_turns_of_x) == 1:
                return tokenizer.encode("I pass.", add_special_tokens=False) + [eos]
        return script.respond(context)

    eos = tokenizer.eos_token_id
    run = build_parts(args, ScriptedBackend(respond, [eos]), tokenizer, TicTacToe)
    parts = RoundParts(
        play=lambda rows, g, seed: anyio.run(play_round, run.engine, rows, g, seed, run.scorer),
        shaping=RewardShaping.from_config(args),
        collate=partial(collate_episodes, pad_token_id=tokenizer.pad_token_id),
        old_logprobs=lambda batch: torch.zeros_like(batch.loss_mask_B_C, dtype=torch.float32),
    )
    round_ = play_and_batch(parts, RoundPlan.from_config(args, 1, TicTacToe), [ROW], seed=0)
    x_rewards, o_rewards = round_.rewards_N[:2].tolist(), round_.rewards_N[2:].tolist()
    assert sorted(x_rewards) == [-1.0, 1.0]  # one forfeit, one win
    [idle] = [k for k, e in enumerate(round_.episodes[2:]) if sat_out(e)]
    assert math.isnan(o_rewards[idle]) and o_rewards[1 - idle] == -1.0
    # Counted with its 0.0, the idle seat would have lifted its group's baseline to -0.5 and
    # given the o that lost an advantage of -0.5. Left out, neither o has any.
    assert round_.advantages_N[2:].tolist() == [0.0, 0.0]
    assert sorted(round_.advantages_N[:2].tolist()) == [-1.0, 1.0]


def sampled(backend, prompt: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    completion = anyio.run(backend.generate, prompt, params)
    return completion.token_ids, completion.logprobs


def train_step(policy: torch.nn.Module, ids: list[int]) -> None:
    """One optimizer step that changes every weight the forward pass reads."""
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    policy.train()
    policy(torch.tensor([ids]), labels=torch.tensor([ids])).loss.backward()
    optimizer.step()
    policy.eval()


def test_a_snapshot_seat_plays_the_old_weights_until_its_refresh(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "snapshot:2"})
    policy = tiny_llama(tokenizer).eval()
    snapshots = SeatSnapshots.of(args, Placement(), TicTacToe, policy, tokenizer)
    generator = snapshots.around(SharedWeights(transformers_backend(policy, tokenizer, args)))
    prompt = tokenizer.encode("You play o. Mark a cell.")
    assert snapshots.backends == {"o": []}  # none taken before the first round
    with generator.generating(policy, 0):
        [snapshot] = snapshots.backends["o"]
        before = sampled(generator.backend, prompt)
        assert sampled(snapshot, prompt) == before  # taken at the first round
    train_step(policy, prompt + before[0])
    with generator.generating(policy, 1):
        after = sampled(generator.backend, prompt)
        assert after[1] != before[1]  # the policy changed
        assert sampled(snapshot, prompt) == before  # its snapshot did not
    with generator.generating(policy, 2):  # two steps on: taken again
        assert sampled(snapshot, prompt) == sampled(generator.backend, prompt) == after


def test_the_run_wires_each_snapshot_seat_to_its_copy(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "snapshot", "x": "policy"})
    policy = tiny_llama(tokenizer)
    snapshots = SeatSnapshots.of(args, Placement(), TicTacToe, policy, tokenizer)
    backend = transformers_backend(policy, tokenizer, args)
    engine = build_parts(args, backend, tokenizer, TicTacToe, seat_backends=snapshots.backends)
    assert isinstance(engine.engine, MatchEngine)
    assert engine.engine.seat_backends["o"] is snapshots.backends["o"]  # the pool, kept live
    plain = config(tmp_path)
    assert not SeatSnapshots.of(plain, Placement(), TicTacToe, policy, tokenizer).seats


def test_snapshots_are_refused_where_the_generator_cannot_hold_a_copy(tmp_path, tokenizer):
    policy = tiny_llama(tokenizer)
    lora = get_peft_model(tiny_llama(tokenizer), LoraConfig(r=4, target_modules=["q_proj"]))
    vllm = dict(seat_players={"o": "snapshot:5"}, use_vllm=True)
    for model, fields, words in (
        (policy, vllm, "this policy trains whole: pass peft_config=LoraConfig(...)"),
        (lora, vllm | {"vllm_lora_push": "merged"}, "set it to 'auto' or 'adapter'"),
        (lora, vllm | {"async_grpo": True, "vllm_mode": "server"}, "drop async_grpo"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)) as error:
            SeatSnapshots.of(config(tmp_path, **fields), Placement(), TicTacToe, model, tokenizer)
        assert "or generate with transformers (use_vllm=False)" in str(error.value)
    assert SeatSnapshots.of(config(tmp_path, **vllm), Placement(), TicTacToe, lora, tokenizer).seats
    sharded = Placement(zero_stage=3)
    args = config(tmp_path, seat_players={"o": "snapshot:5"})
    with pytest.raises(ValueError, match="launch with DeepSpeed ZeRO-2 or without sharding"):
        SeatSnapshots.of(args, sharded, TicTacToe, policy, tokenizer)
    merged = SimpleNamespace(adapters=None)  # a vLLM generator that pushes merged weights
    with pytest.raises(ValueError, match=re.escape("this run pushes merged weights")):
        SeatSnapshots.of(config(tmp_path, **vllm), Placement(), TicTacToe, lora, tokenizer).on_vllm(
            merged
        )


def test_a_run_trains_the_policy_seat_against_its_refreshed_snapshot(tmp_path, tokenizer):
    args = short_run_config(
        tmp_path, per_device_train_batch_size=2, num_generations=2, max_completion_length=64,
        max_turns=5, chat_template="chatml_tools", log_episodes=True,
        seat_players={"o": "snapshot:1"},
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
    [pool] = trainer.snapshots.seats.values()
    assert pool.taken_at == [1]  # taken at step 0, again at step 1, in its one slot
    [copy] = pool.copies
    assert copy.model is not trainer.model  # its own copy, never trained
    assert not any(p.requires_grad for p in copy.model.parameters())
    records, problems = view_data.read_step(tmp_path, 1)
    assert not problems and [view_data.episode_view(r)["seat"] for r in records] == ["x", "x"]


def test_a_micro_batch_of_seats_that_sat_out_keeps_one_completion_column(tokenizer):
    idle, _ = play(tokenizer, {"x": ["No."], "o": marks(1)})[::-1]  # o never moved
    moved = play(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})[0]
    batch = collate_episodes([idle, idle, moved], torch.zeros(3), tokenizer.pad_token_id)
    picked = batch.select([0, 1])
    assert picked.completion_width == 1 and picked.loss_mask_B_C.sum() == 0
    assert picked.completion_ids_B_C.shape == (2, 1)  # not the whole rows, as [:, -0:] gives


def test_a_league_keeps_its_latest_snapshots_and_replaces_the_oldest(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "league:1:2"})
    policy = tiny_llama(tokenizer).eval()
    snapshots = SeatSnapshots.of(args, Placement(), TicTacToe, policy, tokenizer)
    [pool] = snapshots.seats.values()
    weights = lambda model: next(model.parameters()).detach().clone()  # noqa: E731
    prompt = tokenizer.encode("You play o.")
    taken = []
    for step in range(3):
        snapshots.refresh(policy, step)
        taken.append(weights(policy))
        train_step(policy, prompt)
    assert pool.taken_at == [2, 1] and len(snapshots.backends["o"]) == 2
    assert torch.equal(weights(pool.copies[0].model), taken[2])  # step 0's copy replaced
    assert torch.equal(weights(pool.copies[1].model), taken[1])
    assert not torch.equal(taken[1], taken[2])


def test_the_producer_takes_its_own_snapshots_of_the_weights_it_is_pushed(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "league:1:2"}, async_grpo=True)
    policy = tiny_llama(tokenizer).eval()
    snapshots = SeatSnapshots.of(args, Placement(), TicTacToe, policy, tokenizer)
    weights = CopiedWeights(policy, tokenizer, args)
    producer, seats = snapshots.producer(weights, tokenizer, args)
    assert isinstance(producer, RefreshedOnPush) and producer.backend is weights.backend
    [pool] = producer.snapshots.seats.values()
    assert seats["o"] is pool.backends and pool.backends == []  # live: the engine draws from it
    first = lambda model: next(model.parameters()).detach().clone()  # noqa: E731
    taken = []
    for step in range(3):  # loaded at step 0, then pushed while it could be generating
        if step == 0:
            producer.load(policy, 0)
        else:
            anyio.run(producer.push, policy, step)
        taken.append(first(policy))
        train_step(policy, tokenizer.encode("You play o."))
    assert producer.version == 2 and pool.taken_at == [2, 1]  # step 0's copy replaced
    copied = [first(copy.model) for copy in pool.copies]
    assert torch.equal(copied[0], taken[2]) and torch.equal(copied[1], taken[1])
    assert pool.copies[0].backend.weights_version == 2  # pushed between two of its steps
    assert snapshots.backends["o"] == []  # the learner's pool is its own, untouched
    plain = SeatSnapshots.of(config(tmp_path), Placement(), TicTacToe, policy, tokenizer)
    assert plain.producer(weights, tokenizer, args) == (weights, {})


def test_an_async_run_trains_against_snapshots_the_producer_refreshes(tmp_path, tokenizer):
    args = short_run_config(
        tmp_path, per_device_train_batch_size=2, num_generations=2, max_completion_length=64,
        max_turns=5, chat_template="chatml_tools", log_episodes=True,
        seat_players={"o": "snapshot:1"}, async_grpo=True,
    )  # fmt: skip
    rows = TicTacToe.dataset("train").select(range(4))
    trainer = tiny_trainer(tokenizer, None, args, rows, environment_factory=TicTacToe)
    trainer.train()
    assert trainer.state.global_step == 2
    producer = trainer._async.generation.weights
    [pool] = producer.snapshots.seats.values()
    assert pool.taken_at == [2]  # taken at step 0, again at the pushes of steps 1 and 2
    assert trainer._async.generation.engine.seat_backends["o"] is pool.backends
    assert pool.copies[0].model is not producer.generator.model  # its own copy
    for step in (1, 2):
        records, problems = view_data.read_step(tmp_path, step)
        assert not problems and [view_data.episode_view(r)["seat"] for r in records] == ["x", "x"]
