"""Seats played by trained LoRA adapters of one base: several policies trained in one run."""

from __future__ import annotations

import re

import anyio
import pytest
import torch
from peft import LoraConfig, get_peft_model

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.generation.local import transformers_backend
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.learner.logprobs import completion_logprobs
from agentgrpo.placement import Placement
from agentgrpo.training.seat_policies import SeatPolicies
from environments.seats import seat_adapters, seat_players
from environments.tictactoe import TicTacToe
from rollout import SamplingParams
from tests.agentgrpo.test_seat_rounds import config
from tests.rollout.test_match import marks, play
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import StopAfter, rank_in_call, short_run_config

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class NoAccelerator:
    """The accelerator's one part `SeatPolicies` uses outside a trainer: its autocast."""

    def autocast(self):
        return torch.autocast("cpu", enabled=False)


def adapted(tokenizer, tmp_path) -> tuple[SeatPolicies, torch.nn.Module]:
    """A tiny LoRA policy whose seat o is adapter "solver"'s, made unlike the policy's own."""
    args = config(tmp_path, seat_players={"o": "adapter:solver"}, gradient_checkpointing=False)
    policy = get_peft_model(tiny_llama(tokenizer), LoraConfig(**LORA))
    policies = SeatPolicies.of(args, Placement(), NoAccelerator(), TicTacToe, policy)
    with torch.no_grad():  # LoRA starts from B = 0: give each adapter an effect of its own
        for seed, name in enumerate(("default", "solver")):
            for weight in _b(policies, name):
                weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return policies, policy


def test_an_adapter_player_is_a_trained_seat_with_a_checked_name():
    assert seat_players(TicTacToe, {"o": "adapter:solver"}) == {"x": None, "o": None}
    assert seat_adapters(TicTacToe, {"o": "adapter:solver", "x": "random"}) == {"o": "solver"}
    assert seat_adapters(TicTacToe, {"x": "adapter:a", "o": "adapter:a"}) == {"x": "a", "o": "a"}
    for bad in ("adapter:default", "adapter:policy", "adapter:", "adapter:2nd", "adapter:a-b"):
        with pytest.raises(ValueError, match="name the adapter with a Python identifier"):
            seat_adapters(TicTacToe, {"o": bad})
    with pytest.raises(ValueError, match=re.escape("'adapter:NAME' (a trained LoRA adapter")):
        seat_players(TicTacToe, {"o": "solver"})


def test_adapter_learning_rates_must_name_adapters_of_the_seats(tmp_path):
    players = {"o": "adapter:solver"}
    assert config(tmp_path, seat_players=players, adapter_learning_rates={"solver": 1e-5})
    for rates in ({"other": 1e-5}, {"solver": 0.0}, {"solver": "fast"}):
        with pytest.raises(ValueError, match=r"adapter_learning_rates=.*named here: \['solver'\]"):
            config(tmp_path, seat_players=players, adapter_learning_rates=rates)


def test_adapter_seats_are_refused_where_they_cannot_train(tmp_path, tokenizer):
    args = config(tmp_path, seat_players={"o": "adapter:solver"}, gradient_checkpointing=False)
    lora = get_peft_model(tiny_llama(tokenizer), LoraConfig(**LORA))
    for placement, use_vllm, policy, words in (
        (Placement(), False, tiny_llama(tokenizer), "pass GRPOTrainer peft_config=LoraConfig(...)"),
        (Placement(), True, lora, "need the transformers backend for now"),
        (Placement(zero_stage=3), False, lora, "launch with DeepSpeed ZeRO-2 or without"),
    ):
        args.use_vllm = use_vllm
        with pytest.raises(ValueError, match=re.escape(words)):
            SeatPolicies.of(args, placement, NoAccelerator(), TicTacToe, policy)
    args.use_vllm, args.gradient_checkpointing = False, True
    with pytest.raises(ValueError, match=re.escape("set gradient_checkpointing=False")):
        SeatPolicies.of(args, Placement(), NoAccelerator(), TicTacToe, lora)
    args.gradient_checkpointing = False
    with pytest.raises(ValueError, match=re.escape("name it otherwise, e.g. 'adapter:o_seat'")):
        args.seat_players = {"o": "adapter:o"}
        SeatPolicies.of(args, Placement(), NoAccelerator(), TicTacToe, lora)


def test_a_seats_tokens_are_sampled_from_its_own_adapter(tmp_path, tokenizer):
    policies, policy = adapted(tokenizer, tmp_path)
    policy.eval()
    backend = transformers_backend(policy, tokenizer, policies.args)
    policies.attach(backend, tokenizer)
    prompt = tokenizer.encode("You play o. Mark a cell.")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)

    async def both():  # concurrently: the shared step lock keeps each step to its adapter
        done = {}

        async def one(name, each):
            done[name] = await each.generate(prompt, params)

        async with anyio.create_task_group() as tasks:
            for name, each in (("default", backend), ("solver", policies.backends["solver"])):
                tasks.start_soon(one, name, each)
        return done

    sampled = anyio.run(both)
    assert policy.active_adapter == "default"  # given back after every step
    for name, completion in sampled.items():
        ids = torch.tensor([prompt + completion.token_ids])
        with policies.active(name), torch.no_grad():
            logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
        recorded = torch.tensor(completion.logprobs)
        forward = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert torch.allclose(recorded, forward, atol=1e-4), name
    assert sampled["solver"].logprobs != sampled["default"].logprobs


