"""Metrics, logged values and the completions table under the names and meanings of TRL 1.16.

Unit tests check the metric functions against numbers worked out by hand; short real runs of
the tiny model check that a `GRPOTrainer` logs them (its `state.log_history`).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

import agentgrpo
from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.learner.advantages import combine_rewards
from agentgrpo.learner.loss_metrics import (
    cispo_metrics,
    clip_metrics,
    reduce_over_processes,
    vespo_metrics,
)
from agentgrpo.learner.losses import LossConfig, policy_loss
from agentgrpo.learner.objectives import PolicyTerm
from agentgrpo.models.loading import router_aux_loss_coef
from agentgrpo.reporting.completions import CompletionsTable, plain_table, table_integrations
from agentgrpo.reporting.metrics import _COLUMNS as STATS_COLUMNS
from agentgrpo.reporting.metrics import RewardLayout, reward_metrics, round_metrics, tool_metrics
from agentgrpo.reporting.round_report import logged_metrics
from agentgrpo.rounds.scoring import RewardLogs
from environments import Counter
from tests.support.paths import REPO, SUPPORT
from tests.support.runs import one_step
from tests.support.tiny_model import tiny_llama, tiny_qwen2_moe
from tests.support.trl_logged_keys import KINDS, logged_keys, run_logs

NAN = float("nan")


def clip_term(low_B_T: torch.Tensor, high_B_T: torch.Tensor) -> PolicyTerm:
    """A policy term with these clip flags (its loss is not read)."""
    return PolicyTerm(torch.zeros(low_B_T.shape), low_B_T, high_B_T)


def close(value: float, expected: float) -> bool:
    return value == pytest.approx(expected, abs=1e-6)


# --- the metric functions, by hand ----------------------------------------------------------


def test_each_reward_is_logged_as_rewards_name_mean_and_std_over_the_episodes_it_applies_to():
    rewards_N_F = torch.tensor([[1.0, 2.0], [3.0, NAN], [5.0, 4.0], [7.0, NAN]])
    layout = RewardLayout(["correct", "short"], [1.0, 1.0], num_generations=2)
    metrics = reward_metrics(rewards_N_F, torch.tensor([3.0, 3.0, 9.0, 7.0]), layout)
    assert close(metrics["rewards/correct/mean"], 4.0)
    assert close(metrics["rewards/correct/std"], math.sqrt(20 / 3))  # (9+1+1+9) / 3
    assert close(metrics["rewards/short/mean"], 3.0)
    assert close(metrics["rewards/short/std"], math.sqrt(2.0))  # (1+1) / 1
    assert not any(name.startswith("reward/") for name in metrics)


def test_reward_and_reward_std_are_the_batch_stats_of_the_weighted_raw_sum():
    # Weighted sums: 1*1 + 0.5*2 = 2, 3 (the None left out), 5 + 2 = 7, and no reward at all.
    rewards_N_F = torch.tensor([[1.0, 2.0], [3.0, NAN], [5.0, 4.0], [NAN, NAN]])
    layout = RewardLayout(["a", "b"], [1.0, 0.5], num_generations=2)
    metrics = reward_metrics(rewards_N_F, torch.tensor([2.0, 3.0, 7.0, 0.0]), layout)
    assert close(metrics["reward"], 4.0)
    assert close(metrics["reward_std"], math.sqrt(7.0))  # (4+1+9) / 2


def test_with_normalize_then_sum_the_logged_reward_is_the_weighted_raw_reward():
    # Two functions, each constant: every normalised column is 0, so the advantages (and the
    # combined rewards) are 0; TRL logs the weighted raw reward, 0.7 * 1 + 0.3 * 0.
    rewards_N_F = torch.tensor([[1.0, 0.0]] * 4)
    combined_N = combine_rewards(rewards_N_F, [0.7, 0.3], 2, "normalize_then_sum")
    assert combined_N.tolist() == [0.0] * 4
    layout = RewardLayout(["a", "b"], [0.7, 0.3], num_generations=2, batch_scaled=True)
    metrics = reward_metrics(rewards_N_F, combined_N, layout)
    assert close(metrics["reward"], 0.7) and metrics["reward_std"] == 0.0
    assert metrics["frac_reward_zero_std"] == 1.0  # the batch std of the combined rewards is 0


def test_zero_std_counts_groups_or_the_whole_batch_as_the_advantages_are_scaled():
    rewards_N = torch.tensor([1.0, 1.0, 0.0, 1.0])
    by_group = RewardLayout(["a"], [1.0], num_generations=2)
    by_batch = RewardLayout(["a"], [1.0], num_generations=2, batch_scaled=True)
    assert reward_metrics(rewards_N[:, None], rewards_N, by_group)["frac_reward_zero_std"] == 0.5
    assert reward_metrics(rewards_N[:, None], rewards_N, by_batch)["frac_reward_zero_std"] == 0.0


def test_tool_call_frequency_is_calls_per_episode_and_failure_frequency_failures_per_call():
    # Three episodes: 2 calls (one unparsable), none, 1 call (timed out).
    zero = torch.zeros(3)
    column = {
        "tool_calls": torch.tensor([2.0, 0.0, 1.0]),
        "turns": torch.tensor([3.0, 1.0, 2.0]),
        "rows": torch.tensor([1.0, 1.0, 2.0]),
        "parse": torch.tensor([1.0, 0.0, 0.0]),
        "unknown_tool": zero,
        "bad_arguments": zero,
        "exception": zero,
        "timeout": torch.tensor([0.0, 0.0, 1.0]),
        "bad_picture": zero,
        **dict.fromkeys(
            ("compactions", "compaction_rows", "context_before", "context_after"), zero
        ),
        "responses": zero,
    }
    metrics = tool_metrics(column)
    assert metrics["tools/call_frequency"] == 1.0
    assert close(metrics["tools/failure_frequency"], 2 / 3)
    assert close(metrics["tools/failure_frequency/parse"], 1 / 3)
    assert close(metrics["tools/failure_frequency/timeout"], 1 / 3)
    assert metrics["tools/failure_frequency/exception"] == 0.0
    assert metrics["turns/mean"] == 2.0 and metrics["turns/max"] == 3.0


def test_tool_metrics_are_logged_only_when_the_run_has_tools():
    columns = len(STATS_COLUMNS)  # 5 prompt tokens, 3 model tokens, finished, one turn and row
    stats_N_S = torch.tensor([[5.0, 3.0, 0.0, 1.0, 1.0] + [0.0] * (columns - 5)] * 2)
    rewards_N_F, rewards_N = torch.tensor([[1.0], [0.0]]), torch.tensor([1.0, 0.0])
    without = round_metrics(stats_N_S, rewards_N_F, rewards_N, RewardLayout(["a"], [1.0], 2))
    with_tools = RewardLayout(["a"], [1.0], 2, with_tools=True)
    assert not any(k.startswith(("tools/", "turns/")) for k in without)
    assert round_metrics(stats_N_S, rewards_N_F, rewards_N, with_tools)["tools/call_frequency"] == 0


def test_what_reward_functions_log_is_kept_per_group_and_put_back_in_episode_order():
    logs = RewardLogs()
    logs.add_extra(1, 2, "answer", ["c", "d"])  # group 1 finished first
    logs.add_extra(0, 2, "answer", ["a", "b"])
    logs.add_extra(1, 2, "only_group_1", [True, False])
    logs.add_metric("accuracy", 0.5)
    logs.add_metric("accuracy", 1.0)
    assert logs.take_extra(num_groups=2, num_generations=2) == {
        "answer": ["a", "b", "c", "d"],
        "only_group_1": [None, None, True, False],
    }
    assert logs.take_metrics() == {"accuracy": (1.5, 2)}
    assert logs.take_extra(2, 2) == {} and logs.take_metrics() == {}
    assert logged_metrics({"accuracy": (1.5, 2)}, lambda t: t, list) == {"accuracy": 0.75}


def test_log_extra_with_the_wrong_number_of_values_says_what_to_pass():
    with pytest.raises(ValueError, match=r"log_extra\('answer', values\) got 1 values for 2"):
        RewardLogs().add_extra(0, 2, "answer", ["a"])


# --- the completions table -------------------------------------------------------------------


def table() -> CompletionsTable:
    return CompletionsTable(
        step=3,
        prompts=["2+2=", [{"role": "user", "content": "Hi"}]],
        completions=["4", [{"role": "assistant", "content": "Hello\nthere"}]],
        rewards={"correct": [1.0, 0.0], "short": [0.5, NAN]},
        advantages=[0.7071, -0.7071],
        extra={"golden_answer": ["4", "Hello"]},
    )


def test_the_completions_table_has_trls_columns_in_trls_order():
    columns = table().columns()
    assert list(columns) == [
        "step",
        "prompt",
        "completion",
        "correct",
        "short",
        "golden_answer",
        "advantage",
    ]
    assert columns["step"] == [3, 3] and columns["advantage"] == [0.7071, -0.7071]
    frame = table().frame()
    assert list(frame.columns) == list(columns) and len(frame) == 2
    assert frame["prompt"][1] == [{"role": "user", "content": "Hi"}]  # as the rewards saw it


def test_unique_prompts_keep_each_prompts_first_row():
    repeated = CompletionsTable(1, ["p", "p", "q"], ["a", "b", "c"], {}, [0.0, 0.0, 0.0])
    assert repeated.frame(unique_prompts=True)["completion"].tolist() == ["a", "c"]


def test_num_completions_to_print_draws_that_many_rows_in_order():
    big = CompletionsTable(7, list("abcdef"), list("abcdef"), {}, [0.0] * 6)
    drawn = big.rows(3)
    assert len(drawn) == 3 and drawn == sorted(set(drawn)) and big.rows(3) == drawn
    assert big.rows(None) == big.rows(6) == list(range(6)) and big.rows(0) == []


def test_without_rich_the_table_prints_as_plain_text():
    # Each column is as wide as its widest cell; messages are put on one line.
    header = "Prompt   | Completion             | correct | short | Advantage | golden_answer"
    assert plain_table(table(), [0, 1]).splitlines() == [
        "Step 3",
        header,
        "-" * 9 + "+" + "-" * 24 + "+" + "-" * 9 + "+" + "-" * 7 + "+" + "-" * 11 + "+" + "-" * 14,
        "2+2=     | 4                      | 1.00    | 0.50  | 0.71      | 4",
        "user: Hi | assistant: Hello there | 0.00    | nan   | -0.71     | Hello",
    ]


def test_only_installed_integrations_that_take_tables_get_the_table():
    assert table_integrations(["none"]) == [] and table_integrations(None) == []
    if importlib.util.find_spec("trackio") is None:
        assert table_integrations(["trackio", "tensorboard"]) == []


# --- real runs of the tiny model --------------------------------------------------------------


def config(tmp_path, **changes) -> GRPOConfig:
    """`one_step`, with tqdm's progress bars on."""
    return GRPOConfig(**one_step(tmp_path, **({"disable_tqdm": False} | changes)))


