"""Packed sequences (`padding_free`): a micro-batch's rows run as one row, without padding.

A `TrainingBatch` pads every row to the longest prompt and the longest completion; multi-turn
episodes vary a lot in length, so much of a padded forward can be padding. Packed, the model
runs the real tokens only: the rows one after another in a single row of N tokens, each token
with its own position id (counted from 0 in its row, as at generation), attending only to
earlier tokens of its own row.

- One pass (`packed_states` without shared prompts): whole rows, concatenated. Given no
  attention mask, transformers reads position ids that restart at 0 as sequence boundaries: it
  builds the per-row (block-diagonal causal) mask itself for sdpa, eager and flex attention
  (`masking_utils.find_packed_sequence_indices`), and the flash-attention kernels take the same
  boundaries as their variable-length sequences.
- Shared prompts (a GRPO group's rows start from one prompt; see `shared_prompt`): the U
  distinct prompts run once, padded as in `shared_prompt_states`; then every row's completion,
  concatenated, runs over all U prompts' keys and values (`PackedPrefixCache`), each token
  attending to its own row's prompt and the earlier tokens of its own completion. That mask is
  made by transformers' `create_causal_mask` with a mask function of ours, so it has the format
  the model's attention implementation reads. An implementation that reads no mask (flash
  attention) cannot take it: those models pack in one pass instead.

Either way the states come back in the padded layout (B x C x D, 0 at padding), so everything
after the forward is unchanged, and the numbers equal the padded forward's up to float
rounding. What it saves is the padding's compute and activations; the attention of a packed row
is one N x N (or N x (U·P + N)) product, mostly masked, where the padded one is B of C x (P + C):
with kernels that compute masked blocks anyway (sdpa on CPU) that part grows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.output_head import Readout
from agentgrpo.learner.prefix_cache import PackedPrefixCache, RecordingCache
from agentgrpo.learner.shared_prompt import caches_through_checkpoints

# Layers that see other tokens only through attention, hence only through the mask: a recurrent
# or linear-attention layer would carry its state from one packed row into the next.
_PACKABLE_LAYERS = {"full_attention", "sliding_attention"}


def check_packable(model: torch.nn.Module, batch: TrainingBatch, sharded: bool) -> None:
    """Raise where packing `batch` could not give `model` the padded forward's numbers.

    Raises:
        ValueError: naming `padding_free` and what works instead, when the weights are
            `sharded` (FSDP2, ZeRO-3 score inside a padded forward), the rows have images, the
            model has layers other than attention, its attention implementation is one
            transformers does not mask per packed sequence, or a row has completion tokens but
            no prompt token (nothing of its own predicts its first token).
    """
    fix = "set padding_free=False"
    if sharded:
        raise ValueError(
            "padding_free=True cannot pack rows for a model whose weights FSDP2 or DeepSpeed "
            f"ZeRO-3 shard (it scores completions inside one padded forward); {fix}."
        )
    if batch.vision_B is not None:
        raise ValueError(
            "padding_free=True cannot pack rows with images (each row's image tensors go with "
            f"its own row of ids); {fix} for a vision-language model."
        )
    inner: Any = getattr(model, "module", model)
    config = inner.config.get_text_config(decoder=True)
    others = set(getattr(config, "layer_types", None) or ["full_attention"]) - _PACKABLE_LAYERS
    if others:
        raise ValueError(
            f"padding_free=True packs rows for attention layers only; this model also has "
            f"{sorted(others)} layers, whose state would run from one row into the next; {fix}."
        )
    implementation = config._attn_implementation
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS.valid_keys():
        raise ValueError(
            f"padding_free=True needs an attention implementation that transformers masks per "
            f"packed row ({', '.join(sorted(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()))}); this "
            f"model uses {implementation!r}: load it with one of those, or {fix}."
        )
    width_P = batch.input_ids_B_L.shape[1] - batch.completion_width
    real_B_L = batch.attention_mask_B_L.bool()
    if bool((real_B_L[:, width_P:].any(1) & ~real_B_L[:, :width_P].any(1)).any()):
        raise ValueError(
            "padding_free=True needs a prompt token before every completion (it predicts the "
            f"first completion token); a row of this batch has none: {fix}."
        )


def packed_states(
    model: torch.nn.Module,
    batch: TrainingBatch,
    prompts: tuple[list[int], torch.Tensor] | None,
    readout: Readout,
    with_aux_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`readout`'s states predicting each completion token (B x C x D, 0 at padding), packed.

    The caller has run `check_packable`. With `prompts` (`shared_prompt.prompt_groups`, where
    `logprobs` found sharing valid and worthwhile) each distinct prompt runs once, unless the
    model's attention reads no mask; otherwise whole rows run in one pass.

    Returns the states and, with `with_aux_loss`, the model's load-balancing loss (else None).
    """
    if prompts is not None:
        states_B_C_D = _packed_shared_prompt_states(model, batch, prompts, readout)
        if states_B_C_D is not None:
            return states_B_C_D, None
    return _packed_one_pass_states(model, batch, readout, with_aux_loss)


