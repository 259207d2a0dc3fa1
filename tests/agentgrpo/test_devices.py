"""Devices and precision on a machine without a GPU: `--device`, its errors, what runs where.

What needs a GPU to be observed (a step on CUDA, eval on CUDA) is in test_gpu.py.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig
from agentgrpo.cli import build_parser
from agentgrpo.cli.commands import _run_settings
from agentgrpo.devices import (
    check_available,
    check_fsdp_version,
    check_processes_joined,
    describe_device,
    parse_device,
    pin_training_device,
    resolve_device,
    skip_unused_deepspeed_build,
    visible_devices,
)
from agentgrpo.generation.weight_sync import COLOCATE_BATCHED_TOKENS, colocate_engine_args
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.learner.token_weights import TokenWeighting
from agentgrpo.precision import (
    corrects_sampler_mismatch,
    describe_precision,
    mixed_precision_dtype,
)
from environments import Counter
from tests.support.trainer import tiny_trainer

CUDA_BUILT = torch.backends.cuda.is_built()
cpu_only_torch = pytest.mark.skipif(CUDA_BUILT, reason="checks a CPU-only build of torch")


@pytest.fixture
def user_error(user_error, monkeypatch):
    """conftest's `user_error`, with CUDA_VISIBLE_DEVICES restored whatever a run sets."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return user_error


# ---------------------------------------------------------------------- --device


@pytest.mark.parametrize(
    ("text", "device"),
    [("cpu", "cpu"), ("cuda", "cuda:0"), ("CUDA:1", "cuda:1"), (" cuda:12 ", "cuda:12")],
)
def test_device_names_are_cpu_cuda_or_cuda_with_an_index(text, device):
    assert parse_device(text) == torch.device(device)


@pytest.mark.parametrize("text", ["gpu", "cuda:-1", "cuda:x", "mps", "", "cuda:0:1"])
def test_anything_else_names_the_forms_device_takes(text):
    with pytest.raises(ValueError, match=r"--device takes cpu, cuda or cuda:N"):
        parse_device(text)


@pytest.mark.parametrize(
    ("device", "cuda_built", "gpus", "message"),
    [
        ("cuda:0", False, 0, "built for CPU only; install a CUDA build of torch, or use --device"),
        ("cuda:0", True, 0, "CUDA sees no GPU"),
        ("cuda:2", True, 2, "CUDA sees 2 GPU\\(s\\), cuda:0 to cuda:1; choose one of those"),
    ],
)
def test_a_gpu_the_machine_lacks_says_what_to_use_instead(device, cuda_built, gpus, message):
    with pytest.raises(ValueError, match=message):
        check_available(torch.device(device), cuda_built, gpus)


def test_a_gpu_the_machine_has_and_the_cpu_are_accepted():
    check_available(torch.device("cuda:1"), cuda_built=True, gpus=2)
    check_available(torch.device("cpu"), cuda_built=False, gpus=0)


def test_without_device_a_machine_without_gpu_runs_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_visible_devices_keeps_only_the_chosen_gpu_of_those_visible():
    assert visible_devices(0, None) == "0"
    assert visible_devices(2, "") == "2"
    assert visible_devices(1, "4, 6") == "6"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=4,6 shows 2 GPU"):
        visible_devices(2, "4,6")


def test_training_on_the_cpu_sets_use_cpu_and_touches_no_gpu_setting():
    environ: dict[str, str] = {}
    assert pin_training_device("cpu", environ) == {"use_cpu": True}
    assert pin_training_device("cpu", {"WORLD_SIZE": "2"}) == {"use_cpu": True}
    assert environ == {}