DATASET = Dataset.from_dict({"prompt": ["2+2=", "3+3="], "ground_truth": ["4", "6"]})


def train(model, tokenizer, args, **arguments) -> tuple[GRPOTrainer, dict]:
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, **arguments)
    trainer.train()
    return trainer, [log for log in trainer.state.log_history if "reward" in log][-1]


def constant(value: float):
    def reward(completions, **kwargs):
        return [value] * len(completions)

    reward.__name__ = f"always_{value}".replace(".", "_")
    return reward


def test_example_6_logs_its_metric_and_shows_its_columns_in_the_completions_table(
    tokenizer, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "200")  # a console wide enough for whole column names

    def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
        extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        extracted = [m.group(1) if m else None for m in extracted]
        rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth, strict=True)]
        if log_extra:
            log_extra("golden_answer", list(ground_truth))
            log_extra("extracted_answer", [e or "[none]" for e in extracted])
        if log_metric:
            log_metric("accuracy", sum(rewards) / len(rewards))
        return rewards

    args = config(tmp_path, log_completions=True, num_completions_to_print=2)
    trainer, log = train(
        tiny_llama(tokenizer), tokenizer, args, reward_funcs=reward_func, train_dataset=DATASET
    )
    # The random model never writes \boxed{...}: accuracy and the reward are 0, exactly.
    assert log["accuracy"] == 0.0 and log["rewards/reward_func/mean"] == 0.0
    assert not any(key.startswith(("tools/", "turns/")) for key in log)  # no tools in this run
    shown = trainer.last_completions
    assert shown is not None and shown.step == 0  # played at step 0, logged at step 1
    assert shown.extra["golden_answer"] == ["4", "4", "6", "6"]  # in episode order
    assert shown.extra["extracted_answer"] == ["[none]"] * 4
    assert shown.rewards == {"reward_func": [0.0] * 4} and shown.prompts[0] == "2+2="
    printed = capsys.readouterr().out
    assert "Step 1" in printed and "golden_answer" in printed and "extracted_answer" in printed
    assert printed.count("[none]") == 2  # num_completions_to_print rows, shown once


