"""A real vLLM server on CPU (`agentgrpo vllm-serve`'s command): episodes, pushes, failures.

One server for the module, with LoRA enabled; the last test stops it on purpose. Whole-weight
pushes reach it, and so do a LoRA policy's adapter-only pushes: its limits are read, the adapter
it serves gives the policy's logprobs, and a push loads a new version beside the old one (an
episode started on the old version goes on with it; each token says which version drew it).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import anyio
import pytest
import torch
from peft import LoraConfig

from agentgrpo import GRPOTrainer
from agentgrpo.generation.adapters import AdapterPush, FrozenAdapter, LoraLimits
from agentgrpo.generation.vllm_serve import _parser, serve_command, serve_environment
from agentgrpo.generation.weight_sync import ServedWeights, ServerPush, policy_weights
from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine
from rollout.backends.server_guard import KEY_VARIABLE
from rollout.backends.vllm_server import ServerConnection, ServerUnavailableError, VLLMServerBackend
from rollout.types import SamplingParams
from tests.support.episodes import (
    COUNTER_ROW,
    counter_segments,
    scripted_episode,
    single_row,
    tool_call,
)
from tests.support.launch import (
    CONFIGS,
    CPU_ENV,
    FLOAT32_LAUNCH,
    accelerate_launch,
    launch_report,
)
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
    trained_copy,
    untaught_model_path,
    vllm_counter_engine,
    without_multiprocessing_flag,
)

pytestmark = [*needs_vllm, pytest.mark.process]

PROMPT = [1, 520, 33, 8, 1034, 77]


@pytest.fixture(scope="module")
def server_key():
    """The server's key, set in this process's environment too: every connection sends it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_VARIABLE, "the-key-of-the-server-tests")
        yield os.environ[KEY_VARIABLE]


@pytest.fixture(scope="module")
def server(policy_path, tmp_path_factory, server_key):
    """`agentgrpo vllm-serve --model <tiny> --enable-lora ...` with a key, as a child process;
    yields it with its URL."""
    port = free_port()
    options, passthrough = _parser().parse_known_args(
        ["--model", str(policy_path), "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "2048", "--host", "127.0.0.1", "--disable-log-stats"]
        + ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    )
    environment = {**without_multiprocessing_flag(), **serve_environment(), **VLLM_CPU_ENVIRONMENT}
    environment["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-server-cache"))
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            serve_command(options, passthrough),
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine process too goes with the group at the end
        )
    process.url = f"http://127.0.0.1:{port}"
    process.log = log
    yield process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def backend(server, tokenizer):
    try:
        return VLLMServerBackend.connect(
            ServerConnection(server.url, timeout_s=SERVER_START_TIMEOUT_S),
            stop_token_ids={tokenizer.eos_token_id},
        )
    except ServerUnavailableError as error:
        log = server.log.read_text()[-3000:]
        raise AssertionError(f"the server did not start:\n{log}") from error


