"""A generation round without a Trainer: the plan's sizes by hand, and a whole round on CPU."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import anyio
import pytest
import torch
from transformers import set_seed

from agentgrpo import GRPOConfig
from agentgrpo.cli import build_parser
from agentgrpo.cli.eval_command import eval_config
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.learner.logprobs import batched_logprobs
from agentgrpo.rewards.calls import reward_functions
from agentgrpo.rounds.pipeline import (
    RewardShaping,
    RoundParts,
    RoundPlan,
    micro_batches_commute,
    play_and_batch,
    split_micro_batches,
)
from agentgrpo.rounds.scoring import play_round
from agentgrpo.rounds.wiring import build_parts, episode_config_of
from environments import Counter
from rollout import EpisodeConfig, TransformersBackend
from tests.support.episodes import scripted_backend, scripted_episode, single_row
from tests.support.trainer import rank_in_call, short_run_config, tiny_trainer


def grpo_config(tmp_path, **fields) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)


def test_the_plan_of_one_optimizer_step_per_round(tmp_path):
    # 4 episodes a micro-batch x 2 accumulation steps = 8 completions a round, 2 groups of 4,
    # cut into 2 micro-batches of 4: one optimizer step.
    args = grpo_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_steps=3,
    )  # fmt: skip
    plan = RoundPlan.from_config(args, num_processes=1)
    assert (plan.prompts_per_process, plan.episodes_per_process) == (2, 8)
    assert (plan.micro_batch_size, plan.micro_batches, plan.repeats) == (4, 2, 2)
    assert plan.optimizer_steps == 1.0
    assert not plan.needs_old_logprobs  # each micro-batch is trained on before any update
    assert plan.rows_needed == 6  # 3 rounds of 2 prompts
    assert plan.num_items(100.0) == 100.0


def test_two_processes_split_the_round_by_whole_groups(tmp_path):
    args = grpo_config(tmp_path, generation_batch_size=16, num_generations=4, max_steps=1)
    plan = RoundPlan.from_config(args, num_processes=2)
    assert (plan.prompts_per_process, plan.episodes_per_process) == (2, 8)
    assert plan.rows_needed == 4  # one round: 2 prompts on each of 2 processes


def test_several_updates_per_round_need_old_logprobs_and_share_the_tokens(tmp_path):
    # steps_per_generation=4 with accumulation 2: two optimizer steps per pass, two passes.
    args = grpo_config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        steps_per_generation=4, num_generations=2, num_iterations=2, max_steps=5,
    )  # fmt: skip
    plan = RoundPlan.from_config(args, num_processes=1)
    assert (plan.prompts_per_process, plan.micro_batches, plan.repeats) == (4, 4, 8)
    assert plan.optimizer_steps == 2.0 and plan.needs_old_logprobs
    assert plan.num_items(100.0) == 50.0  # a round's tokens feed two optimizer steps
    assert plan.rows_needed == 12  # ceil(5 steps / 2 per round) = 3 rounds of 4 prompts
    assert [plan.position(i) for i in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [i for i in range(17) if plan.starts_round(i)] == [0, 8, 16]
    assert plan.first_micro_batch(global_step=3) == 6


def test_an_optimizer_step_can_span_two_rounds(tmp_path):
    args = grpo_config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4,
        steps_per_generation=2, num_generations=2, max_steps=3,
    )  # fmt: skip
    plan = RoundPlan.from_config(args, num_processes=1)
    assert plan.optimizer_steps == 0.5
    assert plan.num_items(100.0) == 200.0  # a step holds this round's tokens and the next's
    assert plan.rows_needed == 12  # 6 rounds of 2 prompts


def test_an_eval_round_is_one_unshuffled_batch(tmp_path):
    args = grpo_config(
        tmp_path, per_device_eval_batch_size=8, num_generations=4, num_generations_eval=2
    )
    plan = RoundPlan.for_eval(args, num_processes=1)
    assert (plan.prompts_per_process, plan.num_generations, plan.micro_batch_size) == (4, 2, 8)
    assert not plan.train and not plan.needs_old_logprobs
    assert plan.num_items(100.0) == 100.0


def test_a_round_that_would_split_a_group_across_processes_is_refused(tmp_path):
    args = grpo_config(tmp_path, per_device_train_batch_size=4, num_generations=4)
    with pytest.raises(ValueError, match="whole groups"):
        RoundPlan.from_config(args, num_processes=3)  # 4 completions over 3 processes


@pytest.mark.parametrize(
    "fields, commute",
    [
        ({}, True),
        ({"gradient_accumulation_steps": 4, "steps_per_generation": 2}, True),  # a step spans 2
        ({"loss_type": "grpo"}, True),  # a mean over a micro-batch's (equally many) episodes
        ({"loss_type": "dr_grpo"}, True),
        ({"num_iterations": 2}, False),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 4}, False),  # 2 steps a round
        ({"loss_type": "bnpo"}, False),  # a token mean over the micro-batch
        ({"entropy_coef": 0.01}, False),
        ({"use_adaptive_entropy": True}, False),
        ({"top_entropy_quantile": 0.2}, False),
    ],
)
def test_groups_stay_together_only_where_micro_batch_membership_cannot_change_the_update(
    tmp_path, fields, commute
):
    args = grpo_config(tmp_path, per_device_train_batch_size=4, num_generations=4, **fields)
    assert micro_batches_commute(args) is commute
    assert RoundPlan.from_config(args, num_processes=1).whole_groups is commute


def test_whole_groups_are_shuffled_as_groups_and_each_episode_trains_once(tokenizer):
    # 4 groups of 3 episodes, micro-batches of 6: each holds 2 whole groups.
    episodes = [scripted_episode(tokenizer, [f"Answer {n}."]) for n in range(12)]
    batch = collate_episodes(episodes, torch.arange(12.0), pad_token_id=tokenizer.pad_token_id)
    plan = RoundPlan(4, num_generations=3, micro_batch_size=6, micro_batches=2, whole_groups=True)
    orders = []
    for seed in range(6):
        torch.manual_seed(seed)
        micro_batches = split_micro_batches(batch, plan, round_tokens=10)
        assert [len(b) for b in micro_batches] == [6, 6]
        order = [int(a) for b in micro_batches for a in b.advantages_B]
        assert sorted(order) == list(range(12))
        groups = [order[i : i + 3] for i in range(0, 12, 3)]
        assert all(g == list(range(g[0], g[0] + 3)) and g[0] % 3 == 0 for g in groups)
        orders.append(tuple(g[0] // 3 for g in groups))
    assert len(set(orders)) > 1  # the groups' order is drawn


def test_a_round_trains_to_the_same_weights_whether_groups_or_episodes_are_shuffled(
    tmp_path, tokenizer
):
    # One optimizer step (SGD, so the update is the summed gradient itself) from one round of
    # 4 groups of 4, in micro-batches of 4: whole groups, then episodes shuffled across them.
    # (With top_entropy_quantile=0.5, a quantile per micro-batch, the two differ.)
    weights = {}
    for whole_groups in (True, False):
        args = short_run_config(
            tmp_path / str(whole_groups), optim="sgd", per_device_train_batch_size=4,
            gradient_accumulation_steps=4, max_steps=1, beta=0.1, loss_type="dapo",
        )  # fmt: skip
        rows = [{"prompt": p} for p in ("The sky is", "Hello", "One two", "A B C")]
        trainer = tiny_trainer(tokenizer, rank_in_call, args, rows)
        assert trainer.plan.whole_groups
        trainer.plan = replace(trainer.plan, whole_groups=whole_groups)
        trainer.train()
        groups = [len({n // 4 for n in b.episodes}) for b in trainer._round.micro_batches]
        trained = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        weights[whole_groups] = trained, groups
    (grouped, grouped_groups), (shuffled, shuffled_groups) = weights[True], weights[False]
    assert grouped_groups == [1, 1, 1, 1] and max(shuffled_groups) > 1  # groups per batch
    for name, weight in shuffled.items():
        torch.testing.assert_close(grouped[name], weight, atol=1e-6, rtol=0, msg=name)


def completion_tokens(completion_ids: list[list[int]]) -> list[float]:
    """Reward: the completion's length in tokens (random tokens give every group a spread)."""
    return [float(len(ids)) for ids in completion_ids]


