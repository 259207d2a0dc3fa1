"""Adapter-only LoRA pushes into a real in-process vLLM on CPU: the adapter vLLM serves is the
trained one (its sampled logprobs are the PEFT policy's), and versions are evicted."""

from __future__ import annotations

import anyio
import pytest
import torch
from peft import LoraConfig

from agentgrpo.generation.adapters import AdapterPush, colocate_limits
from agentgrpo.generation.weight_sync import ColocatedPush, colocated_vllm
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
    limits = colocate_limits(lora_policy)
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