def test_normalize_then_sum_logs_the_weighted_raw_reward_in_a_run(tokenizer, tmp_path):
    args = config(
        tmp_path, multi_objective_aggregation="normalize_then_sum", reward_weights=[0.7, 0.3]
    )
    _, log = train(
        tiny_llama(tokenizer),
        tokenizer,
        args,
        reward_funcs=[constant(1.0), constant(0.0)],
        train_dataset=DATASET,
    )
    assert log["reward"] == pytest.approx(0.7) and log["reward_std"] == 0.0
    assert log["rewards/always_1_0/mean"] == 1.0 and log["rewards/always_0_0/mean"] == 0.0


def test_an_entropy_bonus_logs_policy_loss_and_entropy_coef_and_moves_the_weights(
    tokenizer, tmp_path
):
    # A constant reward gives every advantage 0: only the entropy bonus has a gradient.
    args = config(tmp_path, entropy_coef=0.01)
    _, log = train(
        tiny_llama(tokenizer), tokenizer, args, reward_funcs=constant(1.0), train_dataset=DATASET
    )
    assert log["entropy_coef"] == 0.01 and log["policy_loss"] == 0.0
    assert log["loss"] == pytest.approx(log["policy_loss"] - 0.01 * log["entropy"], abs=1e-4)
    assert log["grad_norm"] > 0.0


