"""TRL's `generation_kwargs` in the transformers backend: which apply, how, and which cannot.

TRL passes `generation_kwargs` to transformers' `GenerationConfig` for `model.generate`. Here
every `GenerationConfig` field falls in one of five kinds:

- drawn by agentgrpo's own sampler, batched and on the device (`SAMPLER_FIELDS`, `do_sample`);
- applied with transformers' own logits processors, in `generate`'s order, to each row before
  its draw (`PROCESSOR_FIELDS`): the same distribution `generate` would sample from;
- `max_new_tokens`: the most tokens one turn (one `generate` call) samples, within the
  episode's `max_completion_length`;
- without effect on which tokens are sampled (`INERT_FIELDS`: speed, output format,
  encoder-decoder or beam-only settings, and `max_length`, which TRL's `max_new_tokens`
  overrides);
- refused, by name, with the reason (`REFUSED`): decoding that does not sample one completion
  from the policy's next-token distributions (beam, contrastive, DoLa, guidance), so its tokens
  have no per-token sampler logprobs, and settings that break token-exact episodes.

Whatever applies, a token's sampler logprob stays log softmax(logits / T) at that token, before
any processor or filter (T = 1 for greedy), as the learner recomputes it.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerationConfig,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PROCESSOR_FIELDS = (
    "sequence_bias",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "watermarking_config",
    "renormalize_logits",
)
INERT_FIELDS = frozenset(
    {
        "max_length",
        "length_penalty",
        "early_stopping",
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "low_memory",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
        "assistant_early_exit",
        "assistant_lookbehind",
        "target_lookbehind",
        "assistant_ensemble_weight",
        "speculation_type",
        "use_mtp",
        "continuous_batching_config",
    }
)

_NOT_SAMPLED = (
    "so its tokens are not samples of the policy and have no per-token sampler logprobs, which "
    "GRPO's importance ratios need; GRPO samples num_generations completions per prompt"
)
_BEAMS = f"beam search keeps several hypotheses and returns the best-scored one, {_NOT_SAMPLED}"
# Refused fields: (the values that change nothing, which are accepted; why any other is refused).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_beams": ((None, 1), _BEAMS),
    "num_beam_groups": ((None, 1), f"group {_BEAMS}"),
    "diversity_penalty": ((None, 0.0), f"it applies to group {_BEAMS}"),
    "constraints": ((None,), f"constrained {_BEAMS}"),
    "force_words_ids": ((None,), f"constrained {_BEAMS}"),
    "num_return_sequences": (
        (None, 1),
        "each generation is one completion; GRPO's group size is num_generations: set that",
    ),
    "penalty_alpha": (
        (None, 0.0),
        f"contrastive search picks each token by re-ranking candidates, {_NOT_SAMPLED}",
    ),
    "dola_layers": (
        (None,),
        f"DoLa decodes from the contrast of the final and early layers' logits, {_NOT_SAMPLED}",
    ),
    "guidance_scale": (
        (None, 1, 1.0),
        f"classifier-free guidance mixes in an unconditional forward pass, {_NOT_SAMPLED}",
    ),
    "token_healing": (
        (None, False),
        "it rewrites the prompt's last tokens, and episodes are token-exact",
    ),
    "stop_strings": (
        (None,),
        "turns end on stop token ids (the tokenizer's eos and model.generation_config."
        "eos_token_id); add an id there",
    ),
    "max_time": (
        (None,),
        "a time limit makes a completion depend on machine load; bound turns by tokens "
        "(max_new_tokens, max_completion_length)",
    ),
    "encoder_no_repeat_ngram_size": ((None, 0), "it is for encoder-decoder models"),
}


@dataclass(frozen=True)
class GenerationSettings:
    """What a transformers backend applies of a `generation_kwargs` dict.

    Attributes:
        sampling: `SAMPLER_FIELDS` values that win over each request's own (`do_sample=False`
            is temperature 0).
        processing: `PROCESSOR_FIELDS` values, applied with transformers' logits processors.
        max_new_tokens: The most tokens one turn samples, or None.
    """

    sampling: dict[str, Any] = field(default_factory=dict)
    processing: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None

    @functools.cached_property
    def config(self) -> GenerationConfig:
        """`processing` as a `GenerationConfig` (made once; `do_sample` so none is ignored)."""
        return GenerationConfig(do_sample=True, **self.processing)

    def turn_budget(self, max_tokens: int) -> int:
        """A request's `max_tokens`, capped by `max_new_tokens`."""
        return max_tokens if self.max_new_tokens is None else min(max_tokens, self.max_new_tokens)


