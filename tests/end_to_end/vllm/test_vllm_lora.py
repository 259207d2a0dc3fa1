"""Adapter-only LoRA pushes into a real in-process vLLM on CPU: the adapter vLLM serves is the
trained one (its sampled logprobs are the PEFT policy's), and versions are evicted."""

from __future__ import annotations

import copy
import os

import anyio
import pytest
import torch
from peft import LoraConfig

from agentgrpo.generation.adapters import AdapterPush, FrozenAdapter, colocate_limits
from agentgrpo.generation.weight_sync import ColocatedPush, colocated_vllm
from rollout import SamplingParams
from rollout.backends.vllm_colocate import default_stop_token_ids
from tests.support.episodes import COUNTER_ROW
from tests.support.trainer import short_run_config
from tests.support.vllm_support import (
    load_policy,
    logprob_gap,
    needs_vllm,
    play_on_final_weights,
    vllm_counter_engine,
)

pytestmark = [*needs_vllm, pytest.mark.process, pytest.mark.slow]


@pytest.fixture(scope="module")
def pushes(vllm_environment, lora_policy, tokenizer, tmp_path_factory):
    """A colocated engine started with the base weights, taking the adapter alone."""
    args = short_run_config(
        tmp_path_factory.mktemp("run"), use_vllm=True, vllm_max_model_length=2048
    )
    stop = default_stop_token_ids(tokenizer)
    limits = colocate_limits(lora_policy, adapters=2)  # the policy's, and a snapshot's
    backend = colocated_vllm(lora_policy, tokenizer, args, stop, False, limits)
    return ColocatedPush(backend, sleeps=False, adapters=AdapterPush(backend, keep=1))


def play(pushes, tokenizer, policy, step):
    with pushes.generating(policy, step):
        engine = vllm_counter_engine(pushes.backend, tokenizer, temperature=0.7)
        return anyio.run(engine.run, [COUNTER_ROW], 4)


def test_the_adapter_vllm_loaded_gives_the_trained_policys_logprobs(
    pushes, lora_policy, tokenizer, policy
):
    episodes = play(pushes, tokenizer, lora_policy, step=0)
    assert logprob_gap(lora_policy, episodes, temperature=0.7) < 1e-3
    # What a test of a push that did not happen would see: the base model's logprobs differ.
    assert logprob_gap(policy, episodes, temperature=0.7) > 1e-2
    assert pushes.adapters.pushed_bytes < 100_000  # the adapter alone, not 13 MB of weights


def test_a_later_step_replaces_the_adapter_and_evicts_the_old_version(
    pushes, lora_policy, tokenizer
):
    with torch.no_grad():  # as an optimizer step would change it
        for name, parameter in lora_policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.5)
    episodes = play(pushes, tokenizer, lora_policy, step=1)
    assert logprob_gap(lora_policy, episodes, temperature=0.7) < 1e-3
    [newest] = pushes.adapters.versions.loaded
    assert newest.version == 1
    assert pushes.backend.llm.llm_engine.list_loras() == {newest.lora_id}


