"""The sampler/trainer mismatch metrics (TRL's `sampling/*` names), by hand and in real runs."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.token_weights import TokenWeighting, sampler_correction, sampler_ratios
from agentgrpo.precision import corrects_sampler_mismatch
from agentgrpo.reporting.sampling import (
    SAMPLING_METRICS,
    SamplingWindow,
    combine_stats,
    sampling_metrics,
    sampling_stats,
)
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import rank_in_call, short_run_config, tiny_trainer

E = math.e
# Two rows; the loss counts tokens (0, 0), (0, 1) and (1, 0).
TRAINER_B_C = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
SAMPLER_B_C = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, 9.0, 9.0]])
MASK_B_C = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
# trainer - sampler on those tokens: 0.5, -1.0, 0.0


def batch_of(episode_B: list[int]) -> TrainingBatch:
    """A batch carrying the sampler logprobs and mask above (other fields unused)."""
    ids_B_L = torch.zeros(2, 3, dtype=torch.long)
    return TrainingBatch(
        ids_B_L,
        torch.ones_like(ids_B_L),
        torch.arange(3).expand(2, 3),
        MASK_B_C,
        SAMPLER_B_C,
        torch.zeros(2),
        torch.tensor(episode_B),
    )


def approx(values) -> list:
    return pytest.approx(values, abs=1e-6)


# --- by hand ----------------------------------------------------------------------------------


def test_token_ratios_are_one_per_loss_token():
    ratios = sampler_ratios(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, "token")
    assert ratios.tolist() == approx([E**0.5, E**-1.0, 1.0])


def test_sequence_ratios_are_one_per_episode_over_all_its_rows():
    one = sampler_ratios(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, "sequence", torch.tensor([5, 5]))
    assert one.tolist() == approx([E ** (-0.5 / 3)])  # the mean of 0.5, -1, 0
    two = sampler_ratios(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, "sequence", torch.tensor([0, 1]))
    assert two.tolist() == approx([E**-0.25, 1.0])


def test_an_episode_without_loss_tokens_has_no_ratio():
    mask_B_C = MASK_B_C * torch.tensor([[1.0], [0.0]])
    ratios = sampler_ratios(TRAINER_B_C, SAMPLER_B_C, mask_B_C, "sequence", torch.tensor([0, 1]))
    assert ratios.tolist() == approx([E**-0.25])


def test_the_logged_ratios_are_raw_without_a_correction_and_its_weights_with_one():
    raw = TokenWeighting(sampler_ratio_level="token").sampler_ratios(batch_of([0, 1]), TRAINER_B_C)
    assert raw.tolist() == approx([E**0.5, E**-1.0, 1.0])
    masked = TokenWeighting(sampler_correction_mode="token_mask", clip_max=1.5)
    assert masked.sampler_ratios(batch_of([0, 1]), TRAINER_B_C).tolist() == approx(
        [0.0, E**-1.0, 1.0]  # e ** 0.5 > 1.5: masked to 0, as TRL logs it
    )
    truncated = TokenWeighting(sampler_correction_mode="token_truncate", clip_max=1.5)
    assert truncated.sampler_ratios(batch_of([0, 1]), TRAINER_B_C).tolist() == approx(
        [1.5, E**-1.0, 1.0]
    )
    by_sequence = TokenWeighting(sampler_correction_mode="sequence_truncate", clip_min=0.9)
    assert by_sequence.sampler_ratios(batch_of([0, 1]), TRAINER_B_C).tolist() == approx([0.9, 1.0])


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate", "sequence_mask"])
def test_the_logged_ratios_are_the_weights_the_correction_applies(mode):
    weighting = TokenWeighting(sampler_correction_mode=mode, clip_max=1.5, clip_min=0.5)
    episode_B = torch.tensor([0, 0])
    weights_B_C = sampler_correction(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, mode, 1.5, 0.5, episode_B)
    applied = set(weights_B_C[MASK_B_C.bool()].tolist())
    assert set(weighting.sampler_ratios(batch_of([0, 0]), TRAINER_B_C).tolist()) == applied


def test_stats_of_a_micro_batch_and_the_metrics_they_give():
    ratios_U = torch.tensor([E**0.5, E**-1.0, 1.0])
    stats_8 = sampling_stats(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, ratios_U)
    metrics = sampling_metrics(stats_8.unsqueeze(0))
    assert list(metrics) == list(SAMPLING_METRICS)
    assert [metrics[name] for name in SAMPLING_METRICS] == approx(
        [0.5, 1.0, E**-1.0, (E**0.5 + E**-1.0 + 1.0) / 3, E**0.5]
    )


def test_a_token_the_sampler_could_not_score_is_left_out():
    sampler_B_C = SAMPLER_B_C.clone()
    sampler_B_C[0, 1] = math.nan
    ratios_U = sampler_ratios(TRAINER_B_C, sampler_B_C, MASK_B_C, "token")
    metrics = sampling_metrics(sampling_stats(TRAINER_B_C, sampler_B_C, MASK_B_C, ratios_U)[None])
    assert [metrics[name] for name in SAMPLING_METRICS] == approx(
        [0.25, 0.5, 1.0, (E**0.5 + 1.0) / 2, E**0.5]
    )


def test_a_step_pools_its_micro_batches_and_every_process():
    first = sampling_stats(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, torch.tensor([2.0, 0.5]))
    # a second micro-batch: one token 3 nats off, ratio 4
    second = sampling_stats(
        torch.zeros(1, 1), torch.tensor([[3.0]]), torch.ones(1, 1), torch.tensor([4.0])
    )
    pooled = sampling_metrics(combine_stats(first, second).unsqueeze(0))
    by_process = sampling_metrics(torch.stack([first, second]))
    assert pooled == by_process
    assert [pooled[name] for name in SAMPLING_METRICS] == approx(
        [4.5 / 4, 3.0, 0.5, 6.5 / 3, 4.0]  # over 4 tokens and 3 ratios
    )


def test_a_window_without_tokens_logs_nothing_and_does_not_hide_the_others():
    empty_mask = torch.zeros(2, 3)
    window = SamplingWindow()
    window.add(TRAINER_B_C, SAMPLER_B_C, empty_mask, torch.tensor([]))
    assert window.close(lambda local: local) == {}
    assert SamplingWindow().close(lambda local: local) == {}  # nothing added at all

    other = sampling_stats(TRAINER_B_C, SAMPLER_B_C, MASK_B_C, torch.tensor([1.0]))
    window.add(TRAINER_B_C, SAMPLER_B_C, empty_mask, torch.tensor([]))
    metrics = window.close(lambda local: torch.cat([local, other.unsqueeze(0)]))
    assert metrics[SAMPLING_METRICS[0]] == pytest.approx(0.5)
    assert metrics[SAMPLING_METRICS[3]] == 1.0


@pytest.mark.parametrize(
    ("use_vllm", "bf16", "fp16", "correction", "corrects"),
    [
        (False, False, False, True, False),  # float32 transformers: exact, as in TRL
        (True, False, False, True, True),  # vLLM
        (False, True, False, True, True),  # bf16 generation on a GPU
        (False, False, True, True, True),
        (True, True, False, False, False),  # turned off
    ],
)
def test_the_correction_applies_where_the_sampler_numerics_differ(
    use_vllm, bf16, fp16, correction, corrects
):
    args = SimpleNamespace(
        use_vllm=use_vllm, bf16=bf16, fp16=fp16, vllm_importance_sampling_correction=correction
    )
    assert corrects_sampler_mismatch(args) is corrects


# --- real runs of the tiny model --------------------------------------------------------------

PROMPTS = Dataset.from_dict({"prompt": ["The sky is", "Hello", "One two", "A B C"] * 4})


def config(tmp_path, **overrides) -> GRPOConfig:
    """The short run in groups of 2, up to 6 tokens each, at GRPOConfig's own seed (42)."""
    fields = dict(num_generations=2, max_completion_length=6, seed=42)
    return short_run_config(tmp_path, **(fields | overrides))


