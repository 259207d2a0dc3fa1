"""`sync_ref_model`: the reference model moves toward the policy, and checkpoints keep it.

Every `ref_model_sync_steps` optimizer steps, ref <- alpha * policy + (1 - alpha) * ref (TR-DPO,
`ref_model_mixup_alpha`). A synced reference is no longer a copy of the starting weights, so a
checkpoint holds it (`REFERENCE_FILE`) and a resumed run continues from it, to the weights of an
uninterrupted run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from transformers import TrainerCallback

from agentgrpo.sharded_weights import (
    whole_one_at_a_time,
    whole_parameters,
    written_one_at_a_time,
    written_whole,
)

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_model.safetensors"


class SyncReference(TrainerCallback):
    """`sync_ref_model`: every `every` steps, ref <- alpha * policy + (1 - alpha) * ref (TR-DPO).

    Mixed one tensor at a time: a ZeRO-3 or FSDP2 policy's parameter is gathered for it, and a
    ZeRO-3 reference's (sharded as the policy, `zero3_copy`) is gathered and sharded again, by
    every process at the same step (`whole_one_at_a_time`, `written_one_at_a_time`).

    Args:
        reference: The reference model (a separate copy; PEFT runs have none to sync).
        policy: The model being trained (unwrapped).
        alpha: `ref_model_mixup_alpha`.
        every: `ref_model_sync_steps`.
    """

    def __init__(
        self, reference: torch.nn.Module, policy: torch.nn.Module, alpha: float, every: int
    ):
        self.reference, self.policy, self.alpha, self.every = reference, policy, alpha, every

    @torch.no_grad()
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mix the policy into the reference on every `every`-th optimizer step."""
        if state.global_step % self.every:
            return
        references = written_one_at_a_time(list(self.reference.named_parameters()))
        policy = whole_one_at_a_time(list(self.policy.named_parameters()))
        for (_, ref), (_, current) in zip(references, policy, strict=True):
            ref.mul_(1.0 - self.alpha).add_(current.to(ref.dtype), alpha=self.alpha)

    def save(self, checkpoint: str, writes: bool) -> None:
        """Write the reference's weights into the `checkpoint` folder (`REFERENCE_FILE`).

        Every process calls it (a ZeRO-3 reference is gathered); those with `writes` write.
        """
        with whole_parameters(self.reference):
            if writes:
                save_model(self.reference, os.path.join(checkpoint, REFERENCE_FILE))

    def load(self, checkpoint: str) -> None:
        """Take back the reference `checkpoint` holds, in place; warn when it holds none.

        Every process calls it and reads the file. A checkpoint written without
        `sync_ref_model` (or by an earlier version) has no reference: the run goes on from the
        starting weights' copy, and says so.
        """
        path = os.path.join(checkpoint, REFERENCE_FILE)
        if not os.path.exists(path):
            logger.warning(
                "%s holds no reference model (%s): sync_ref_model starts again from a copy of "
                "the starting weights, so this run's reference differs from the earlier run's",
                checkpoint,
                REFERENCE_FILE,
            )
            return
        with written_whole(self.reference):
            device = next(self.reference.parameters()).device
            load_model(self.reference, path, device=str(device))


def reference_sync(
    reference: torch.nn.Module | None, policy: Any, args: Any, unwrap: Callable[[Any], Any]
) -> SyncReference:
    """The `sync_ref_model` callback of a run; `unwrap` takes off DeepSpeed's or DDP's wrapper.

    Raises:
        NotImplementedError: There is no separate reference model (PEFT: the base model is
            the reference), as TRL raises.
    """
    if reference is None:
        raise NotImplementedError(
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not "
            "supported: sync_ref_model mixes the policy into a separate reference model, but "
            "with PEFT the reference is the base model under the adapter. Use "
            "`sync_ref_model=False`."
        )
    alpha, every = args.ref_model_mixup_alpha, args.ref_model_sync_steps
    return SyncReference(unwrap(reference), unwrap(policy), alpha, every)