def test_without_an_entropy_bonus_there_is_no_policy_loss_or_entropy_coef(tokenizer, tmp_path):
    _, log = train(
        tiny_llama(tokenizer),
        tokenizer,
        config(tmp_path),
        reward_funcs=constant(1.0),
        train_dataset=DATASET,
    )
    assert "policy_loss" not in log and "entropy_coef" not in log and "aux_loss" not in log
    assert log["grad_norm"] == 0.0  # every advantage is 0 and nothing else is trained


def test_a_mixture_of_experts_model_adds_and_logs_its_load_balancing_loss(tokenizer, tmp_path):
    args = config(tmp_path, router_aux_loss_coef=0.5)
    trainer, log = train(
        tiny_qwen2_moe(tokenizer),
        tokenizer,
        args,
        reward_funcs=constant(1.0),
        train_dataset=DATASET,
    )
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    # Every advantage is 0, so the loss is the weighted load-balancing loss alone.
    assert log["aux_loss"] > 0.0
    assert log["loss"] == pytest.approx(0.5 * log["aux_loss"], abs=1e-4)
    assert log["grad_norm"] > 0.0


def test_the_load_balancing_weight_comes_from_the_config_and_needs_experts(tokenizer):
    moe = tiny_qwen2_moe(tokenizer)
    assert router_aux_loss_coef(moe, None) == 0.001  # Qwen2MoE's own router_aux_loss_coef
    assert router_aux_loss_coef(moe, 0.0) == 0.0
    llama = tiny_llama(tokenizer)
    assert router_aux_loss_coef(llama, None) == 0.0
    with pytest.raises(ValueError, match="is not a Mixture-of-Experts model"):
        router_aux_loss_coef(llama, 0.01)


def test_tool_metrics_of_a_run_count_the_calls_of_its_episodes(
    tokenizer, tool_calling_tiny_model, tmp_path
):
    args = config(
        tmp_path,
        max_completion_length=64,
        chat_template="chatml_tools",
        log_completions=True,
    )
    rows = Dataset.from_list([{"prompt": "Make the counter reach 7.", "target": 7}] * 2)
    trainer, log = train(
        copy.deepcopy(tool_calling_tiny_model),
        tokenizer,
        args,
        train_dataset=rows,
        environment_factory=Counter,
    )
    episodes = [record.episode for record in trainer.last_records]
    calls = sum(e.stats.tool_calls for e in episodes)
    failures = sum(e.stats.tool_failures for e in episodes)
    assert calls > 0  # the taught model calls its tool
    assert log["tools/call_frequency"] == pytest.approx(calls / len(episodes))
    assert log["tools/failure_frequency"] == pytest.approx(failures / calls)
    assert log["turns/mean"] == pytest.approx(sum(e.stats.turns for e in episodes) / 4)
    assert "rewards/Counter/mean" in log
    assert trainer.last_completions is not None and len(trainer.last_completions) == 4


