"""Logprobs and entropies of completion tokens without every token's full-vocabulary logits at once.

A forward over B rows of C completion tokens would hold B x C x V logits (V: the vocabulary,
152k for Qwen2.5), and their float32 copies and softmax for backward: on a GPU that is most of
the learner's peak memory. Instead the model returns its final hidden states (B x C x H, through
`output_hidden_states`, computing the logits of one position per row), and `head_logprobs` runs
the model's output embedding over them a chunk of tokens at a time, each chunk under
(non-reentrant) activation checkpointing: only one chunk's logits ever exist, in the forward and
again in the backward, which recomputes them.

This is exact only where the logits are the output embedding of the last hidden state.
`output_head` returns None for the models whose forward does more (a soft cap, a scale, masked or
trimmed vocabulary entries); the learner then reads their logits as the model returns them.
A model whose weights FSDP2 or DeepSpeed ZeRO-3 shard gathers its output layer only for the
output layer's own call inside its forward: `InForwardScores` runs the chunks there, and the
scores leave the model in place of its logits. (Such a model's head called outside the forward
would run on a shard under ZeRO-3; under FSDP2 the final hidden states fed to it would leave the
module by a path its hooks never see, and the backward would write gradients into freed storage:
measured as a segmentation fault on gloo, under accelerate's FSDP2 wrapping. Under ZeRO-3 every
call of a module gathers its shards from all processes, so every process must make the same
calls: a chunked head, or prompts run apart where rows share them, would make as many calls as a
process has tokens or distinct prompts; processes with different counts failed on gloo with
"Received data size doesn't match expected size".)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# At most this many logits (tokens x vocabulary) in one chunk: 128 MiB in float32, e.g. 220
# tokens of Qwen2.5's 152k vocabulary or 682 of SmolLM2's 49k. A batch that fits in one chunk
# is computed without checkpointing, hence without recomputation.
LOGITS_PER_CHUNK = 2**25

# Text-config attributes of transformers models whose logits are not `lm_head(hidden)`: set to
# anything but None they transform the logits (Gemma 2-4 and nanochat soft-cap them; Cohere,
# Granite, Falcon-H1, HyperCLOVA X and Muse Glimmer scale them; RecurrentGemma soft-caps them;
# Inkling trims the padded vocabulary).
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_soft_cap",
    "unpadded_vocab_size",
)
# Model types whose forward rewrites some logits with no config attribute saying so (Chameleon
# masks its image tokens).
_LOGIT_REWRITING_TYPES = ("chameleon",)


class Readout(Protocol):
    """What a forward pass hands the learner, at the positions `keep` names in each row.

    Called as `readout(model, keep, **model_inputs)`; `keep` is a count K (the last K positions)
    or a 1-D long tensor of K column indices (transformers' `logits_to_keep` takes both). Returns
    the states (B x K x D: final hidden states, D = H, or logits, D = V) and the model's output
    (for `aux_loss`).
    """

    def __call__(
        self, model: torch.nn.Module, keep: int | torch.Tensor, **inputs: Any
    ) -> tuple[torch.Tensor, Any]:
        """Run `model` on `inputs`; its states at the `keep` positions, and its output."""
        ...


def read_logits(
    model: torch.nn.Module, keep: int | torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor, Any]:
    """The logits of the `keep` positions, as the model computes them: B x K x V."""
    out = model(**inputs, use_cache=False, logits_to_keep=keep)
    return out.logits, out


def read_hidden(
    model: torch.nn.Module, keep: int | torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor, Any]:
    """The final (normed) hidden states of the `keep` positions: B x K x H.

    The model computes the logits of each row's last position only (B x 1 x V).
    """
    out = model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden_B_L_H = out.hidden_states[-1]
    return hidden_B_L_H[:, -keep:] if isinstance(keep, int) else hidden_B_L_H[:, keep], out


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose output on the final hidden states is the model's logits, or None.

    None when the model has no output embedding, or its forward transforms the logits after it
    (`_LOGIT_TRANSFORMS`, `_LOGIT_REWRITING_TYPES`).
    `model` may be wrapped (DDP, DeepSpeed, PEFT); the module returned is the one the forward
    calls, adapters and hooks included. Its weight may be a shard (FSDP2, ZeRO-3).
    """
    inner: Any = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if config is None or head is None:
        return None
    text_config = config.get_text_config(decoder=True)
    if config.model_type in _LOGIT_REWRITING_TYPES or any(
        getattr(text_config, name, None) is not None for name in _LOGIT_TRANSFORMS
    ):
        return None
    return head


class InForwardScores:
    """A `Readout` scoring the completion tokens inside the forward of a sharded model.

    For a model whose weights are shards (FSDP2, ZeRO-3), its states are the completion
    tokens' logprobs (and entropies). For one call of the model, the output layer's forward is
    `head_logprobs` of the targets over the final hidden states it is handed, a chunk of tokens
    at a time. So the chunks run where the engine's hooks gather the output layer's weight
    (once, as for the model's own call; the layer's forward is called without them), and the
    scores leave the model as its logits, through the hooks that free the weight and reduce its
    gradient. Each score goes out as three numbers that sum to it (`_bfloat16_parts`): FSDP2
    casts a module's outputs to its `output_dtype` (bfloat16 under accelerate's bf16), which
    keeps the first two exact and rounds the third by at most 2^-27 of the score (float32's
    own rounding is 2^-24). Gradients come back through the cast in bfloat16, as they do
    through every other module of such a model.

    Args:
        head: The model's output embedding (`output_head`).
        targets_B_C: Token ids (long).
        real_B_C: Bool, True on the real (not padding) tokens.
        temperature: Divides the logits; > 0.
        entropy: As for `head_logprobs`.
    """

    def __init__(
        self,
        head: torch.nn.Module,
        targets_B_C: torch.Tensor,
        real_B_C: torch.Tensor,
        temperature: float,
        entropy: str | None,
    ) -> None:
        self.head, self.targets_B_C, self.real_B_C = head, targets_B_C, real_B_C
        self.temperature, self.entropy = temperature, entropy

    def __call__(
        self, model: torch.nn.Module, keep: int | torch.Tensor, **inputs: Any
    ) -> tuple[torch.Tensor, Any]:
        """Run `model` on `inputs`: its scores at the last `keep` = C + 1 positions, its output.

        The scores are B x keep x 3S (S = 1, or 2 with the entropy); the last position, which
        predicts no completion token, scores 0.
        """
        own_forward = self.head.__dict__.get("forward")  # accelerate's hooks wrap it there
        self.head.forward = partial(self._scores, self.head.forward)
        try:
            out = model(**inputs, use_cache=False, logits_to_keep=keep)
        finally:
            if own_forward is None:
                del self.head.forward
            else:
                self.head.forward = own_forward
        return out.logits, out

    def _scores(
        self, project: Callable[[torch.Tensor], torch.Tensor], hidden_B_K_H: torch.Tensor
    ) -> torch.Tensor:
        """The output layer's forward for one call: B x K x 3S scores from B x K x H states."""
        size = chunk_tokens(_vocabulary_size(self.head, project, hidden_B_K_H))
        numbers = _chunked(
            project,
            size,
            hidden_B_K_H[:, :-1],
            self.targets_B_C,
            self.real_B_C,
            self.temperature,
            self.entropy,
        )
        scores_B_C_S = torch.stack([n for n in numbers if n is not None], dim=-1)
        return F.pad(torch.cat(_bfloat16_parts(scores_B_C_S), dim=-1), (0, 0, 0, 1))

    def numbers(self, states_B_C_3S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logprobs_B_C, entropy_B_C (None when not asked for): float32, from the states read.

        `states_B_C_3S`: what `one_pass_states` read through this readout.
        """
        scores_B_C_S = torch.stack(states_B_C_3S.float().chunk(_PARTS, dim=-1)).sum(dim=0)
        return scores_B_C_S[..., 0], scores_B_C_S[..., 1] if self.entropy else None


_PARTS = 3


def _bfloat16_parts(values: torch.Tensor) -> list[torch.Tensor]:
    """`_PARTS` float32 tensors that sum to `values` exactly, all but the last bfloat16 numbers.

    Each part is what bfloat16 keeps of what the parts before it leave, so each is at most 2^-9
    of the one before: cast to bfloat16, the sum moves by at most 2^-9 of the last part. The
    gradient reaches `values` through the first part alone (the others are differences of it).
    """
    parts, rest = [], values
    for _ in range(_PARTS - 1):
        part = rest.to(torch.bfloat16).to(values.dtype)
        parts.append(part)
        rest = rest - part
    return [*parts, rest]


def head_logprobs(
    head: torch.nn.Module,
    hidden_B_C_H: torch.Tensor,
    targets_B_C: torch.Tensor,
    real_B_C: torch.Tensor,
    temperature: float,
    entropy: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target token, and optionally the entropy, from final hidden states.

    Both are those of the temperature-scaled distribution `softmax(head(hidden) / temperature)`
    in float32, computed only where `real_B_C` (0 at padding), `chunk_tokens(V)` tokens at a
    time. With more than one chunk and gradients on, each chunk is checkpointed, so only one
    chunk's logits live at any time, in the backward too.

    Args:
        head: The model's output embedding (`output_head`), V outputs.
        hidden_B_C_H: Final hidden states at the positions predicting `targets_B_C`.
        targets_B_C: Token ids (long).
        real_B_C: Bool, True on the real (not padding) tokens.
        temperature: Divides the logits; > 0.
        entropy: None: no entropy; "detached": without gradient; "differentiable": with it
            (an entropy bonus in the loss needs it).

    Returns:
        logprobs_B_C, entropy_B_C (None when not asked for): float32.
    """
    hidden_B_C_H = _as_head_input(head, hidden_B_C_H)
    size = chunk_tokens(_vocabulary_size(head, head, hidden_B_C_H))
    return _chunked(head, size, hidden_B_C_H, targets_B_C, real_B_C, temperature, entropy)


def _chunked(
    project: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    hidden_B_C_H: torch.Tensor,
    targets_B_C: torch.Tensor,
    real_B_C: torch.Tensor,
    temperature: float,
    entropy: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` with the output layer `project`, `size` tokens a chunk."""
    if entropy not in _ENTROPY_MODES:
        raise ValueError(f"entropy={entropy!r} is not one of {_ENTROPY_MODES}")
    hidden_N_H, targets_N = hidden_B_C_H[real_B_C], targets_B_C[real_B_C]
    several = hidden_N_H.shape[0] > size and torch.is_grad_enabled()
    score = _checkpointed_chunk if several else chunk_logprobs
    parts = [
        score(project, hidden_n_H, targets_n, temperature, entropy)
        for hidden_n_H, targets_n in zip(hidden_N_H.split(size), targets_N.split(size), strict=True)
    ]
    logprobs_B_C = _scatter(torch.cat([logprobs_n for logprobs_n, _ in parts]), real_B_C)
    entropies = [entropy_n for _, entropy_n in parts if entropy_n is not None]
    return logprobs_B_C, _scatter(torch.cat(entropies), real_B_C) if entropy else None


_ENTROPY_MODES = (None, "detached", "differentiable")


def chunk_tokens(vocabulary_size: int) -> int:
    """How many tokens' logits one chunk computes: `LOGITS_PER_CHUNK // V`, at least 1."""
    return max(1, LOGITS_PER_CHUNK // vocabulary_size)


def chunk_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    entropy: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` of N tokens at once, all real: logprobs_N and entropy_N (or None)."""
    logits_N_V = head(hidden_N_H).float()
    if temperature != 1.0:
        logits_N_V = logits_N_V / temperature
    logz_N = torch.logsumexp(logits_N_V, dim=-1)
    logprobs_N = logits_N_V.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1) - logz_N
    if entropy is None:
        return logprobs_N, None
    with torch.set_grad_enabled(entropy == "differentiable" and torch.is_grad_enabled()):
        logp_N_V = logits_N_V - logz_N.unsqueeze(-1)
        entropy_N = -(logp_N_V.exp() * logp_N_V).sum(dim=-1)
    return logprobs_N, entropy_N


def _checkpointed_chunk(*args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_logprobs` whose logits the backward recomputes instead of keeping them."""
    return checkpoint(chunk_logprobs, *args, use_reentrant=False)


def _as_head_input(head: torch.nn.Module, hidden_N_H: torch.Tensor) -> torch.Tensor:
    """`hidden_N_H` in the dtype of the head's weight, which the head needs outside a forward.

    accelerate's mixed precision runs the forward under autocast and returns its outputs in
    float32, the final hidden states too: a bfloat16 head (bf16 weights with `bf16=True`) would
    then meet float32 inputs. The states were bfloat16 inside the forward, so the cast is exact.
    """
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return hidden_N_H.to(weight.dtype)
    return hidden_N_H


def _vocabulary_size(
    head: torch.nn.Module,
    project: Callable[[torch.Tensor], torch.Tensor],
    hidden_B_C_H: torch.Tensor,
) -> int:
    """V: the head's output features (a `Linear`, LoRA-wrapped or not), else counted.

    Counted in `project`'s output on one token's state.
    """
    size = getattr(head, "out_features", None)
    if isinstance(size, int):
        return size
    with torch.no_grad():
        return int(project(hidden_B_C_H[:1, :1]).shape[-1])


def _scatter(values_N: torch.Tensor, real_B_C: torch.Tensor) -> torch.Tensor:
    """B x C: `values_N` at the real positions (in row-major order), 0 elsewhere."""
    return values_N.new_zeros(real_B_C.shape).masked_scatter(real_B_C, values_N)