def test_without_the_key_no_endpoint_answers_the_weight_endpoints_included(backend, server):
    """What an anonymous client tried: joining the weight group and pushing its own weights."""
    join = {"method": "agentgrpo_join", "args": [json.dumps({"port": free_port()})]}
    for headers in ({}, {"Authorization": "Bearer a-guess"}):
        for path, body in [("/collective_rpc", join), ("/pause", {}), ("/v1/completions", {})]:
            request = urllib.request.Request(
                server.url + path, json.dumps(body).encode(), headers=headers
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401, path
    assert backend.connection.get("/v1/models")["data"]  # the key opens the door


def test_a_tool_episode_through_the_vllm_server_is_token_exact(backend, tokenizer):
    [episode] = anyio.run(vllm_counter_engine(backend, tokenizer, 0.0).run, [COUNTER_ROW])
    segments = counter_segments(tokenizer)
    assert single_row(episode).completion_ids == [t for ids, _ in segments for t in ids]
    assert single_row(episode).loss_mask == [m for ids, m in segments for _ in ids]
    assert episode.finish is Finish.STOP and episode.env_reward == 1.0


def test_server_sampled_logprobs_match_the_policy_forward_pass(backend, tokenizer, policy):
    episodes = anyio.run(vllm_counter_engine(backend, tokenizer, 0.7).run, [COUNTER_ROW], 4)
    assert logprob_gap(policy, episodes, temperature=0.7) < 1e-3


def test_agentgrpo_eval_generates_through_the_server(
    server, backend, policy_path, tmp_path, capsys
):
    """Generation-only work needs no model in the process: `agentgrpo eval --server-url`."""
    from agentgrpo.cli import main

    rows = tmp_path / "rows.jsonl"  # the row the policy was taught: increment 3, 4, "Done."
    rows.write_text(json.dumps(COUNTER_ROW) + "\n")
    argv = ["eval", "env:Counter", "--model", str(policy_path), "--server-url", server.url]
    argv += ["--dataset", str(rows), "--temperature", "0", "--max-turns", "5"]
    argv += ["--chat-template", "chatml_tools"]  # the folder keeps SmolLM2's tool-less template
    assert main([*argv, "--max-completion-length", "256"]) == 0
    figures = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:8])
    assert figures["episodes"] == "1" and float(figures["success_rate"]) == 1.0
    assert float(figures["tool_call_rate"]) == 1.0 and float(figures["mean_turns"]) == 3.0


@pytest.fixture(scope="module")
def served(vllm_environment, backend, tokenizer):
    """The server's weights, taking a LoRA policy's pushes as adapters (2 versions kept).

    Its own backend: the one it serves from asks for the newest adapter, the module's none.
    """
    own = VLLMServerBackend.connect(backend.connection, stop_token_ids={tokenizer.eos_token_id})
    transport = ServerPush(backend.connection, free_port())
    return ServedWeights(own, transport, SINGLE_PROCESS, AdapterPush(own, keep=2))


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


def test_a_snapshot_is_a_frozen_adapter_the_server_serves_beside_the_policys(served, lora_policy):
    snapshot = copy.deepcopy(lora_policy)
    frozen = FrozenAdapter(served.adapters, lora_policy, version=1)
    with torch.no_grad():  # the learner's next step
        for name, parameter in lora_policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.0)
    anyio.run(served.push, lora_policy, 2)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)

    async def one_game() -> list:  # the policy's and the snapshot's turns in one task
        turns = [served.backend, frozen.backend, served.backend]
        return [await backend.generate(PROMPT, params) for backend in turns]

    policy_turn, snapshot_turn, again = anyio.run(one_game)
    assert _gap(lora_policy, PROMPT, policy_turn) < 1e-3 and _gap(lora_policy, PROMPT, again) < 1e-3
    assert _gap(snapshot, PROMPT, snapshot_turn) < 1e-3 < _gap(lora_policy, PROMPT, snapshot_turn)

    def names() -> set[str]:  # the models the server serves: adapters by name
        return {card["id"] for card in served.backend.connection.get("/v1/models")["data"]}

    assert frozen.adapter.name in names()
    old = frozen.adapter
    frozen.load(lora_policy, 2)  # a refresh: the new one in, the old one out
    assert frozen.adapter.name in names() and old.name not in names()
    assert [a.version for a in served.adapters.versions.loaded] == [1, 2]  # never evicted by it
    served.backend.unload_adapter(frozen.adapter)  # the module's later tests hold none
    assert frozen.adapter.name not in names()