def test_each_rows_loss_reaches_only_its_seats_adapter(tmp_path, tokenizer):
    policies, policy = adapted(tokenizer, tmp_path)
    policy.train()
    x, o = play(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    batch = collate_episodes([x, o], torch.zeros(2), tokenizer.pad_token_id)
    policies.episode_adapters[True] = ["default", "solver"]
    lora_dropout_free = policy.peft_config["default"].lora_dropout == 0.0
    assert lora_dropout_free  # the forwards below are deterministic
    routed = policies.forward(policy, batch, 1.0).logprobs_B_C
    for row, name in enumerate(("default", "solver")):
        with policies.active(name):
            alone = completion_logprobs(policy, batch.select([row]), 1.0).logprobs_B_C[0]
        assert torch.allclose(routed[row, : len(alone)], alone, atol=1e-5)
        policy.zero_grad()
        (routed[row] * batch.loss_mask_B_C[row]).sum().backward(retain_graph=True)
        other = "solver" if name == "default" else "default"
        assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in _b(policies, name))
        assert all(w.grad is None or not w.grad.any() for w in policies.weights(other).values())
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)


def _b(policies: SeatPolicies, name: str) -> list[torch.Tensor]:
    return [w for key, w in policies.weights(name).items() if "lora_B" in key]


def run(tmp_path, tokenizer, callbacks=(), resume=None, **fields) -> GRPOTrainer:
    args = short_run_config(
        tmp_path, per_device_train_batch_size=8, num_generations=2, max_completion_length=16,
        max_turns=3, chat_template="chatml_tools", max_steps=2, save_strategy="no",
        shuffle_dataset=False, logging_steps=1, gradient_checkpointing=False,
        seat_players={"o": "adapter:solver"}, adapter_learning_rates={"solver": 5e-3}, **fields,
    )  # fmt: skip
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        rank_in_call,  # rewards that differ in every group: every step has a gradient
        args,
        # each round: a row o opens and one x opens (the tiny model's first turn ends a game)
        TicTacToe.dataset("train").select([0, 2, 1, 4]),
        processing_class=tokenizer,
        environment_factory=TicTacToe,
        peft_config=LoraConfig(**LORA),
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_run_trains_two_adapters_saves_both_and_resumes_exactly(tmp_path, tokenizer):
    straight = run(tmp_path / "straight", tokenizer)
    policies = straight.policies
    groups = {g.get("adapter"): g["initial_lr"] for g in straight.optimizer.param_groups}
    assert groups == {None: 1e-2, "solver": 5e-3}  # the policy's two groups, and o's own
    for name in ("default", "solver"):
        assert any(w.abs().sum() > 0 for w in _b(policies, name)), f"{name} did not train"
    [solver_backend] = straight.engine.seat_backends["o"]  # o's turns sample from its adapter
    assert (
        solver_backend is policies.backends["solver"] and "x" not in straight.engine.seat_backends
    )
    differences = [
        e["sampling/sampling_logp_difference/max"] for e in straight.state.log_history[:2]
    ]
    assert max(differences) < 1e-4  # the learner scores each row under the adapter that sampled it
    logged = {key for entry in straight.state.log_history for key in entry}
    assert {f"adapter/solver/{m}" for m in ("reward_mean", "episodes", "learning_rate")} <= logged
    straight.save_model(str(tmp_path / "model"))
    assert (tmp_path / "model" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "model" / "solver" / "adapter_model.safetensors").is_file()

    run(tmp_path / "cut", tokenizer, callbacks=[StopAfter(1, save=True)])
    resumed = run(tmp_path / "cut", tokenizer, resume=str(tmp_path / "cut" / "checkpoint-1"))
    for name in ("default", "solver"):
        for (key, a), b in zip(
            policies.weights(name).items(),
            resumed.policies.weights(name).values(),
            strict=True,
        ):
            assert torch.allclose(a, b, atol=1e-6), key


def test_an_async_run_samples_each_adapter_from_the_producers_copy_of_it(tmp_path, tokenizer):
    trainer = run(tmp_path, tokenizer, async_grpo=True)
    assert trainer.state.global_step == 2
    for name in ("default", "solver"):
        assert any(w.abs().sum() > 0 for w in _b(trainer.policies, name)), f"{name} did not train"
    weights = trainer._async.generation.weights  # the producer's copy of the PeftModel
    [solver] = trainer._async.generation.engine.seat_backends["o"]
    assert solver.model is weights.model and weights.siblings == [solver]
    assert solver is not trainer.policies.backends["solver"]  # the learner's stays its own
    assert solver.weights_version == weights.version == 2  # each push tags its tokens too
    copied = dict(weights.model.named_parameters())
    for key, trained in trainer.policies.weights("solver").items():
        assert torch.equal(copied[key], trained), key  # pushed with the policy's
    assert not any(p.requires_grad for p in weights.model.parameters())
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"adapter/solver/reward_mean", "adapter/solver/episodes"} <= logged


def test_the_cli_reads_adapter_learning_rates_as_json():
    from agentgrpo.cli.options import value_parser

    assert value_parser("adapter_learning_rates")('{"solver": 1e-5}') == {"solver": 1e-5}
    assert GRPOConfig.__dataclass_fields__["adapter_learning_rates"].default is None