def test_the_policy_loss_metric_is_the_loss_before_the_entropy_bonus():
    # On-policy (ratio 1) with advantage 1, every token's loss is -1; bnpo takes their mean.
    ones_1_2 = torch.ones(1, 2)
    out = policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        ones_1_2,
        LossConfig(loss_type="bnpo", entropy_coef=0.1),
        entropy_B_T=torch.tensor([[2.0, 4.0]]),
    )
    assert close(out.metrics["policy_loss"], -1.0)
    assert close(out.loss, -1.0 - 0.1 * 3.0)


# --- TRL's clip metrics, per sequence -------------------------------------------------------


def test_clip_ratio_low_min_and_high_max_are_the_extreme_shares_of_one_episode():
    # Episode 7 has two rows (a fork): 1 of its 4 active tokens clipped low, 3 clipped high.
    # Episode 3 (one row): 2 of 2 clipped low, none high. Episode 9 has no active token.
    low_B_T = torch.tensor([[True, False], [False, False], [True, True], [True, True]])
    high_B_T = torch.tensor([[False, True], [True, True], [False, False], [False, False]])
    mask_B_T = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]])
    term = clip_term(low_B_T, high_B_T)
    metrics = clip_metrics(term, mask_B_T, episode_B=torch.tensor([7, 7, 3, 9]))
    assert close(metrics["clip_ratio/low_mean"], 3 / 6)
    assert close(metrics["clip_ratio/high_mean"], 3 / 6)
    assert close(metrics["clip_ratio/region_mean"], 6 / 6)
    assert close(metrics["clip_ratio/low_min"], 1 / 4)  # episode 7's share; 9 has none
    assert close(metrics["clip_ratio/high_max"], 3 / 4)


def test_cispo_logs_its_capped_share_and_vespo_its_mean_episode_weight():
    high_B_T = torch.tensor([[True, False], [False, False]])
    no_B_T = torch.zeros(2, 2, dtype=torch.bool)
    cispo = cispo_metrics(clip_term(no_B_T, high_B_T), torch.ones(2, 2))
    assert close(cispo["cispo_clip_ratio"], 1 / 4) and "clip_ratio/low_min" in cispo
    # Rows 0 and 1 are one episode (weight 0.5), row 2 another (weight 2): the mean is 1.25.
    phi_B_1 = torch.tensor([[0.5], [0.5], [2.0]])
    term = clip_term(torch.zeros(3, 1, dtype=torch.bool), torch.zeros(3, 1, dtype=torch.bool))
    term = term._replace(sequence_weight_B_1=phi_B_1)
    vespo = vespo_metrics(term, torch.ones(3, 1), episode_B=torch.tensor([0, 0, 1]))
    assert close(vespo["vespo/phi_seq_mean"], 1.25)


def test_min_and_max_metrics_take_the_extremes_over_processes_and_the_others_the_mean():
    values_P_M = torch.tensor([[0.2, 0.5, 1.0, NAN], [0.1, 0.9, NAN, NAN]])
    names = ["clip_ratio/low_min", "clip_ratio/high_max", "entropy", "kl"]
    low_min, high_max, entropy, kl = reduce_over_processes(names, values_P_M)
    assert close(low_min, 0.1) and close(high_max, 0.9) and close(entropy, 1.0)
    assert math.isnan(kl)  # no process had a value


# --- Every key TRL 1.16 logs for a run, agentgrpo logs --------------------------------------