def test_a_distributed_launch_gives_each_process_its_gpu():
    with pytest.raises(ValueError, match="every process uses its own GPU"):
        pin_training_device("cuda:1", {"WORLD_SIZE": "2"})
    environ = {"WORLD_SIZE": "2"}
    assert pin_training_device("cuda", environ) == {}
    assert environ == {"WORLD_SIZE": "2"}  # accelerate assigns the GPUs


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "no gpu"])
def test_a_distributed_launch_naming_no_device_takes_the_gpus_or_else_the_cpu(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    expected = {} if gpu else {"use_cpu": True}
    assert pin_training_device(None, {"WORLD_SIZE": "2"}) == expected


def test_processes_a_launch_started_but_accelerate_runs_alone_are_refused_naming_use_cpu():
    with pytest.raises(ValueError, match=r"started 2 processes .* Set use_cpu=True in GRPOConfig"):
        check_processes_joined({"WORLD_SIZE": "2"}, num_processes=1)
    check_processes_joined({"WORLD_SIZE": "2"}, num_processes=2)
    check_processes_joined({"WORLD_SIZE": "1"}, num_processes=1)


def test_fsdp_version_1_is_refused_naming_the_setting_to_change():
    # accelerate refuses FSDP on CPU processes, so this launch cannot run here end to end.
    with pytest.raises(ValueError, match=r"FSDP version 1 .* Set fsdp_version: 2 in the config"):
        check_fsdp_version("FSDP", is_fsdp2=False)
    check_fsdp_version("FSDP", is_fsdp2=True)
    check_fsdp_version("DEEPSPEED", is_fsdp2=False)


@cpu_only_torch
def test_a_cpu_only_torch_trains_on_the_cpu_and_refuses_a_gpu():
    environ: dict[str, str] = {}
    assert pin_training_device(None, environ) == {} and environ == {}
    with pytest.raises(ValueError, match="built for CPU only"):
        pin_training_device("cuda:1", environ)


def test_run_refuses_a_bad_device_before_loading_anything(user_error):
    message = user_error("run", "env:Counter", "--device", "gpu")
    assert "--device takes cpu, cuda or cuda:N" in message
    message = user_error("run", "env:Counter", "--use-cpu", "true", "--device", "cuda")
    assert "--use-cpu and --device cuda disagree" in message


@cpu_only_torch
def test_run_eval_and_doctor_refuse_a_gpu_this_torch_cannot_use(user_error, tiny_model_dir):
    model = str(tiny_model_dir)
    for argv in (
        ("run", "env:Counter", "--device", "cuda"),
        ("eval", "env:Counter", "--model", model, "--device", "cuda:1"),
        ("doctor", "env:Counter", "--model", model, "--generate", "1", "--device", "cuda"),
    ):
        assert "built for CPU only; install a CUDA build of torch, or use --device cpu" in (
            user_error(*argv)
        )


def test_device_options_that_cannot_apply_are_refused(user_error, tiny_model_dir):
    model = str(tiny_model_dir)
    message = user_error(
        "eval", "env:Counter", "--model", model, "--server-url", "http://127.0.0.1:9",
        "--device", "cpu",
    )  # fmt: skip
    assert "with --server-url http://127.0.0.1:9 the server generates" in message
    message = user_error("doctor", "env:Counter", "--model", model, "--device", "cpu")
    assert "--device is where --generate plays" in message


def test_run_loads_float32_weights_unless_told_a_dtype():
    parser, _ = build_parser()

    def model_init_kwargs(*options: str):
        argv = ["run", "env:Counter", *options]
        return _run_settings(parser.parse_args(argv), Counter)["config"]["model_init_kwargs"]

    assert model_init_kwargs() == {"dtype": "float32"}
    assert model_init_kwargs("--model-init-kwargs", '{"revision": "v2"}') == {
        "dtype": "float32",
        "revision": "v2",
    }
    assert model_init_kwargs("--model-init-kwargs", '{"dtype": "bfloat16"}') == {
        "dtype": "bfloat16"
    }
    device_key = _run_settings(parser.parse_args(["run", "x", "--device", "cpu"]), Counter)
    assert device_key["device"] == "cpu"


# ---------------------------------------------------------------------- precision


def test_the_summary_names_the_device_and_the_precision():
    assert describe_device(torch.device("cpu"), {}) == "cpu"
    assert describe_device(torch.device("cpu", 0), {}) == "cpu"  # a CPU process of several
    assert describe_precision(torch.float32, None) == "float32"
    assert describe_precision(torch.float32, torch.float16) == (
        "fp16 mixed precision (float32 weights, float16 compute)"
    )
    assert describe_precision(torch.bfloat16, torch.bfloat16) == "bfloat16"  # nothing mixed


def test_bf16_mixed_precision_corrects_the_transformers_samplers_numerics(tmp_path):
    def weighting(**fields) -> TokenWeighting:
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **fields)
        return TokenWeighting.from_config(args, corrects_sampler_mismatch(args))

    assert weighting().sampler_correction_mode is None  # float32 on a CPU: exact
    assert mixed_precision_dtype(GRPOConfig(output_dir=str(tmp_path), bf16=True, use_cpu=True))
    assert weighting(bf16=True).sampler_correction_mode == "sequence_mask"
    off = weighting(bf16=True, vllm_importance_sampling_correction=False)
    assert off.sampler_correction_mode is None
    assert weighting(vllm_importance_sampling_mode="token_truncate").sampler_ratio_level == "token"


