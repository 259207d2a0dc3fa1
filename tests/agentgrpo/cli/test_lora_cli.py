"""`agentgrpo run --use-peft` trains a LoRA adapter; `agentgrpo eval` plays adapter folders."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from agentgrpo import GRPOConfig
from agentgrpo.cli import main, resume_check
from agentgrpo.cli.lora import adapter_settings, lora_config
from agentgrpo.cli.options import UsageError
from agentgrpo.generation.evaluation import adapter_seat_backends
from agentgrpo.models.loading import load_for_generation
from environments.tictactoe import TicTacToe
from rollout import SamplingParams, TransformersBackend
from tests.support.cli import eval_figures
from tests.support.tiny_model import tiny_llama

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_run_trains_a_lora_adapter_that_eval_then_plays(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    status = main([
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(out),
        "--chat-template", "chatml_tools", "--use-peft", "--lora-r", "4", "--lora-alpha", "8",
        "--lora-target-modules", "q_proj", "v_proj", "--max-steps", "1",
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "16", "--warm-start-steps", "1", "--save-steps", "1",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "adapter      LoRA r 4, alpha 8, dropout 0.05 on q_proj, v_proj" in printed
    model = out / "model"
    saved = json.loads((model / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (4, 8, 0.05)
    assert saved["base_model_name_or_path"] == str(tiny_model_dir)
    assert not (model / "model.safetensors").exists()  # the adapter alone, not the whole model
    weights = load_file(model / "adapter_model.safetensors")
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert len(lora_b) == 4 and all(w.abs().sum() > 0 for w in lora_b)  # PEFT starts B at 0
    evaluate = f"evaluate it: agentgrpo eval env:Counter --model {model}"
    assert evaluate in printed

    status = main(["eval", "env:Counter", "--model", str(model), "--num-episodes", "2",
                   "--max-completion-length", "16"])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert eval_figures(printed)["episodes"] == "2"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--lora-r", "4"], "--lora-r shapes the LoRA adapter of --use-peft: add --use-peft"),
        (["--use-peft", "false", "--lora-target-modules", "q_proj"], "--lora-target-modules"),
        (["--use-peft", "--lora-dropout", "1"], "--lora-dropout takes a number in [0, 1), not"),
        (["--use-peft", "--lora-r", "0"], "--lora-r takes a whole number >= 1, not '0'"),
        (["--use-peft", "maybe"], "--use-peft takes true or false, not 'maybe'"),
    ],
)
def test_lora_options_are_refused_without_use_peft_or_out_of_range(user_error, options, expected):
    assert expected in user_error("run", "env:Counter", *options)


def test_target_modules_the_model_lacks_are_named_with_the_option(
    user_error, tiny_model_dir, tmp_path
):
    message = user_error(
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "o"),
        "--chat-template", "chatml_tools", "--use-peft", "--lora-target-modules", "nope",
    )  # fmt: skip
    assert message.startswith("error: --lora-target-modules: Target modules {'nope'} not found")


def test_a_config_file_sets_lora_as_the_command_line_does(user_error, tmp_path):
    config = tmp_path / "lora.yaml"
    config.write_text("lora_alpha: 16\n")
    message = user_error("run", "env:Counter", "--config", str(config))
    assert "--lora-alpha shapes the LoRA adapter of --use-peft" in message
    config.write_text("use_peft: true\nlora_dropout: 2\n")
    message = user_error("run", "env:Counter", "--config", str(config))
    assert message == f"error: config file {config}: lora_dropout takes a number in [0, 1), not 2"


@pytest.fixture(scope="module")
def two_adapters(tokenizer, tiny_model_dir, tmp_path_factory):
    """A saved LoRA folder of the tiny model: its policy's adapter and a named one, "solver"."""
    policy = get_peft_model(tiny_llama(tokenizer), LoraConfig(**LORA))
    policy.add_adapter("solver", LoraConfig(**LORA))
    with torch.no_grad():  # LoRA starts from B = 0: give each adapter an effect of its own
        for seed, name in enumerate(("default", "solver")):
            generator = torch.Generator().manual_seed(seed)
            for key, weight in policy.named_parameters():
                if f"lora_B.{name}." in key:
                    weight.normal_(0, 0.5, generator=generator)
    for config in policy.peft_config.values():
        config.base_model_name_or_path = str(tiny_model_dir)
    path = tmp_path_factory.mktemp("adapters")
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_an_adapter_seat_samples_from_its_adapter_of_the_saved_folder(tokenizer, two_adapters):
    model, _ = load_for_generation(str(two_adapters), torch.device("cpu"))
    assert sorted(model.peft_config) == ["default", "solver"]
    policy = TransformersBackend.from_tokenizer(model, tokenizer)
    seats = adapter_seat_backends(TicTacToe, {"o": "adapter:solver"}, policy, seed=0)
    assert seats is not None and set(seats) == {"o"} and seats["o"] is not policy
    prompt = tokenizer.encode("You play o. Mark a cell.")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)

    async def both():  # concurrently: the shared step lock keeps each step to its adapter
        done = {}

        async def one(name, backend):
            done[name] = await backend.generate(prompt, params)

        async with anyio.create_task_group() as tasks:
            for name, backend in (("default", policy), ("solver", seats["o"])):
                tasks.start_soon(one, name, backend)
        return done

    sampled = anyio.run(both)
    assert model.active_adapter == "default"  # given back after every step
    for name, completion in sampled.items():
        ids = torch.tensor([prompt + completion.token_ids])
        model.set_adapter(name)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        model.set_adapter("default")
        forward = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), forward, atol=1e-4), name
    assert sampled["solver"].logprobs != sampled["default"].logprobs


def test_eval_plays_a_seat_with_a_named_adapter_or_says_which_it_holds(
    two_adapters, tiny_model_dir, user_error, capsys
):
    common = (
        "eval", "env:TicTacToe", "--num-episodes", "2", "--max-completion-length", "16",
        "--chat-template", "chatml_tools", "--seat-players", '{"o": "adapter:solver"}',
    )  # fmt: skip
    assert main([*common, "--model", str(two_adapters)]) == 0
    # a match gives an episode per seat that is not scripted or frozen: x's and the adapter's o
    assert eval_figures(capsys.readouterr().out)["episodes"] == "4"
    message = user_error(*common, "--model", str(tiny_model_dir))
    assert "names adapters ['solver'], which --model does not hold (its adapters: none" in message
    other = '{"o": "adapter:other"}'
    message = user_error(*common, "--seat-players", other, "--model", str(two_adapters))
    assert "adapters ['other'], which --model does not hold (its adapters: ['default', " in message


def test_a_run_resumes_only_with_the_adapter_it_saved(tiny_model_dir, tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    adapter = adapter_settings(lora_config({"use_peft": True, "lora_r": 4}))
    saved = resume_check.run_settings("env:Counter", None, config, [], adapter)
    resume_check.write_run_settings(tmp_path, saved)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    assert resume_check.check_resume(checkpoint, tmp_path, saved, str(tiny_model_dir)) == []
    for other in (None, adapter_settings(lora_config({"use_peft": True}))):
        again = resume_check.run_settings("env:Counter", None, config, [], other)
        with pytest.raises(UsageError, match=r"this command differs .*: lora "):
            resume_check.check_resume(checkpoint, tmp_path, again, str(tiny_model_dir))