# What TRL 1.16's GRPOTrainer logs for each kind of run of `trl_logged_keys.KINDS`, read from its
# grpo_trainer.py (`_generate`, `_generate_and_score_completions`, `_compute_loss`,
# `training_step`) and transformers' Trainer; test_the_keys_listed_for_trl_are_what_trl_logs
# runs TRL itself to check the list.
TRAINER_KEYS = {"epoch", "grad_norm", "learning_rate", "loss", "step", "total_flos"}
TRAINER_KEYS |= {f"train_{k}" for k in ("loss", "runtime", "samples_per_second")}
TRAINER_KEYS |= {"train_steps_per_second"}
ROUND_KEYS = {"num_tokens", "reward", "reward_std", "frac_reward_zero_std", "entropy"}
ROUND_KEYS |= {f"completions/{k}_length" for k in ("mean", "min", "max")}
ROUND_KEYS |= {f"completions/{k}_terminated_length" for k in ("mean", "min", "max")}
ROUND_KEYS |= {"completions/clipped_ratio"}
CLIP_KEYS = {f"clip_ratio/{k}" for k in ("low_mean", "high_mean", "region_mean")}
CLIP_KEYS |= {"clip_ratio/low_min", "clip_ratio/high_max"}
LENGTH_REWARD = {"rewards/length_reward/mean", "rewards/length_reward/std"}
EVALUATED = ROUND_KEYS | CLIP_KEYS | LENGTH_REWARD | {"kl", "policy_loss", "loss"}
TRL_LOGGED_KEYS = {
    "dapo": TRAINER_KEYS | ROUND_KEYS | CLIP_KEYS | LENGTH_REWARD | {"step_time"},
    "grpo_kl_entropy_eval": TRAINER_KEYS
    | ROUND_KEYS
    | CLIP_KEYS
    | LENGTH_REWARD
    | {"step_time", "kl", "policy_loss", "entropy_coef"}
    | {f"eval_{k}" for k in EVALUATED | {"runtime", "samples_per_second", "steps_per_second"}},
    "cispo": TRAINER_KEYS | ROUND_KEYS | LENGTH_REWARD | {"step_time", "cispo_clip_ratio"},
    "vespo": TRAINER_KEYS | ROUND_KEYS | LENGTH_REWARD | {"step_time", "vespo/phi_seq_mean"},
    "environment": TRAINER_KEYS
    | ROUND_KEYS
    | CLIP_KEYS
    | {"step_time", "rewards/Counter/mean", "rewards/Counter/std"}
    | {"tools/call_frequency", "tools/failure_frequency"},
}


@pytest.fixture(scope="module")
def agentgrpo_logs(tiny_model_dir, tmp_path_factory):
    """kind -> the `log_history` of agentgrpo's run of that kind (each run once per module)."""

    @functools.cache
    def logs(kind: str) -> list[dict]:
        return run_logs(agentgrpo, kind, str(tiny_model_dir), str(tmp_path_factory.mktemp(kind)))

    return logs


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_key_trl_logs_for_a_run_agentgrpo_logs_too(agentgrpo_logs, kind):
    missing = TRL_LOGGED_KEYS[kind] - set(logged_keys(agentgrpo_logs(kind)))
    assert not missing, f"TRL 1.16 logs {sorted(missing)} for this run; agentgrpo does not"


def test_eval_logs_carry_the_training_tokens_seen_as_num_tokens_as_trl_does(agentgrpo_logs):
    logs = agentgrpo_logs("grpo_kl_entropy_eval")
    [train] = [log for log in logs if "reward" in log]
    [evaluation] = [log for log in logs if "eval_reward" in log]
    assert evaluation["eval_num_tokens"] == train["num_tokens"] > 0


TRL_INSTALLED = importlib.util.find_spec("trl") is not None


@pytest.mark.slow
@pytest.mark.skipif(not TRL_INSTALLED, reason="needs trl (make install puts 1.16.0 in)")
@pytest.mark.process
def test_the_keys_listed_for_trl_are_what_trl_logs(tiny_model_dir, tmp_path):
    # About 40 s: TRL's import brings vLLM's; a process of its own keeps it out of this one.
    script = SUPPORT / "trl_logged_keys.py"
    done = subprocess.run(
        [sys.executable, str(script), "trl", str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    [line] = [line for line in done.stdout.splitlines() if line.startswith("LOGGED_KEYS ")]
    logged = json.loads(line.removeprefix("LOGGED_KEYS "))
    assert {kind: set(keys) for kind, keys in logged.items()} == TRL_LOGGED_KEYS
