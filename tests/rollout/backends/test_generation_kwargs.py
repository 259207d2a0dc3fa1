"""TRL's `generation_kwargs` in the transformers backend: what `generate` would do, or a refusal.

TRL passes `generation_kwargs` to transformers' `GenerationConfig` for `model.generate`. The
backend applies every setting that samples one completion from the policy, as `generate` does
(checked token for token against `generate` itself, greedy, and processed score for processed
score, sampling), keeps each token's sampler logprob that of softmax(logits / T), and refuses
the rest by name, saying why in TRL's terms.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from rollout.backends.generation_rows import Request, Row
from rollout.backends.generation_settings import generation_settings, row_processors
from rollout.backends.transformers import TransformersBackend
from rollout.types import SamplingParams
from tests.support.tiny_model import tiny_llama

PROMPT = "The sky is blue and the"
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# What TRL passes `generate` besides `generation_kwargs` (GRPOConfig's defaults); unset,
# `generate` would filter with its own default top_k of 50.
TRL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


def transformers_generate(model, prompt_ids, stop, max_tokens, **kwargs) -> list[int]:
    """What `model.generate` samples after the prompt, up to its first stop id."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        eos_token_id=stop,
        pad_token_id=0,
        **(TRL_SAMPLING | kwargs),
    )
    ids = out[0, len(prompt_ids) :].tolist()
    stops = [i for i, token in enumerate(ids) if token in stop]
    return ids[: stops[0] + 1] if stops else ids


def backend_generate(model, prompt_ids, stop, max_tokens, static_cache=False, **kwargs):
    """The backend's completion of the prompt, with `kwargs` as its `generation_kwargs`."""
    backend = TransformersBackend(
        model, stop, 0, sampling_overrides=kwargs, static_cache=static_cache
    )
    params = SamplingParams(max_tokens=max_tokens, seed=7)
    return anyio.run(backend.generate, prompt_ids, params)


# Greedy decoding under each setting, as a function of the token plain greedy decoding repeats.
GREEDY_SETTINGS = {
    "no_repeat_ngram_size": lambda first: {"no_repeat_ngram_size": 2},
    "penalty_then_ngrams": lambda first: {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
    "bad_words_ids": lambda first: {"bad_words_ids": [[first]]},
    "suppress_tokens": lambda first: {"suppress_tokens": [first]},
    "begin_suppress_tokens": lambda first: {"begin_suppress_tokens": [first]},
    "sequence_bias": lambda first: {"sequence_bias": {(first,): -10.0}},
    "encoder_repetition_penalty": lambda first: {"encoder_repetition_penalty": 0.3},
    "min_new_tokens": lambda first: {"min_new_tokens": 3},
    "forced_eos_token_id": lambda first: {"forced_eos_token_id": 2},
}


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic", "slots"])
@pytest.mark.parametrize("setting", sorted(GREEDY_SETTINGS))
def test_greedy_decoding_with_generation_kwargs_is_what_transformers_generate_decodes(
    tokenizer, model, setting, static_cache
):
    prompt_ids = tokenizer.encode(PROMPT)
    [first, *_] = transformers_generate(model, prompt_ids, [tokenizer.eos_token_id], 1)
    # The repeated token is a stop id here, so min_new_tokens changes where the turn ends.
    stop = [first] if setting == "min_new_tokens" else [2]
    kwargs = GREEDY_SETTINGS[setting](first)
    expected = transformers_generate(model, prompt_ids, stop, 10, do_sample=False, **kwargs)
    completion = backend_generate(
        model, prompt_ids, stop, 10, static_cache, do_sample=False, **kwargs
    )
    assert completion.token_ids == expected
    assert completion.token_ids != transformers_generate(model, prompt_ids, stop, 10)


SAMPLING_SETTINGS = {
    "typical_epsilon_eta": {"typical_p": 0.9, "epsilon_cutoff": 3e-5, "eta_cutoff": 3e-4},
    "all_filters_and_penalties": {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.01,
        "typical_p": 0.9,
        "repetition_penalty": 1.2,
        "no_repeat_ngram_size": 2,
    },
    "top_h": {"top_h": 0.6, "temperature": 0.8},
}


@pytest.mark.parametrize("setting", sorted(SAMPLING_SETTINGS))
def test_each_draw_is_from_the_distribution_transformers_generate_samples_from(
    tokenizer, model, setting
):
    # generate's `scores` are the processed logits it drew each token from, its `logits` the
    # model's own: a row holding the same tokens so far must process these into those.
    kwargs = SAMPLING_SETTINGS[setting]
    prompt_ids, stop = tokenizer.encode(PROMPT), [tokenizer.eos_token_id]
    torch.manual_seed(3)
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=True,
        max_new_tokens=4,
        eos_token_id=stop,
        pad_token_id=0,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        **(TRL_SAMPLING | kwargs),
    )
    sampled = out.sequences[0, len(prompt_ids) :].tolist()
    settings = generation_settings(kwargs, stop)
    sampling = DEFAULTS | settings.sampling
    processors = row_processors(settings, sampling, prompt_ids, 4, stop, 49152, torch.device("cpu"))
    row = Row(
        Request(prompt_ids, SamplingParams(max_tokens=4)), sampling, 0, [], processors=processors
    )
    for k, (logits_1_V, expected_1_V) in enumerate(zip(out.logits, out.scores, strict=True)):
        row.tokens = sampled[:k]
        processed_1_V = row.processed(logits_1_V)
        kept = torch.isfinite(expected_1_V)
        assert torch.equal(torch.isfinite(processed_1_V), kept)
        assert torch.allclose(processed_1_V[kept], expected_1_V[kept], atol=1e-5)