def _gap(model, prompt: list[int], completion) -> float:
    """Mean |sampled logprob - `model`'s| over a completion sampled at temperature 1."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    forward = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return (forward - torch.tensor(completion.logprobs)).abs().mean().item()


def test_a_pushed_training_step_reaches_the_server(backend, tokenizer, policy):
    engine = vllm_counter_engine(backend, tokenizer, 0.7)
    anyio.run(engine.run, [COUNTER_ROW], 2)  # caches the prompt's KV under the old weights
    other = scripted_episode(tokenizer, [tool_call("increment", step=5), "Done."])
    updated = trained_copy(policy, other)
    sync = ServerPush(backend.connection, free_port())
    served = ServedWeights(backend, sync, SINGLE_PROCESS)
    try:
        for step in (1, 2):  # the first push also forms the group
            started = time.perf_counter()
            with served.generating(updated, step):
                print(f"server push {step}: {time.perf_counter() - started:.2f} s")
        episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
        assert logprob_gap(updated, episodes, temperature=0.7) < 1e-3
        assert logprob_gap(policy, episodes, temperature=0.7) > 1e-2
    finally:
        with policy_weights(policy) as weights:
            sync.push(weights, policy.device)


def test_long_seeded_prompts_arriving_together_leave_the_cpu_engine_running(backend, tokenizer):
    """More prompt tokens at once than a step's budget: vLLM's CPU engine died on the seeded
    request split over two steps, until `agentgrpo vllm-serve` turned chunked prefill off."""
    words = tokenizer("one two three four five six seven " * 300)["input_ids"][:1500]

    async def twelve_at_once():
        async with anyio.create_task_group() as tasks:
            for seed in range(12):  # distinct prompts: no prefix is cached
                params = SamplingParams(max_tokens=4, seed=seed)
                tasks.start_soon(backend.generate, [seed + 10, *words], params)

    anyio.run(twelve_at_once)  # 12 x 1501 prompt tokens
    assert len(anyio.run(backend.generate, words, SamplingParams(max_tokens=2)).token_ids) >= 1


def test_a_push_mid_turn_cuts_it_and_continues_it_with_the_new_weights(backend, tokenizer, policy):
    """A long turn is cut by a push, then continued: each token's logprob is its own weights'
    (the served policy's before the cut, the pushed copy's after it).

    When the push lands is the machine's speed: an idle one can finish the turn before it, a
    loaded one may not have started it. A try that misses the turn is played again with the push
    sooner or later, so what is checked never depends on how busy the machine is.
    """
    other = scripted_episode(tokenizer, [tool_call("increment", step=5), "Done."])
    updated = trained_copy(policy, other)
    sync = ServerPush(backend.connection, free_port())
    rare = tokenizer.vocab_size - 1  # the only stop id: the turn runs its whole budget
    long_turns = VLLMServerBackend(
        backend.connection, backend.model, {rare}, sampling_overrides={"ignore_eos": True}
    )
    prompt = tokenizer("Count on and on:")["input_ids"]
    params = SamplingParams(max_tokens=1500, temperature=1.0, seed=3)

    def push() -> None:
        with policy_weights(updated) as weights:
            sync.push(weights, updated.device)

    async def push_while_generating(delay_s: float):
        completions = []

        async def generate():
            completions.append(await long_turns.generate(prompt, params))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(generate)
            await anyio.sleep(delay_s)
            await long_turns.between_steps(push, 1)
        return completions[0]

    delay_s = 0.5
    for _ in range(8):
        long_turns.set_weights_version(0)
        try:
            completion = anyio.run(push_while_generating, delay_s)
        finally:
            with policy_weights(policy) as weights:
                sync.push(weights, policy.device)
        if set(completion.versions) == {0, 1}:
            break
        delay_s = delay_s / 4 if 1 not in completion.versions else delay_s * 2
    cut = completion.versions.index(1)
    assert 0 < cut < len(completion.token_ids) == 1500
    assert completion.versions == [0] * cut + [1] * (1500 - cut)
    ids = torch.tensor([prompt + completion.token_ids])
    for model, drawn in ((policy, slice(0, cut)), (updated, slice(cut, None))):
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        forward = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        sampled = torch.tensor(completion.logprobs)
        assert (forward[drawn] - sampled[drawn]).abs().mean() < 1e-3


def served_by(server) -> dict:
    """The config fields of a run that generates with `server`."""
    return dict(
        vllm_mode="server",
        vllm_server_base_url=server.url,
        vllm_server_timeout=300,  # per call; only "never hangs" is claimed
        vllm_group_port=free_port(),
    )


def test_grpo_trains_against_the_server_and_pushes_every_step(
    server, backend, tokenizer, tmp_path_factory, tmp_path
):
    # The first push replaces the served policy: any model of the same shape can train here.
    untaught_path = untaught_model_path(tmp_path_factory, tokenizer)
    trainer = train_two_steps(untaught_path, tokenizer, tmp_path, **served_by(server))
    assert trainer.generator.version == 1
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert [e["frac_reward_zero_std"] for e in steps] == [0.0, 0.0]  # no tied group, by design
    assert all(e["grad_norm"] > 0 for e in steps)
    model, episodes = play_on_final_weights(trainer)
    assert logprob_gap(model, episodes, temperature=1.0) < 1e-3
    assert logprob_gap(load_policy(untaught_path), episodes, temperature=1.0) > 1e-2


class TrainedVersions(GRPOTrainer):
    """Keeps, per training step, the weights version of every sampled token it trains on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[tuple[int, list[int | None]]] = []

    def _prepare_inputs(self, rows):
        batch = super()._prepare_inputs(rows)
        if self.model.training:
            versions = [
                v
                for episode in self._round.episodes
                for row in episode.rows
                for v, sampled in zip(
                    row.policy_versions or [None] * len(row.loss_mask), row.loss_mask, strict=True
                )
                if sampled
            ]
            self.trained.append((self.state.global_step, versions))
        return batch