def _packed_one_pass_states(
    model: torch.nn.Module, batch: TrainingBatch, readout: Readout, with_aux_loss: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole rows concatenated, masked per row by transformers from the restarting positions."""
    real_B_L = batch.attention_mask_B_L.bool()
    width_P = real_B_L.shape[1] - batch.completion_width
    flat_B_L = real_B_L.flatten().cumsum(0).view_as(real_B_L) - 1  # column in the packed row
    real_B_C = real_B_L[:, width_P:]
    keep_M = flat_B_L[:, width_P:][real_B_C] - 1  # the token before each completion token
    router: dict[str, Any] = {"output_router_logits": True} if with_aux_loss else {}
    states_1_M_D, out = readout(
        model,
        keep_M,
        input_ids=batch.input_ids_B_L[real_B_L].unsqueeze(0),
        position_ids=batch.position_ids_B_L[real_B_L].unsqueeze(0),
        **router,
    )
    return _unpacked(states_1_M_D[0], real_B_C), out.aux_loss if with_aux_loss else None


def _packed_shared_prompt_states(
    model: torch.nn.Module,
    batch: TrainingBatch,
    prompts: tuple[list[int], torch.Tensor],
    readout: Readout,
) -> torch.Tensor | None:
    """The shared prompts run once, then every completion packed over them; None: no mask.

    None when the model's attention implementation reads no mask (flash attention), before
    anything runs. Needs at least 2 completion columns (`logprobs._shared_prompts` checks).
    """
    rows_U, prompt_B = prompts
    width_C = batch.completion_width
    width_P = batch.input_ids_B_L.shape[1] - width_C
    real_B_C = batch.attention_mask_B_L[:, width_P:].bool()
    prompt_real_U_P = batch.attention_mask_B_L[rows_U, :width_P].bool()
    inner = getattr(model, "module", model)
    recorded = RecordingCache()
    with caches_through_checkpoints(inner):
        prompt_U_1_D, _ = readout(
            model,
            1,
            input_ids=batch.input_ids_B_L[rows_U, :width_P],
            attention_mask=batch.attention_mask_B_L[rows_U, :width_P],
            position_ids=batch.position_ids_B_L[rows_U, :width_P],
            past_key_values=recorded,
        )
        cache = PackedPrefixCache(recorded)
        mask = _completion_mask(inner, cache, prompt_real_U_P, prompt_B, real_B_C)
        if mask is None:
            return None
        flat_B_C = real_B_C.flatten().cumsum(0).view_as(real_B_C) - 1
        keep_M = flat_B_C[:, :-1][real_B_C[:, 1:]]  # each completion token but the first's
        states_1_M_D, _ = readout(  # predecessor: the last token of each row predicts nothing
            model,
            keep_M,
            input_ids=batch.input_ids_B_L[:, width_P:][real_B_C].unsqueeze(0),
            attention_mask=mask,
            position_ids=batch.position_ids_B_L[:, width_P:][real_B_C].unsqueeze(0),
            past_key_values=cache,
        )
    rest_B_C1_D = _unpacked(states_1_M_D[0], real_B_C[:, 1:])
    return torch.cat([prompt_U_1_D[prompt_B], rest_B_C1_D], dim=1)


def _completion_mask(
    model: Any,
    cache: PackedPrefixCache,
    prompt_real_U_P: torch.Tensor,
    prompt_B: torch.Tensor,
    real_B_C: torch.Tensor,
) -> Any:
    """The packed completions' attention mask over [U prompts | N completion tokens].

    A key is readable by a query when both belong to one row (the key earlier: the causal part
    is transformers'), or the key is a real token of the query's row's prompt. Returns what
    `create_causal_mask` makes for the model's attention implementation (a 1 x 1 x N x (U·P + N)
    tensor, or a flex block mask), or None where it makes none (flash attention).
    """
    count_U, width_P = prompt_real_U_P.shape
    device = real_B_C.device
    row_N = real_B_C.nonzero()[:, 0]  # the batch row of each packed completion token
    unused_U_P = torch.full_like(prompt_real_U_P, -1, dtype=torch.long)
    prompt_U_P = torch.arange(count_U, device=device)[:, None].expand(count_U, width_P)
    key_owner = torch.cat([torch.where(prompt_real_U_P, prompt_U_P, unused_U_P).flatten(),
                           count_U + row_N])  # fmt: skip
    # Queries are numbered from U·P on (after the cache); the first U·P entries are never read.
    before = torch.full((count_U * width_P,), -2, dtype=torch.long, device=device)
    query_row = torch.cat([before, count_U + row_N])
    query_prompt = torch.cat([before, prompt_B.to(device)[row_N]])

    def same_row_or_own_prompt(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        owner = key_owner[kv_idx]
        return (owner == query_row[q_idx]) | (owner == query_prompt[q_idx])

    embeddings = model.get_input_embeddings().weight
    shape_only = embeddings.new_empty((1, len(row_N), 0))  # the mask reads its size and dtype
    return create_causal_mask(
        config=model.config.get_text_config(decoder=True),
        inputs_embeds=shape_only,
        attention_mask=None,
        past_key_values=cache,
        and_mask_function=same_row_or_own_prompt,
    )


def _unpacked(states_M_D: torch.Tensor, real_B_C: torch.Tensor) -> torch.Tensor:
    """The packed states put at the `real_B_C` positions of the padded layout: B x C x D, else 0."""
    width_D = states_M_D.shape[-1]
    where_B_C_D = real_B_C.unsqueeze(-1).expand(*real_B_C.shape, width_D)
    return states_M_D.new_zeros(where_B_C_D.shape).masked_scatter(where_B_C_D, states_M_D)
