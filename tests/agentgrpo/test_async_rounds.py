"""Asynchronous GRPO: the queue between producer and learner, and whole runs that respect it."""

from __future__ import annotations

import _thread
import gc
import threading
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.asynchronous.buffer import GroupBuffer, PlayedGroup, ProducerFailed
from agentgrpo.rewards.calls import RewardFunctionError
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import logged, rank_in_call, short_run_config

PROMPTS = Dataset.from_dict({"prompt": ["The sky is", "Hello", "One two", "A B C"] * 40})


def group(version: int, size: int = 2) -> PlayedGroup:
    return PlayedGroup([object()] * size, torch.zeros(size, 1), version)  # type: ignore[list-item]


def config(tmp_path, **overrides) -> GRPOConfig:
    """short_run_config's run, async: 3 steps of 8 rows, a queue of 64 episodes."""
    run = dict(per_device_train_batch_size=8, max_steps=3, async_grpo=True, queue_maxsize=64)
    return short_run_config(tmp_path, **(run | overrides))


class VersionsTrained(GRPOTrainer):
    """Records, for every training micro-batch, the step and each episode's version.

    Also checks that the loss's old logprobs are the sampler's: the policy that played them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[tuple[int, list[int]]] = []

    def _prepare_inputs(self, rows):
        batch = super()._prepare_inputs(rows)
        if self.model.training:
            assert torch.equal(batch.old_logprobs_B_C, batch.sampler_logprobs_B_C)
            versions_N = self._async.generation.last_versions_N
            episodes = batch.episode_B.tolist()
            self.trained.append((self.state.global_step, [versions_N[e] for e in episodes]))
        return batch


class SlowLearner(TrainerCallback):
    """Holds the learner after each step, before the weight push, while the producer plays on."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def test_the_buffer_drops_whole_stale_groups_and_counts_their_episodes():
    buffer = GroupBuffer(max_episodes=8)
    for version in (0, 1, 2, 1):
        assert buffer.put(group(version))
    taken = buffer.take(2, oldest_version=1)
    assert [g.version for g in taken] == [1, 2]
    assert buffer.dropped_episodes == 2  # the version-0 group
    assert buffer.episodes == 2  # the last version-1 group waits


def test_a_full_buffer_holds_the_producer_until_the_learner_takes():
    buffer = GroupBuffer(max_episodes=4)
    assert buffer.put(group(0)) and buffer.put(group(0))
    returned = threading.Event()
    thread = threading.Thread(target=lambda: buffer.put(group(1)) and returned.set())
    thread.start()
    assert not returned.wait(0.2)  # full: the third group waits
    buffer.take(1, oldest_version=0)
    assert returned.wait(30)
    thread.join(30)
    assert buffer.episodes == 4


def test_a_failed_producer_is_raised_in_the_waiting_learner():
    buffer = GroupBuffer(max_episodes=4)
    threading.Timer(0.1, buffer.fail, [ValueError("tool exploded")]).start()
    with pytest.raises(ValueError, match="tool exploded"):
        buffer.take(1, oldest_version=0)


def test_a_ctrl_c_that_lands_as_the_learner_starts_waiting_is_raised_before_a_group_comes():
    """`_thread.interrupt_main` trips the SIGINT handler without waking a blocked lock wait:
    what a real SIGINT that lands just before the learner blocks leaves behind."""
    buffer = GroupBuffer(max_episodes=4)
    rescued = threading.Event()

    def rescue() -> None:  # without the periodic wake, the learner waits until here
        rescued.set()
        buffer.put(group(0))

    timers = [threading.Timer(0.2, _thread.interrupt_main), threading.Timer(60, rescue)]
    gc.disable()  # a gc callback would swallow the KeyboardInterrupt (test_async_resume.py)
    try:
        with pytest.raises(KeyboardInterrupt):  # wherever the Ctrl-C lands
            for timer in timers:
                timer.start()
            buffer.take(1, oldest_version=0)
    finally:
        gc.enable()
        for timer in timers:
            timer.cancel()
    assert not rescued.is_set()


def test_a_reward_function_that_raises_stops_an_async_run_naming_it(tokenizer, tmp_path):
    def broken_reward(completions, **kwargs):
        raise KeyError("answer")

    args = config(tmp_path)
    trainer = GRPOTrainer(
        tiny_llama(tokenizer), broken_reward, args, PROMPTS, processing_class=tokenizer
    )
    with pytest.raises(RewardFunctionError, match="broken_reward"):
        trainer.train()
    assert not trainer._async.generation._thread.is_alive()


def test_a_producer_that_fails_while_the_learner_trains_stops_the_run(tokenizer, tmp_path):
    # The learner is busy (SlowLearner) when the reward function raises: the producer stops,
    # and the next round raises its error rather than starting a new producer past it.
    calls = []

    def flaky_reward(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 3:
            raise KeyError("answer")
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        flaky_reward,
        config(tmp_path, max_steps=6),
        PROMPTS,
        processing_class=tokenizer,
        callbacks=[SlowLearner(1.0)],
    )
    with pytest.raises(RewardFunctionError, match="flaky_reward"):
        trainer.train()
    assert trainer.state.global_step < 6


def test_the_async_option_of_agentgrpo_run_sets_async_grpo():
    import argparse

    from agentgrpo.cli.options import add_config_options, config_overrides

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    overrides = config_overrides(parser.parse_args(["--async", "--max-staleness", "2"]))
    assert overrides == {"async_grpo": True, "max_staleness": 2}