def test_generation_autocasts_in_the_precision_an_fp16_launch_trains_in(tmp_path, monkeypatch):
    # transformers trains under the launch's fp16 though the flags are off; generation must too.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert (args.bf16, args.fp16, args.mixed_precision) == (False, False, "fp16")
    assert mixed_precision_dtype(args) == torch.float16
    assert corrects_sampler_mismatch(args)


def test_vespo_refuses_a_sequence_correction_of_bf16_generation(tmp_path):
    with pytest.raises(
        ValueError, match="VESPO loss requires `vllm_importance_sampling_mode` to be either"
    ):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, loss_type="vespo")


def test_colocated_vllm_gets_trls_engine_settings_and_generates_in_the_compute_dtype(tmp_path):
    config = functools.partial(
        GRPOConfig,
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        use_vllm=True,
        per_device_train_batch_size=4,
        steps_per_generation=3,
        num_generations=2,
        vllm_gpu_memory_utilization=0.55,
        vllm_max_model_length=2048,
        vllm_model_impl="transformers",
        trust_remote_code=True,
        seed=7,
    )
    on_gpu = colocate_engine_args(
        config(bf16=True), torch.float32, torch.device("cuda", 0), sleeps=True
    )
    assert on_gpu == {
        "dtype": "bfloat16",  # the dtype training computes in, not the float32 master weights
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.55,
        "tensor_parallel_size": 1,
        "max_num_seqs": 12,  # a round's episodes: 4 x 3
        "max_num_batched_tokens": COLOCATE_BATCHED_TOKENS,
        "model_impl": "transformers",
        "enable_sleep_mode": True,
        "enforce_eager": False,
        "seed": 7,
        "trust_remote_code": True,
    }
    on_cpu = colocate_engine_args(
        config(bf16=False), torch.float32, torch.device("cpu"), sleeps=False
    )
    assert on_cpu["dtype"] == "float32" and on_cpu["enforce_eager"] is True


# ---------------------------------------------------------------------- where tensors are


def test_a_batch_moves_every_tensor_and_nothing_else(counter_episode):
    batch = collate_episodes([counter_episode] * 2, torch.tensor([1.0, -1.0]), 0)
    batch = replace(batch, old_logprobs_B_C=batch.sampler_logprobs_B_C)
    moved = batch.to("meta")
    tensors = {name: v for name, v in moved.__dict__.items() if isinstance(v, torch.Tensor)}
    assert {v.device.type for v in tensors.values()} == {"meta"}
    assert {name: v.shape for name, v in tensors.items()} == {
        name: getattr(batch, name).shape for name in tensors
    }
    assert moved.ref_logprobs_B_C is None and moved.num_items == batch.num_items
    assert batch.to("cpu").input_ids_B_L is batch.input_ids_B_L  # already there: no copy


def test_the_trainer_serves_micro_batches_on_its_device(tokenizer, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=4,
        beta=0.1,  # reference logprobs too
    )
    trainer = tiny_trainer(
        tokenizer,
        lambda completions, **kw: [float(len(c)) for c in completions],
        args,
        Dataset.from_dict({"prompt": ["Hello", "One two"]}),
    )
    trainer.model.train()
    batch = trainer._prepare_inputs([{"prompt": "Hello"}, {"prompt": "One two"}])
    for value in batch.__dict__.values():
        if isinstance(value, torch.Tensor):
            assert value.device == trainer.args.device
    assert batch.old_logprobs_B_C is not None and batch.ref_logprobs_B_C is not None


@pytest.mark.process
def test_a_deepspeed_launch_on_cpu_skips_deepspeeds_shared_memory_all_reduce_build(monkeypatch):
    """ZeRO on CPU processes never calls the op, and building it costs a minute of g++."""
    deepspeed = pytest.importorskip("deepspeed")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    assert not skip_unused_deepspeed_build({})
    assert not skip_unused_deepspeed_build({"ACCELERATE_USE_DEEPSPEED": "false"})
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    assert not deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]
