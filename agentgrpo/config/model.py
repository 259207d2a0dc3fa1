"""`GRPOConfig` fields that say how the policy is loaded and run."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelFields:
    """Loading the policy: `from_pretrained` arguments, remote code, dropout, precision."""

    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the model "
            "is given by name; its `revision` also applies to the tokenizer. A JSON string is "
            "accepted."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers (reward models included) to run custom code "
            "from their repository."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the mixture-of-experts load-balancing loss. None: the model "
            "config's value; 0.0 disables it. An error for a model without experts."
        },
    )
    disable_dropout: bool = field(
        default=False,
        metadata={"help": "Turn off dropout so that repeated forward passes give equal logprobs."},
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the language-model head of the policy and reference in float32. "
            "Needs an lm_head not tied to the input embeddings."
        },
    )