def sampled_gap(model, prompt: list[int], completion, temperature: float) -> float:
    """Mean |sampler logprob - `model`'s forward logprob| over `completion`'s tokens."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    forward = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return float((forward - torch.tensor(completion.logprobs)).abs().mean())


def test_a_snapshot_is_a_frozen_adapter_the_pushes_never_evict(pushes, lora_policy, tokenizer):
    snapshot = copy.deepcopy(lora_policy)
    frozen = FrozenAdapter(pushes.adapters, lora_policy, version=7)
    with torch.no_grad():  # the policy trains on
        for name, parameter in lora_policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.0)
    prompt = tokenizer.encode("Count to the target: increment by")

    async def one_game() -> list:  # the policy's and the snapshot's turns in one task
        turns = [pushes.backend, frozen.backend] * 2
        params = [SamplingParams(max_tokens=8, temperature=0.7, seed=k) for k in range(4)]
        return [await b.generate(prompt, p) for b, p in zip(turns, params, strict=True)]

    with pushes.generating(lora_policy, 8):
        completions = anyio.run(one_game)
    [newest] = pushes.adapters.versions.loaded  # keep=1: the push evicted the older version
    loaded = pushes.backend.llm.llm_engine.list_loras()
    assert loaded == {newest.lora_id, frozen.adapter.lora_id}
    for turn, model in zip(completions, (lora_policy, snapshot) * 2, strict=True):
        assert sampled_gap(model, prompt, turn, temperature=0.7) < 1e-3
    assert sampled_gap(lora_policy, prompt, completions[1], temperature=0.7) > 1e-2
    old = frozen.adapter
    frozen.load(lora_policy, 8)  # a refresh: the new adapter in, the old one out
    assert pushes.backend.llm.llm_engine.list_loras() == {newest.lora_id, frozen.adapter.lora_id}
    assert frozen.adapter.lora_id != old.lora_id and not os.path.exists(old.path)
    [again] = anyio.run(lambda: one_game_of(frozen.backend, prompt))
    assert sampled_gap(lora_policy, prompt, again, temperature=0.7) < 1e-3


async def one_game_of(backend, prompt):
    return [await backend.generate(prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=1))]


def test_a_lora_run_on_colocated_vllm_plays_its_snapshot_seat_as_a_frozen_adapter(
    vllm_environment, policy_path, tokenizer, tmp_path
):
    from agentgrpo import GRPOTrainer
    from environments.tictactoe import TicTacToe

    game = dict(max_completion_length=48, max_turns=5, chat_template="chatml_tools")
    game |= dict(seat_players={"o": "snapshot:1"}, per_device_train_batch_size=4)
    trainer = GRPOTrainer(
        load_policy(policy_path),
        None,
        args=short_run_config(tmp_path, use_vllm=True, num_generations=2, **game),
        train_dataset=TicTacToe.dataset("train").select([0, 2, 1, 5]),  # o moves first in 0 and 1
        processing_class=tokenizer,
        environment_factory=TicTacToe,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    [pool] = trainer.snapshots.seats.values()
    [frozen] = pool.copies
    assert isinstance(frozen, FrozenAdapter) and pool.taken_at == [1]  # refreshed at step 1
    assert trainer.engine.seat_backends["o"] == [frozen.backend]
    [newest] = trainer.generator.generator.adapters.versions.loaded
    engine = trainer.generator.generator.backend.llm.llm_engine
    assert engine.list_loras() == {newest.lora_id, frozen.adapter.lora_id}
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    with trainer.generator.generating(model, 2):  # the snapshot is refreshed to step 2 too
        played = anyio.run(trainer.engine.run, [TicTacToe.dataset("train")[2]], 2)  # x opens
    assert {e.row["seat"] for e in played} == {"x"}  # the snapshot's side gives no episode
    assert logprob_gap(model, played, temperature=trainer.args.temperature) < 1e-3


def test_a_peft_run_on_colocated_vllm_generates_with_its_trained_adapter(
    vllm_environment, policy_path, tokenizer, tmp_path
):
    from datasets import Dataset

    from agentgrpo import GRPOTrainer
    from environments import Counter
    from tests.support.trainer import rank_in_call

    episodes = dict(max_completion_length=48, max_turns=2, chat_template="chatml_tools")
    trainer = GRPOTrainer(
        load_policy(policy_path),
        rank_in_call,
        args=short_run_config(tmp_path, use_vllm=True, **episodes),
        train_dataset=Dataset.from_list([COUNTER_ROW] * 8),
        processing_class=tokenizer,
        environment_factory=Counter,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    model, played = play_on_final_weights(trainer)
    [adapter] = trainer.generator.adapters.versions.loaded
    assert adapter.version == trainer.state.global_step == 2
    assert logprob_gap(model, played, temperature=trainer.args.temperature) < 1e-3
