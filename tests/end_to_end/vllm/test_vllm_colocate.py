"""vLLM in the trainer's process, for real on CPU: tool episodes, logprobs, weight pushes, GRPO."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import pytest

from agentgrpo.generation.weight_sync import ColocatedPush
from environments import Counter
from rollout import EpisodeConfig, Finish, GenerationBackend, RolloutEngine, SamplingParams
from rollout.backends.vllm_colocate import VLLMColocateBackend
from tests.support.episodes import (
    COUNTER_ROW,
    counter_segments,
    scripted_episode,
    single_row,
    tool_call,
)
from tests.support.vllm_support import (
    VLLM_CPU_ENVIRONMENT,
    colocated_backend,
    load_policy,
    logprob_gap,
    needs_vllm,
    play_on_final_weights,
    train_two_steps,
    trained_copy,
    untaught_model_path,
    vllm_counter_engine,
)

pytestmark = [*needs_vllm, pytest.mark.process]


@pytest.fixture(scope="module")
def untaught_path(tmp_path_factory, tokenizer):
    return untaught_model_path(tmp_path_factory, tokenizer)


@pytest.fixture(scope="module")
def backend(vllm_environment, policy, tokenizer):
    """One in-process engine for the module, started from the policy held in memory."""
    return colocated_backend(policy, tokenizer, max_model_len=2048)


def test_the_colocated_backend_is_a_generation_backend_stopping_on_eos(backend, tokenizer):
    assert isinstance(backend, GenerationBackend)
    assert tokenizer.eos_token_id in backend.stop_token_ids


def test_a_tool_episode_through_colocated_vllm_is_token_exact(backend, tokenizer):
    [episode] = anyio.run(vllm_counter_engine(backend, tokenizer, 0.0).run, [COUNTER_ROW])
    segments = counter_segments(tokenizer)
    assert single_row(episode).completion_ids == [t for ids, _ in segments for t in ids]
    assert single_row(episode).loss_mask == [m for ids, m in segments for _ in ids]
    assert episode.finish is Finish.STOP and episode.env_reward == 1.0
    assert episode.stats.tool_calls == 2 and episode.stats.tool_failures == 0


def test_vllm_sampled_logprobs_match_the_policy_forward_pass(backend, tokenizer, policy):
    episodes = anyio.run(vllm_counter_engine(backend, tokenizer, 0.7).run, [COUNTER_ROW], 4)
    assert logprob_gap(policy, episodes, temperature=0.7) < 1e-3


def test_a_short_request_finishes_while_a_long_one_still_runs(backend):
    # A second front-end on the module's engine (used alone here) that cannot sample a stop id.
    no_stop = {"allowed_token_ids": list(range(100, 200))}
    endless = VLLMColocateBackend(backend.llm, backend.stop_token_ids, no_stop)
    finished: list[str] = []

    async def request(name: str, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7)
        completion = await endless.generate([1, 520, 33, 8], params)
        finished.append(f"{name}:{len(completion.token_ids)}")

    async def short_once_long_runs() -> None:
        # Poll (the backend has no event for it) until the long request is inside vLLM.
        while not endless._running:  # noqa: ASYNC110
            await anyio.sleep(0.01)
        await request("short", 2)

    async def both() -> None:
        with anyio.fail_after(300):  # a generous bound: only "never hangs" is claimed here
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request, "long", 400)
                tasks.start_soon(short_once_long_runs)

    anyio.run(both)
    assert finished == ["short:2", "long:400"]


def test_a_pushed_training_step_moves_vllm_to_the_new_weights(backend, tokenizer, policy):
    engine = vllm_counter_engine(backend, tokenizer, 0.7)
    anyio.run(engine.run, [COUNTER_ROW], 2)  # caches the prompt's KV under the old weights
    other = scripted_episode(tokenizer, [tool_call("increment", step=5), "Done."])
    updated = trained_copy(policy, other)
    sync = ColocatedPush(backend, sleeps=False)
    try:
        started = time.perf_counter()
        with sync.generating(updated, step=1):
            push_s = time.perf_counter() - started
            episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
        print(f"colocated push: {push_s:.2f} s")
        assert logprob_gap(updated, episodes, temperature=0.7) < 1e-3
        assert logprob_gap(policy, episodes, temperature=0.7) > 1e-2
    finally:
        backend.load_weights(policy.state_dict().items())


def test_grpo_trains_with_colocated_vllm_and_pushes_every_step(
    vllm_environment,
    untaught_path,
    tokenizer,
    tmp_path,
):
    trainer = train_two_steps(
        untaught_path, tokenizer, tmp_path, vllm_mode="colocate", vllm_max_model_length=1024
    )
    assert trainer.generator.version == 1  # the second round ran on step 1's weights
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert [e["frac_reward_zero_std"] for e in steps] == [0.0, 0.0]  # no tied group, by design
    assert all(e["grad_norm"] > 0 for e in steps)
    model, episodes = play_on_final_weights(trainer)
    assert logprob_gap(model, episodes, temperature=1.0) < 1e-3
    assert logprob_gap(load_policy(untaught_path), episodes, temperature=1.0) > 1e-2


@pytest.mark.slow
def test_smollm2_through_colocated_vllm_matches_its_forward_before_and_after_a_push(
    vllm_environment,
    smollm2_path,
    tokenizer,
):
    smollm2 = load_policy(smollm2_path)
    smollm2_backend = colocated_backend(smollm2, tokenizer, max_model_len=1024)
    engine = RolloutEngine(
        smollm2_backend,
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=48, max_turns=2, temperature=1.0),
    )
    episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
    assert logprob_gap(smollm2, episodes, temperature=1.0) < 1e-3
    updated = trained_copy(smollm2, episodes[0], steps=1)
    # As a saved tied checkpoint is: without lm_head.weight, so the head must be re-packed.
    smollm2_backend.load_weights(
        (name, tensor) for name, tensor in updated.state_dict().items() if name != "lm_head.weight"
    )
    episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
    assert logprob_gap(updated, episodes, temperature=1.0) < 1e-3
    assert logprob_gap(smollm2, episodes, temperature=1.0) > 1e-2


def test_agentgrpo_run_with_use_vllm(policy_path, tmp_path):
    """The command a user types: a short colocated-vLLM run on CPU, as a real subprocess."""
    environment = {**os.environ, **VLLM_CPU_ENVIRONMENT, "VLLM_CACHE_ROOT": str(tmp_path / "c")}
    command = [sys.executable, "-m", "agentgrpo", "run", "env:Counter", "--use-vllm"]
    command += ["--model", str(policy_path), "--chat-template", "chatml_tools"]
    command += ["--max-steps", "2", "--per-device-train-batch-size", "4", "--num-generations", "2"]
    command += ["--vllm-max-model-length", "512", "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # vLLM left its groups first
    assert "generation   vLLM (colocate)" in result.stdout
    logged = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert sum('"reward"' in line for line in logged) == 2
