"""`GRPOConfig`, split by concern: each field lives in the module named for what it sets.

| module | fields |
|---|---|
| `grpo` | `GRPOConfig` itself, and the `TrainingArguments` defaults GRPO changes |
| `model` | loading the policy (`model_init_kwargs`, `trust_remote_code`, ...) |
| `batching` | group size, completion budget, generation batch, padding |
| `generation` | sampling (`temperature`, `top_p`, ...), TRL's engines agentgrpo lacks |
| `vllm` | the vLLM backend, colocated or a server |
| `loss` | the loss, advantages, KL, entropy, off-policy corrections |
| `logs` | completions tables and where they go |
| `episodes` | turns, timeouts, concurrency, chat template, tool-call parser, episode record |
| `warm_start` | supervised steps on demonstrations before GRPO |
| `checks` | the checks that span groups (each group's own live beside its fields) |
"""

from agentgrpo.config.batching import MAX_BATCH
from agentgrpo.config.grpo import GRPOConfig, default_bf16
from agentgrpo.config.loss import LOSS_TYPES

__all__ = ["LOSS_TYPES", "MAX_BATCH", "GRPOConfig", "default_bf16"]
