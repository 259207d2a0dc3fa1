"""Seats another model plays (``"model:PATH"``): loaded once, frozen, refused where it cannot."""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from agentgrpo import GRPOTrainer
from agentgrpo.cli import build_parser, main
from agentgrpo.cli.eval_command import _eval_engine
from agentgrpo.placement import Placement
from agentgrpo.reporting import view_data
from agentgrpo.rounds.wiring import build_parts
from agentgrpo.training.seat_models import SeatModels
from environments.seats import OtherModel, seat_players
from environments.tictactoe import TicTacToe
from rollout import ScriptedBackend
from tests.agentgrpo.test_seat_rounds import config
from tests.agentgrpo.test_seat_snapshots import sampled
from tests.support.cli import eval_figures
from tests.support.tiny_model import tiny_llama, tiny_model
from tests.support.trainer import short_run_config, tiny_trainer


@pytest.fixture(scope="module")
def other_dir(tokenizer, tmp_path_factory):
    """Another tiny Llama (seed 1: other weights than the policy's seed 0), tokenizer saved."""
    path = tmp_path_factory.mktemp("other-model")
    tiny_llama(tokenizer, seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def logprobs_of(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """`model`'s forward logprob of each of `ids` after `prompt`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def test_only_a_frozen_seat_samples_at_a_temperature_of_its_own(other_dir, tmp_path):
    model = f"model:{other_dir}"
    for players in ({"o": model}, {"o": "snapshot:2"}, {"o": "league:2:3"}):
        assert config(tmp_path, seat_players=players, seat_temperatures={"o": 0}).seat_temperatures
    for players, temperatures in (
        ({"o": model}, {"x": 0}),  # the policy's seat
        ({"o": model}, {"o": -0.5}),
        ({"o": "random"}, {"o": 0}),
        ({"o": "adapter:solver"}, {"o": 0}),  # trained
        (None, {"o": 0}),
    ):
        with pytest.raises(ValueError, match=re.escape("seat_temperatures=")) as error:
            config(tmp_path, seat_players=players, seat_temperatures=temperatures)
        assert "'snapshot', 'league:N:K' or 'model:PATH'" in str(error.value)


def test_a_model_player_names_a_saved_folder(other_dir, tmp_path):
    players = seat_players(TicTacToe, {"o": f"model:{other_dir}"})
    assert players == {"x": None, "o": OtherModel(path=str(other_dir))}
    for player, words in (
        ("model:", "names no folder; use 'model:PATH'"),
        (f"model:{tmp_path / 'gone'}", f"there is no folder {tmp_path / 'gone'}"),
        (f"model:{tmp_path}", "holds neither config.json nor adapter_config.json"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"seat_players['o']={player!r}")) as error:
            seat_players(TicTacToe, {"o": player})
        assert words in str(error.value)
    with pytest.raises(ValueError, match=re.escape("'model:PATH' (another model")):
        seat_players(TicTacToe, {"o": "no_such_player"})


def test_a_model_seat_samples_from_the_other_model_never_the_policy(other_dir, tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": f"model:{other_dir}"})
    policy = tiny_llama(tokenizer).eval()
    models = SeatModels.of(args, Placement(), TicTacToe, policy, tokenizer)
    [model] = models.models.values()
    saved = AutoModelForCausalLM.from_pretrained(other_dir).state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in model.state_dict().items())
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == next(policy.parameters()).dtype
    prompt = tokenizer.encode("You play o. Mark a cell.")
    ids, logprobs = sampled(models.backends["o"], prompt)
    assert torch.allclose(torch.tensor(logprobs), logprobs_of(model, prompt, ids), atol=1e-4)
    assert not torch.allclose(torch.tensor(logprobs), logprobs_of(policy, prompt, ids), atol=0.1)
    run = build_parts(args, ScriptedBackend(lambda ids: [0], [0]), tokenizer, TicTacToe, (), (),
                      seat_backends={"o": [models.backends["o"]]})  # fmt: skip
    assert run.engine.seat_backends["o"] == [models.backends["o"]]
    with pytest.raises(ValueError, match=re.escape("pass seat_backends")):
        build_parts(args, ScriptedBackend(lambda ids: [0], [0]), tokenizer, TicTacToe)


def test_a_peft_adapter_folder_plays_as_its_base_with_the_adapter_on(
    other_dir, tmp_path, tokenizer
):
    adapted = get_peft_model(
        AutoModelForCausalLM.from_pretrained(other_dir),  # the base its config names
        LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    args = config(tmp_path, seat_players={"o": f"model:{tmp_path / 'adapter'}", "x": "policy"})
    models = SeatModels.of(args, Placement(), TicTacToe, tiny_llama(tokenizer), tokenizer)
    [model] = models.models.values()
    ids = torch.tensor([tokenizer.encode("You play o.")])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, adapted(ids).logits, atol=1e-5)
        with adapted.disable_adapter():
            assert not torch.allclose(model(ids).logits, adapted(ids).logits, atol=1e-3)


def test_a_model_seat_is_refused_where_it_cannot_play(other_dir, tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": f"model:{other_dir}"})
    policy = tiny_llama(tokenizer)
    for placement, use_vllm, words in (
        (Placement(), True, "generate with transformers (use_vllm=False)"),
        (Placement(zero_stage=3), False, "launch with DeepSpeed ZeRO-2 or without sharding"),
    ):
        args.use_vllm = use_vllm
        with pytest.raises(ValueError, match=re.escape(words)):
            SeatModels.of(args, placement, TicTacToe, policy, tokenizer)


def test_a_model_of_another_vocabulary_is_refused(tmp_path, tokenizer):
    policy = tiny_llama(tokenizer)
    bare = tmp_path / "bare"  # no tokenizer saved, a different embedding size
    tiny_model(LlamaForCausalLM, LlamaConfig, len(tokenizer) + 8).save_pretrained(bare)
    grown = tmp_path / "grown"  # a tokenizer with one more token
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<move>"])
    tiny_llama(other).save_pretrained(grown)
    other.save_pretrained(grown)
    for folder, why in (
        (bare, f"embeds {len(tokenizer) + 8} tokens, the policy {len(tokenizer)}"),
        (grown, f"its tokenizer has {len(tokenizer) + 1} tokens, the run's {len(tokenizer)}"),
    ):
        args = config(tmp_path, seat_players={"o": f"model:{folder}"})
        with pytest.raises(ValueError, match="its vocabulary is not the policy's") as error:
            SeatModels.of(args, Placement(), TicTacToe, policy, tokenizer)
        assert why in str(error.value) and "play a model of the same tokenizer" in str(error.value)


def test_a_run_trains_the_policy_seat_against_a_frozen_other_model(other_dir, tmp_path, tokenizer):
    args = short_run_config(
        tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=64,
        max_turns=5, chat_template="chatml_tools", log_episodes=True, max_steps=1,
        seat_players={"o": f"model:{other_dir}"}, seat_temperatures={"o": 0},
    )  # fmt: skip
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        None,
        args,
        TicTacToe.dataset("train").select([0, 2]),  # o moves first, then x
        processing_class=tokenizer,
        environment_factory=TicTacToe,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    [model] = trainer.snapshots.models.models.values()
    assert trainer.engine.seat_backends["o"] == [trainer.snapshots.models.backends["o"]]
    assert trainer.engine.seat_temperatures == {"o": 0}  # a greedy opponent
    saved = AutoModelForCausalLM.from_pretrained(other_dir).state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in model.state_dict().items())
    records, problems = view_data.read_step(tmp_path, 1)
    assert not problems and [view_data.episode_view(r)["seat"] for r in records] == ["x"] * 4


def test_an_async_run_plays_the_other_model_in_the_producer_with_its_own_backend(
    other_dir, tmp_path, tokenizer
):
    args = short_run_config(
        tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=64,
        max_turns=5, chat_template="chatml_tools", log_episodes=True, max_steps=2,
        seat_players={"o": f"model:{other_dir}"}, seat_temperatures={"o": 0}, async_grpo=True,
    )  # fmt: skip
    rows = TicTacToe.dataset("train").select([0, 2])
    trainer = tiny_trainer(tokenizer, None, args, rows, environment_factory=TicTacToe)
    trainer.train()
    assert trainer.state.global_step == 2
    [model] = trainer.snapshots.models.models.values()
    [learners] = trainer.engine.seat_backends["o"]
    [producers] = trainer._async.generation.engine.seat_backends["o"]
    assert producers is not learners  # one backend per thread, over one frozen model
    assert producers.model is learners.model is model
    assert trainer._async.generation.engine.seat_temperatures == {"o": 0}
    for step in (1, 2):
        records, problems = view_data.read_step(tmp_path, step)
        assert not problems and [view_data.episode_view(r)["seat"] for r in records] == ["x"] * 4


def test_eval_plays_the_model_against_the_other_model(
    other_dir, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    options = ["eval", "env:TicTacToe", "--model", str(tiny_model_dir), "--chat-template",
               "chatml_tools", "--max-completion-length", "8", "--num-episodes", "2",
               "--seat-players", f'{{"o": "model:{other_dir}"}}',
               "--seat-temperatures", '{"o": 0}']  # fmt: skip
    engine, *_ = _eval_engine(build_parser()[0].parse_args(options), TicTacToe, torch.device("cpu"))
    assert engine.seat_temperatures == {"o": 0.0}
    [seat] = engine.seat_backends["o"]
    saved = AutoModelForCausalLM.from_pretrained(other_dir).state_dict()
    assert seat is not engine.context.backend and seat.model is not engine.context.backend.model
    assert all(torch.equal(t, saved[name]) for name, t in seat.model.state_dict().items())
    engine.close()
    assert main(options) == 0
    assert eval_figures(capsys.readouterr().out)["episodes"] == "2"  # x's side: o gives none