def test_a_whole_round_runs_on_cpu_without_a_trainer(tmp_path, tokenizer, tiny_model):
    args = grpo_config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        steps_per_generation=4, num_generations=4, max_completion_length=6, scale_rewards="none",
        beta=0.1,
    )  # fmt: skip
    set_seed(0)
    backend = TransformersBackend.from_tokenizer(tiny_model, tokenizer, seed=0)
    run = build_parts(args, backend, tokenizer, None, (), reward_functions(completion_tokens))
    # Two processes, each playing 2 prompts (the config counted one process).
    plan = replace(RoundPlan.from_config(args, num_processes=1), num_processes=2)
    logprobs = partial(batched_logprobs, tiny_model, temperature=1.0, rows_per_pass=4)

    def two_processes(tensor: torch.Tensor) -> torch.Tensor:
        """Stands in for a gather over two processes, the other one playing the same round."""
        return torch.cat([tensor, tensor])

    parts = RoundParts(
        play=lambda rows, g, seed: anyio.run(play_round, run.engine, rows, g, seed, run.scorer),
        shaping=RewardShaping.from_config(args),
        collate=partial(collate_episodes, pad_token_id=tokenizer.pad_token_id),
        old_logprobs=logprobs,
        ref_logprobs=logprobs,
        gather=two_processes,
        process_index=1,
    )
    rows = [{"prompt": "Count to three."}, {"prompt": "Name a colour."}]
    round_ = play_and_batch(parts, plan, rows, seed=1)

    assert plan.prompts_per_process == 2 and len(round_.episodes) == 8
    assert [e.group for e in round_.episodes] == [0, 0, 0, 0, 1, 1, 1, 1]
    lengths_N = torch.tensor([float(len(single_row(e).completion_ids)) for e in round_.episodes])
    assert round_.rewards_N.tolist() == lengths_N.tolist()
    group_means_N = lengths_N.view(2, 4).mean(1).repeat_interleave(4)
    assert torch.allclose(round_.advantages_N, lengths_N - group_means_N)  # scale "none"
    assert len(round_.micro_batches) == 4 and all(len(b) == 2 for b in round_.micro_batches)
    round_tokens = 2 * sum(sum(single_row(e).loss_mask) for e in round_.episodes)  # both processes
    assert all(b.num_items == round_tokens / 2 for b in round_.micro_batches)  # 2 steps a round
    assert all(b.old_logprobs_B_C is not None for b in round_.micro_batches)
    assert all(b.ref_logprobs_B_C is not None for b in round_.micro_batches)
    trained_on = sorted(float(a) for b in round_.micro_batches for a in b.advantages_B)
    assert trained_on == sorted(round_.advantages_N.tolist())  # each episode once, shuffled


def test_eval_and_training_play_episodes_with_the_same_settings(tmp_path, tokenizer):
    options = [
        "eval",
        "env:Counter",
        "--temperature=0.7",
        "--top-p=0.9",
        "--top-k=5",
        "--tool-timeout-s=3",
        "--max-turns=3",
        "--max-completion-length=32",
    ]
    namespace = build_parser()[0].parse_args(options)
    episode = dict(temperature=0.7, top_p=0.9, top_k=5, tool_timeout_s=3.0, max_turns=3)
    expected = EpisodeConfig(max_completion_length=32, **episode)
    # chatml_tools: eval's default for the default model
    training = grpo_config(
        tmp_path, max_completion_length=32, **episode, chat_template="chatml_tools"
    )
    assert episode_config_of(eval_config(namespace, Counter)) == expected
    backend = scripted_backend(tokenizer, ["Done."])
    trained = build_parts(training, backend, tokenizer, Counter)  # as GRPOTrainer builds it
    assert trained.episode_config == trained.engine.context.config == expected