def test_async_grpo_of_a_lora_policy_pushes_only_its_adapter_between_its_requests(
    server, backend, served, tokenizer, tmp_path_factory, tmp_path
):
    # `served` first: the server holds another run's adapters, whose names must not clash.
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = train_two_steps(
        untaught_model_path(tmp_path_factory, tokenizer),
        tokenizer,
        tmp_path,
        trainer_class=TrainedVersions,
        peft_config=lora,
        **served_by(server),
        vllm_lora_push="adapter",
        async_grpo=True,
        max_staleness=1,
    )
    weights = trainer._async.generation.weights
    assert weights.version == 2  # pushed after each of the 2 steps
    assert [a.version for a in weights.adapters.versions.loaded] == [1, 2]  # max_staleness + 1
    base_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert 0 < weights.adapters.pushed_bytes < base_bytes / 20  # the adapter, not the model
    assert {step for step, _ in trainer.trained} == {0, 1}
    for step, versions in trainer.trained:  # every trained token tagged, none too stale
        assert versions and all(v is not None and 0 <= step - v <= 1 for v in versions)
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert len(steps) == 2
    assert all(e["grad_norm"] > 0 and "sample/staleness_max" in e for e in steps)
    model, episodes = play_on_final_weights(trainer)  # through the served newest adapter
    assert logprob_gap(model, episodes, temperature=1.0) < 1e-3