def test_sampler_logprobs_stay_those_of_softmax_logits_over_t_before_every_processor(
    tokenizer, model
):
    kwargs = SAMPLING_SETTINGS["all_filters_and_penalties"]
    prompt_ids = tokenizer.encode(PROMPT)
    completion = backend_generate(model, prompt_ids, [2], 6, **kwargs)
    with torch.no_grad():
        logits_T_V = model(torch.tensor([prompt_ids + completion.token_ids])).logits[0]
    logprobs_T_V = torch.log_softmax(logits_T_V[len(prompt_ids) - 1 : -1] / 0.7, dim=-1)
    expected = logprobs_T_V.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_max_new_tokens_bounds_each_turn_within_the_episodes_budget(tokenizer, model):
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(backend_generate(model, prompt_ids, [2], 8, max_new_tokens=3).token_ids) == 3
    assert len(backend_generate(model, prompt_ids, [2], 2, max_new_tokens=3).token_ids) == 2
    with pytest.raises(ValueError, match=r"\{'max_new_tokens': 0\}: the most tokens one turn"):
        TransformersBackend(model, [2], 0, sampling_overrides={"max_new_tokens": 0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1},
        {"length_penalty": -0.1, "early_stopping": True},  # beam-only: nothing to change
        {"use_cache": True, "cache_implementation": "dynamic", "output_scores": True},
        {"max_length": 20, "pad_token_id": 0, "bos_token_id": 1, "renormalize_logits": True},
        {"do_sample": True, "top_p": None, "guidance_scale": 1.0, "penalty_alpha": None},
        {"eos_token_id": 2, "remove_invalid_values": True},
    ],
)
def test_settings_that_change_nothing_sampled_are_accepted(model, kwargs):
    TransformersBackend(model, [2], 0, sampling_overrides=kwargs)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"num_beams": 2}, "beam search keeps several hypotheses"),
        ({"num_beam_groups": 2}, "group beam search"),
        ({"diversity_penalty": 0.5}, "group beam search"),
        ({"force_words_ids": [[5]]}, "constrained beam search"),
        ({"num_return_sequences": 4}, "GRPO's group size is num_generations"),
        ({"penalty_alpha": 0.6}, "contrastive search"),
        ({"dola_layers": "high"}, "DoLa"),
        ({"guidance_scale": 1.5}, "classifier-free guidance"),
        ({"token_healing": True}, "episodes are token-exact"),
        ({"stop_strings": ["</answer>"]}, "turns end on stop token ids"),
        ({"max_time": 2.0}, "bound turns by tokens"),
        ({"encoder_no_repeat_ngram_size": 2}, "encoder-decoder models"),
    ],
)
def test_settings_that_cannot_give_per_token_sampler_logprobs_are_refused_by_name(
    model, kwargs, why
):
    [(name, value)] = kwargs.items()
    with pytest.raises(ValueError) as refused:
        TransformersBackend(model, [2], 0, sampling_overrides=kwargs)
    message = str(refused.value)
    assert message.startswith(f"generation_kwargs={{{name!r}: {value!r}}} cannot be used")
    assert why in message and "Remove it from generation_kwargs" in message


def test_a_sampled_setting_that_cannot_be_sampled_says_what_grpo_needs(model):
    with pytest.raises(ValueError, match="no per-token sampler logprobs, which GRPO's importance"):
        TransformersBackend(model, [2], 0, sampling_overrides={"num_beams": 4})


def test_names_that_are_no_generation_setting_are_refused_with_the_nearest_one(model):
    with pytest.raises(
        ValueError, match=r"\['typical'\] is not a transformers generation setting.*'typical_p'"
    ):
        TransformersBackend(model, [2], 0, sampling_overrides={"typical": 0.9})
    with pytest.raises(ValueError, match=r"'presence_penalty'.*use_vllm=True"):
        TransformersBackend(model, [2], 0, sampling_overrides={"presence_penalty": 0.5})


def test_an_eos_token_id_that_adds_a_stop_id_is_refused_naming_the_generation_config(model):
    with pytest.raises(ValueError, match=r"'eos_token_id': \[2, 9\].*model.generation_config"):
        TransformersBackend(model, [2], 0, sampling_overrides={"eos_token_id": [2, 9]})


def test_a_value_transformers_refuses_fails_when_the_backend_is_built(model):
    with pytest.raises(ValueError, match="top_h"):
        TransformersBackend(model, [2], 0, sampling_overrides={"top_h": 1.5})