def generation_settings(
    generation_kwargs: Mapping[str, Any], stop_token_ids: Collection[int]
) -> GenerationSettings:
    """Sort `generation_kwargs` (TRL's `GenerationConfig` arguments) into what applies.

    A None value means unset, as in `GenerationConfig`. `eos_token_id` is accepted when its ids
    are stop ids already (turns end on `stop_token_ids`).

    Raises:
        ValueError: A refused field with a value that changes something (the message says why
            and names the field), or a name that is no `GenerationConfig` field.

    Examples:
        >>> settings = generation_settings({"do_sample": False, "typical_p": 0.9}, [2])
        >>> settings.sampling, settings.processing
        ({'temperature': 0.0}, {'typical_p': 0.9})

    """
    kwargs = {name: value for name, value in generation_kwargs.items() if value is not None}
    _refuse_what_cannot_apply(kwargs, stop_token_ids)
    sampling = {name: kwargs[name] for name in SAMPLER_FIELDS if name in kwargs}
    if kwargs.get("do_sample", True) is False:
        sampling["temperature"] = 0.0
    return GenerationSettings(
        sampling,
        {name: kwargs[name] for name in PROCESSOR_FIELDS if name in kwargs},
        kwargs.get("max_new_tokens"),
    )


def _refuse_what_cannot_apply(kwargs: Mapping[str, Any], stop_token_ids: Collection[int]) -> None:
    known = {*SAMPLER_FIELDS, *PROCESSOR_FIELDS, *INERT_FIELDS, *REFUSED, "do_sample"}
    known |= {"max_new_tokens", "eos_token_id"}
    for name in sorted(kwargs.keys() - known):
        close = difflib.get_close_matches(name, sorted(GenerationConfig().to_dict()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"generation_kwargs[{name!r}] is not a transformers generation setting (a "
            f"GenerationConfig field){hint}, so the transformers backend cannot apply it; "
            "remove it, or generate with vLLM (use_vllm=True), whose SamplingParams take "
            "fields such as presence_penalty"
        )
    for name, (accepted, reason) in REFUSED.items():
        if name in kwargs and kwargs[name] not in accepted:
            raise ValueError(
                f"generation_kwargs={{{name!r}: {kwargs[name]!r}}} cannot be used for GRPO: "
                f"{reason}. Remove it from generation_kwargs."
            )
    turn = kwargs.get("max_new_tokens")
    if turn is not None and (not isinstance(turn, int) or turn < 1):
        raise ValueError(
            f"generation_kwargs={{'max_new_tokens': {turn!r}}}: the most tokens one turn samples "
            "must be a whole number >= 1"
        )
    eos = kwargs.get("eos_token_id")
    if eos is not None and not set(_ids(eos)) <= set(stop_token_ids):
        raise ValueError(
            f"generation_kwargs={{'eos_token_id': {eos!r}}}: turns end on the stop ids "
            f"{sorted(stop_token_ids)} (the tokenizer's eos and model.generation_config."
            "eos_token_id), which the episodes' chat template relies on; set "
            "model.generation_config.eos_token_id to add one, and remove it from "
            "generation_kwargs"
        )


def _ids(value: int | Sequence[int]) -> list[int]:
    return [value] if isinstance(value, int) else list(value)


def row_processors(
    settings: GenerationSettings,
    sampling: Mapping[str, float],
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_token_ids: Collection[int],
    vocab_size: int,
    device: torch.device,
) -> LogitsProcessorList | None:
    """The logits processors of one request, in `generate`'s order; None without `processing`.

    The list turns the row's next-token logits (1, V), given its ids so far (the prompt, then
    what it sampled), into the logits it draws from: the biases, penalties and bans, then
    (unless greedy, temperature 0) temperature, top-h, top-k, top-p, min-p, typical, epsilon
    and eta filtering, as transformers' `generate` would for this prompt with
    `max_new_tokens=max_tokens`. `sampling` is the row's `SAMPLER_FIELDS` values.

    Raises:
        ValueError: A value transformers refuses (its processors check their arguments).
    """
    if not settings.processing:
        return None
    config = settings.config
    table = _processor_table(
        config, sampling["repetition_penalty"], prompt_ids, max_tokens, sorted(stop_token_ids)
    )
    processors = [make(str(device)) for applies, make in table if applies]
    if sampling["temperature"] > 0:  # `generate` filters only when it samples
        processors += _warpers(config, sampling, device)
    if config.watermarking_config is not None:
        processors.append(config.watermarking_config.construct_processor(vocab_size, device))
    if config.renormalize_logits:
        processors.append(LogitNormalization())
    return LogitsProcessorList(processors)


def _processor_table(
    c: GenerationConfig, penalty: float, prompt_ids: Sequence[int], max_tokens: int, eos: list[int]
) -> list[tuple[bool, Callable[[str], LogitsProcessor]]]:
    """(whether it applies, its processor on a device) before the filters, in `generate`'s order.

    The conditions are `generate`'s: a value of None (and 0 for sizes and lengths, 1.0 for
    penalties) leaves a processor out.
    """
    prompt = len(prompt_ids)
    # As `generate`: with a one-token prompt and a forced first token, suppression starts after it.
    begin = prompt if prompt > 1 or c.forced_bos_token_id is None else prompt + 1
    return [
        (c.sequence_bias is not None, lambda _: SequenceBiasLogitsProcessor(c.sequence_bias)),
        (
            c.encoder_repetition_penalty not in (None, 1.0),
            lambda where: EncoderRepetitionPenaltyLogitsProcessor(
                c.encoder_repetition_penalty,
                torch.tensor([list(prompt_ids)], device=where),  # type: ignore[arg-type]  # a LongTensor; the hint is legacy
            ),
        ),
        (penalty != 1.0, lambda _: RepetitionPenaltyLogitsProcessor(penalty)),
        (
            (c.no_repeat_ngram_size or 0) > 0,
            lambda _: NoRepeatNGramLogitsProcessor(c.no_repeat_ngram_size),
        ),
        (c.bad_words_ids is not None, lambda _: NoBadWordsLogitsProcessor(c.bad_words_ids, eos)),
        ((c.min_length or 0) > 0, lambda where: MinLengthLogitsProcessor(c.min_length, eos, where)),
        (
            (c.min_new_tokens or 0) > 0,
            lambda where: MinNewTokensLengthLogitsProcessor(prompt, c.min_new_tokens, eos, where),
        ),
        (
            c.forced_bos_token_id is not None,
            lambda _: ForcedBOSTokenLogitsProcessor(c.forced_bos_token_id),
        ),
        (
            c.forced_eos_token_id is not None,
            lambda where: ForcedEOSTokenLogitsProcessor(
                prompt + max_tokens, c.forced_eos_token_id, where
            ),
        ),
        (bool(c.remove_invalid_values), lambda _: InfNanRemoveLogitsProcessor()),
        (
            c.exponential_decay_length_penalty is not None,
            lambda _: ExponentialDecayLengthPenalty(
                c.exponential_decay_length_penalty, eos, prompt
            ),
        ),
        (
            c.suppress_tokens is not None,
            lambda where: SuppressTokensLogitsProcessor(c.suppress_tokens, where),
        ),
        (
            c.begin_suppress_tokens is not None,
            lambda where: SuppressTokensAtBeginLogitsProcessor(
                c.begin_suppress_tokens, begin, where
            ),
        ),
    ]


def _warpers(
    config: GenerationConfig, sampling: Mapping[str, float], device: torch.device
) -> list[LogitsProcessor]:
    """The filters `generate` applies when it samples, in its order (temperature first)."""
    temperature, top_k, top_p, min_p = (
        sampling[name] for name in ("temperature", "top_k", "top_p", "min_p")
    )
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if config.top_h is not None:
        warpers.append(TopHLogitsWarper(config.top_h))
    if top_k:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(config.typical_p))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(EpsilonLogitsWarper(config.epsilon_cutoff))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(EtaLogitsWarper(config.eta_cutoff, device=str(device)))
    return warpers