class EvaluatedVersions(GRPOTrainer):
    """Keeps the step and the served weights' version at the end of every evaluation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evaluated: list[tuple[int, int]] = []

    def evaluate(self, *args, **kwargs):
        metrics = super().evaluate(*args, **kwargs)
        self.evaluated.append((self.state.global_step, self._async.generation.weights.version))
        return metrics


def test_an_async_evaluation_first_brings_the_shared_server_to_the_learners_step(
    server, backend, tokenizer, tmp_path_factory, tmp_path
):
    # Pushes every 2 steps, evaluation after every step: at step 1 the server still holds the
    # weights of step 0, and the evaluation must push the learner's (through the producer).
    trainer = train_two_steps(
        untaught_model_path(tmp_path_factory, tokenizer),
        tokenizer,
        tmp_path,
        trainer_class=EvaluatedVersions,
        eval_rows=2,
        **served_by(server),
        async_grpo=True,
        max_staleness=1,
        weight_sync_steps=2,
    )
    assert trainer.evaluated == [(1, 1), (2, 2)]
    evaluations = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert [e["step"] for e in evaluations] == [1, 2]


@pytest.mark.parametrize(
    ("engine", "engine_args"),
    [
        pytest.param(
            "deepspeed_zero3",
            [],
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"
            ),
        ),
        ("fsdp2", ["--fsdp-over-gloo"]),  # accelerate's FSDP2 on CPU: see distributed_train.py
    ],
)
def test_a_sharded_run_over_two_processes_pushes_its_whole_weights_to_the_server(
    engine, engine_args, server, backend, tokenizer, tmp_path_factory, tmp_path
):
    # Each process holds a shard of every weight; the push must send the gathered whole ones.
    untaught_path = untaught_model_path(tmp_path_factory, tokenizer)
    script_args = [str(untaught_path), str(tmp_path), "--vllm-server", server.url]
    script_args += ["--vllm-group-port", str(free_port()), *engine_args]
    returncode, output = accelerate_launch(
        CONFIGS / f"{engine}.yaml", 2, script_args, CPU_ENV, FLOAT32_LAUNCH
    )
    assert returncode == 0, launch_report(output)
    # vLLM generates: the shards are gathered for each push only, not held whole for the round.
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("process_*.json"))]
    assert len(reports) == 2
    for report in reports:
        assert report["whole_while_scoring"] and not any(report["whole_while_scoring"])
    trained = load_policy(untaught_path)
    # Three pushes (steps 0, 1, 2), each gathering one tensor at a time and letting it go before
    # the next. The first starts from shards: never more than one parameter whole beyond those
    # whole at rest (ZeRO-3 keeps small ones whole; FSDP2 all-gathers each into a new tensor,
    # its parameters stay shards). The later ones start from the weights as the step left them
    # (under ZeRO-3 every parameter was still whole, measured) and never add to them.
    counts = reports[0]["whole_count_while_pushing"]
    per_push = len(trained.state_dict())
    pushes = [counts[start : start + per_push] for start in range(0, len(counts), per_push)]
    assert len(pushes) == 3 and len(pushes[-1]) == per_push
    assert max(pushes[0]) <= min(reports[0]["whole_count_while_scoring"]) + 1
    assert all(later <= earlier for push in pushes for earlier, later in itertools.pairwise(push))
    trained.load_state_dict(torch.load(tmp_path / "weights.pt"), strict=False)
    engine = vllm_counter_engine(backend, tokenizer, temperature=1.0)
    episodes = anyio.run(engine.run, [COUNTER_ROW], 4)
    gaps = [logprob_gap(m, episodes, 1.0) for m in (trained, load_policy(untaught_path))]
    print(f"served vs trained: {gaps[0]:.2e}; served vs untrained: {gaps[1]:.2e}")
    assert gaps[0] < 1e-3
    assert gaps[1] > 1e-2


def test_a_server_that_hangs_or_dies_mid_run_is_a_clear_error_not_a_hang(
    server, backend, tokenizer
):
    """Runs last: it stops the module's server."""

    def run_while(timeout_s: float, action) -> None:
        """Play 8 long episodes (no stop id can be sampled); `action` happens 0.5 s in."""
        endless = VLLMServerBackend(
            ServerConnection(server.url, timeout_s),
            backend.model,
            backend.stop_token_ids,
            sampling_overrides={"allowed_token_ids": list(range(100, 200))},
        )
        engine = RolloutEngine(
            endless,
            tokenizer,
            environment_factory=Counter,
            chat_template="chatml_tools",
            config=EpisodeConfig(max_completion_length=1500),
        )

        async def play() -> None:
            with anyio.fail_after(60):  # never a hang
                await engine.run([COUNTER_ROW], 8)

        threading.Timer(0.5, action).start()
        anyio.run(play)

    hang = lambda: os.kill(server.pid, signal.SIGSTOP)  # noqa: E731  (the port still connects)
    try:
        with pytest.raises(ServerUnavailableError, match=r"did not answer .* restart it"):
            run_while(3.0, hang)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    die = lambda: os.killpg(server.pid, signal.SIGKILL)  # noqa: E731
    with pytest.raises(ServerUnavailableError, match=f"server at {server.url} did not answer"):
        run_while(300.0, die)