def test_a_closed_buffer_refuses_groups_and_stops_a_waiting_learner():
    buffer = GroupBuffer(max_episodes=4)
    buffer.close()
    assert not buffer.put(group(0))
    with pytest.raises(ProducerFailed, match="stopped"):
        buffer.take(1, oldest_version=0)


def test_no_trained_episode_is_older_than_max_staleness_when_the_learner_is_slow(
    tokenizer, tmp_path
):
    args = config(tmp_path, max_staleness=0)
    trainer = VersionsTrained(
        tiny_llama(tokenizer),
        rank_in_call,
        args,
        PROMPTS,
        processing_class=tokenizer,
        callbacks=[SlowLearner(2.0)],
    )
    trainer.train()
    assert [step for step, _ in trainer.trained] == [0, 1, 2]
    for step, versions in trainer.trained:
        assert all(step - version <= 0 for version in versions), (step, versions)
    # Two seconds of learner sleep per step: the producer, done with the groups the old weights
    # may play, waits for the push instead of playing groups that would be dropped.
    assert all(held > 0 for held in logged(trainer, "perf/generation_held_s")[1:])
    assert logged(trainer, "sample/dropped_stale_total") == [0.0, 0.0, 0.0]
    assert logged(trainer, "sample/staleness_max") == [0.0, 0.0, 0.0]
    for name in ("rollout/queue_size", "perf/rollout_wait_s", "perf/weight_sync_pause_s"):
        assert len(logged(trainer, name)) == 3, name
    assert len(logged(trainer, "perf/weight_sync_s")) == 3
    for record in trainer.last_records:  # every sampled token carries its weights' version
        for row in record.episode.rows:
            assert row.policy_versions is not None
            assert {v for v, m in zip(row.policy_versions, row.loss_mask, strict=True) if m} == {2}


def test_several_iterations_per_round_train_within_the_staleness_bound(tokenizer, tmp_path):
    args = config(tmp_path, num_iterations=2, max_staleness=2, max_steps=4)
    model = tiny_llama(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = VersionsTrained(model, rank_in_call, args, PROMPTS, processing_class=tokenizer)
    trainer.train()
    assert [step for step, _ in trainer.trained] == [0, 1, 2, 3]
    for step, versions in trainer.trained:
        assert all(step - version <= 2 for version in versions), (step, versions)
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_what_reward_functions_log_is_reported_beside_the_episodes_it_was_logged_for(
    tokenizer, tmp_path
):
    def echo(completions, log_extra, log_metric, **kwargs):
        log_extra("seen", list(completions))
        log_metric("group_size", float(len(completions)))
        return [float(i) for i in range(len(completions))]

    args = config(tmp_path, log_completions=True, num_completions_to_print=0)
    trainer = GRPOTrainer(tiny_llama(tokenizer), echo, args, PROMPTS, processing_class=tokenizer)
    trainer.train()
    table = trainer.last_completions
    assert len(table) >= 2 * args.num_generations  # a round of more than one group
    # Groups are played one row at a time, ahead of the learner: each group's column comes
    # back in the row of its own completions.
    assert table.extra["seen"] == list(table.completions)
    assert logged(trainer, "group_size") == [4.0, 4.0, 4.0]


def test_async_settings_that_could_never_train_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_staleness=0 is below 1"):
        config(tmp_path, max_staleness=0, weight_sync_steps=2)
    with pytest.raises(ValueError, match="queue_maxsize=2 cannot hold one group"):
        config(tmp_path, queue_maxsize=2)
    with pytest.raises(ValueError, match="not a colocated vLLM"):
        config(tmp_path, use_vllm=True, vllm_mode="colocate")
    config(tmp_path, use_vllm=True, vllm_mode="server")  # a vLLM server generates


def test_trls_async_names_train_asynchronously(tokenizer, tmp_path):
    from agentgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    fields = config(tmp_path).to_dict()
    args = AsyncGRPOConfig(**{k: v for k, v in fields.items() if k in ("output_dir", "use_cpu")})
    assert args.async_grpo and args.max_staleness == 4 and args.weight_sync_steps == 1
    with pytest.raises(ValueError, match="async_grpo=False"):
        AsyncGRPOTrainer(
            tiny_llama(tokenizer),
            rank_in_call,
            config(tmp_path, async_grpo=False),
            PROMPTS,
            processing_class=tokenizer,
        )
    with pytest.raises(TypeError, match="did you mean 'max_staleness'"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_stalenes=2)


def test_a_second_train_call_starts_a_new_producer(tokenizer, tmp_path):
    args = config(tmp_path, max_steps=1)
    trainer = GRPOTrainer(
        tiny_llama(tokenizer), rank_in_call, args, PROMPTS, processing_class=tokenizer
    )
    trainer.train()
    first = trainer._async.generation._thread
    trainer.args.max_steps = 2
    trainer.train(resume_from_checkpoint=None)
    assert (
        trainer._async.generation._thread is not first
        and not trainer._async.generation._thread.is_alive()
    )
    assert trainer.state.global_step == 2


def test_a_rollout_func_is_refused_in_async_mode(tokenizer, tmp_path):
    def rollout_func(prompts, trainer):
        return {}

    with pytest.raises(ValueError, match="rollout_func or an agent cannot run asynchronously"):
        GRPOTrainer(
            tiny_llama(tokenizer),
            rank_in_call,
            config(tmp_path),
            PROMPTS,
            processing_class=tokenizer,
            rollout_func=rollout_func,
        )