def step_logs(trainer) -> list[dict]:
    """The log entries of optimizer steps (those with a loss)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("updates", ["one update per round", "old logprobs kept"])
def test_the_transformers_backend_logs_the_five_metrics_every_step(tokenizer, tmp_path, updates):
    reuse = {"num_iterations": 2} if updates == "old logprobs kept" else {}
    trainer = tiny_trainer(tokenizer, rank_in_call, config(tmp_path, **reuse), PROMPTS)
    trainer.train()
    assert not trainer.loss_step.token_weighting.sampler_correction_mode  # float32 on a CPU
    logs = step_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert set(SAMPLING_METRICS) <= log.keys()
        # float32 on a CPU: the sampler computes what the trainer computes, to rounding
        assert log["sampling/sampling_logp_difference/max"] < 1e-3
        ratios = [log[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max")]
        assert ratios == pytest.approx([1.0] * 3, abs=1e-3)


def test_a_rollout_func_logs_how_far_its_logprobs_are_from_the_trainers(tokenizer, tmp_path):
    """The sampler logprobs a `rollout_func` returns (-1 for every token) against the trainer's."""
    completion = [42, 43, tokenizer.eos_token_id]
    played: list[list[int]] = []

    def rollout_func(prompts, trainer):
        ids = [tokenizer.encode(p) for p in prompts]  # G times each
        played.extend(ids)
        return {
            "prompt_ids": ids,
            "completion_ids": [completion] * len(ids),
            "logprobs": [[-1.0] * 3 for _ in ids],
            "env_mask": [[1, 0, 1] for _ in ids],  # 43 comes from the environment
        }

    model = tiny_llama(tokenizer)
    before = copy.deepcopy(model)
    trainer = GRPOTrainer(
        model,
        rank_in_call,
        config(tmp_path, max_steps=1),
        PROMPTS,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.train()
    [log] = step_logs(trainer)
    # The trainer's logprobs of 42 and eos under the weights that played (before the step).
    logprobs_N_2 = torch.stack([sampled_logprobs(before, ids, completion) for ids in played])
    difference_N_2 = (logprobs_N_2 + 1.0).abs()
    assert log["sampling/sampling_logp_difference/mean"] == pytest.approx(
        difference_N_2.mean().item(), rel=1e-4
    )
    assert log["sampling/sampling_logp_difference/max"] == pytest.approx(
        difference_N_2.max().item(), rel=1e-4
    )
    # No correction on a CPU: the raw ratio per episode (the default mode's sequence level).
    # (rel=1e-4 as above: the trainer's batched forward and this one-row forward round the
    # logprobs apart by about float32's precision, 2e-6 relative on an AMD EPYC)
    ratios_N = (logprobs_N_2 + 1.0).mean(1).exp()
    for name, value in (
        ("min", ratios_N.min()),
        ("mean", ratios_N.mean()),
        ("max", ratios_N.max()),
    ):
        assert log[f"sampling/importance_sampling_ratio/{name}"] == pytest.approx(
            value.item(), rel=1e-4
        )


@torch.no_grad()
def sampled_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """logprobs_2: `model`'s of completion[0] and completion[2] after the prompt."""
    ids_1_L = torch.tensor([prompt + completion])
    logprobs_L_V = model(ids_1_L).logits[0].float().log_softmax(-1)
    start = len(prompt) - 1  # the position predicting completion[0]
    return torch.stack([logprobs_L_V[start, completion[0]], logprobs_L_V[start + 2, completion[2]]])
