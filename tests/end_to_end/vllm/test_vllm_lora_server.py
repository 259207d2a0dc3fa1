"""Adapter-only LoRA pushes to a real `agentgrpo vllm-serve --enable-lora` server on CPU.

The server's LoRA limits are read, the adapter it serves gives the trained policy's logprobs,
and a push loads a new version beside the old one: an episode that started on the old version
goes on with it, a new one starts on the new version, and each token says which drew it. An
asynchronous GRPO run of a LoRA policy pushes only its adapter to the server after each step.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess

import anyio
import pytest
import torch
from peft import LoraConfig, get_peft_model

from agentgrpo.generation.adapters import AdapterPush, LoraLimits
from agentgrpo.generation.vllm_serve import _parser, serve_command, serve_environment
from agentgrpo.generation.weight_sync import ServedWeights, ServerPush
from rollout.backends.vllm_server import ServerConnection, ServerUnavailableError, VLLMServerBackend
from rollout.types import SamplingParams
from tests.support.episodes import COUNTER_ROW
from tests.support.vllm_support import (
    SERVER_START_TIMEOUT_S,
    SINGLE_PROCESS,
    VLLM_CPU_ENVIRONMENT,
    free_port,
    load_policy,
    logprob_gap,
    needs_vllm,
    play_on_final_weights,
    train_two_steps,
    untaught_model_path,
    vllm_counter_engine,
    without_multiprocessing_flag,
)

pytestmark = [*needs_vllm, pytest.mark.process, pytest.mark.slow]

PROMPT = [1, 520, 33, 8, 1034, 77]


@pytest.fixture(scope="module")
def server(policy_path, tmp_path_factory):
    """`agentgrpo vllm-serve --model <tiny> --enable-lora --max-lora-rank 8 --max-loras 2`."""
    port = free_port()
    options, passthrough = _parser().parse_known_args(
        ["--model", str(policy_path), "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "2048", "--disable-log-stats"]
        + ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    )
    environment = {**without_multiprocessing_flag(), **serve_environment(), **VLLM_CPU_ENVIRONMENT}
    environment["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-lora-cache"))
    log = tmp_path_factory.mktemp("vllm-lora-server") / "server.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            serve_command(options, passthrough),
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    connection = ServerConnection(f"http://127.0.0.1:{port}", timeout_s=SERVER_START_TIMEOUT_S)
    try:
        yield connection, log
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def lora_policy(policy_path):
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(load_policy(policy_path), lora).eval()


@pytest.fixture(scope="module")
def served(vllm_environment, server, tokenizer):
    connection, log = server
    try:
        backend = VLLMServerBackend.connect(connection, stop_token_ids={tokenizer.eos_token_id})
    except ServerUnavailableError as error:
        raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}") from error
    transport = ServerPush(connection, free_port())
    return ServedWeights(backend, transport, SINGLE_PROCESS, AdapterPush(backend, keep=2))


def test_the_servers_lora_limits_are_read_from_its_workers(served):
    assert served.transport.lora_limits() == LoraLimits(max_lora_rank=8, max_loras=2)


def test_the_served_adapter_gives_the_trained_policys_logprobs(served, lora_policy, tokenizer):
    with served.generating(lora_policy, 0):
        engine = vllm_counter_engine(served.backend, tokenizer, temperature=0.7)
        episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
    assert logprob_gap(lora_policy, episodes, temperature=0.7) < 1e-3
    rows = [row for episode in episodes for row in episode.rows]
    assert {v for row in rows for v in row.policy_versions or [] if v >= 0} == {0}


def test_an_episode_started_before_a_push_finishes_on_its_version(served, lora_policy):
    old = copy.deepcopy(lora_policy)
    with torch.no_grad():  # the learner's next step
        for name, parameter in lora_policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.5)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    seen = {}

    async def episode(name: str, started: anyio.Event, pushed: anyio.Event | None) -> None:
        first = await served.backend.generate(PROMPT, params)
        started.set()
        if pushed is not None:
            await pushed.wait()
        second = await served.backend.generate(PROMPT, params)
        seen[name] = (first, second)

    async def main() -> None:
        started, pushed = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(episode, "old", started, pushed)
            await started.wait()  # its first turn drawn with version 0
            await served.push(lora_policy, 1)
            pushed.set()
            tasks.start_soon(episode, "new", anyio.Event(), None)

    anyio.run(main)
    assert [a.version for a in served.adapters.versions.loaded] == [0, 1]
    for name, model, version in (("old", old, 0), ("new", lora_policy, 1)):
        for completion in seen[name]:
            assert completion.versions == [version] * len(completion.token_ids)
            assert _gap(model, PROMPT, completion) < 1e-3


def _gap(model, prompt: list[int], completion) -> float:
    """Mean |sampled logprob - `model`'s| over a completion sampled at temperature 1."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    forward = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return (forward - torch.tensor(completion.logprobs)).abs().mean().item()


def test_async_grpo_of_a_lora_policy_pushes_only_its_adapter_to_the_server(
    server, served, tokenizer, tmp_path_factory, tmp_path
):
    # `served` first: the server holds another run's adapters, whose names must not clash.
    connection, _ = server
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = train_two_steps(
        untaught_model_path(tmp_path_factory, tokenizer),
        tokenizer,
        tmp_path,
        peft_config=lora,
        vllm_mode="server",
        vllm_server_base_url=connection.base_url,
        vllm_server_timeout=300,
        vllm_group_port=free_port(),
        vllm_lora_push="adapter",
        async_grpo=True,
        max_staleness=1,
    )
    weights = trainer._async.generation.weights
    assert weights.version == 2  # pushed after each of the 2 steps
    assert [a.version for a in weights.adapters.versions.loaded] == [1, 2]  # max_staleness + 1
    base_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert 0 < weights.adapters.pushed_bytes < base_bytes / 20  # the adapter, not the model
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert len(steps) == 2 and all("sample/staleness_max" in e for e in steps)
    model, episodes = play_on_final_weights(trainer)  # through the served newest adapter
    assert logprob_gap(model, episodes, temperature=1.0) < 1e-3
