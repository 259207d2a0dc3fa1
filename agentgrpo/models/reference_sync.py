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
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from agentgrpo.models.sharded import (
    named_tensors,
    paired_one_at_a_time,
    tied_names,
    whole_one_at_a_time,
    written_one_at_a_time,
)

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_model.safetensors"


class SyncReference(TrainerCallback):
    """`sync_ref_model`: every `every` steps, ref <- alpha * policy + (1 - alpha) * ref (TR-DPO).

    Mixed one tensor at a time (`paired_one_at_a_time`), by every process at the same step:
    under ZeRO-3 the policy's parameter is gathered, and the reference's (`zero3_copy`) gathered
    and sharded again; under FSDP2 each process mixes its own shards (`fsdp2_copy` shards the
    reference as the policy).

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
    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Mix the policy into the reference on every `every`-th optimizer step."""
        if state.global_step % self.every:
            return
        references = list(self.reference.named_parameters())
        policy = list(self.policy.named_parameters())
        for ref, current in paired_one_at_a_time(references, policy):
            ref.mul_(1.0 - self.alpha).add_(current.to(ref.dtype), alpha=self.alpha)

    def save(self, checkpoint: str, writes: bool) -> None:
        """Write the reference's weights into the `checkpoint` folder (`REFERENCE_FILE`).

        Every process calls it (a sharded reference is gathered one tensor at a time); those
        with `writes` write. A tied weight is written once, under its first name.
        """
        weights = {}
        for name, whole in whole_one_at_a_time(named_tensors(self.reference, tied_once=True)):
            if writes:
                weights[name] = whole.detach().to("cpu", copy=True)
        if writes:
            save_file(weights, os.path.join(checkpoint, REFERENCE_FILE))

    def load(self, checkpoint: str) -> None:
        """Take back the reference `checkpoint` holds, in place; warn when it holds none.

        Every process calls it and reads the file, one tensor at a time. A checkpoint written
        without `sync_ref_model` (or by an earlier version) has no reference: the run goes on
        from the starting weights' copy, and says so.

        Raises:
            ValueError: The file lacks one of the reference's tensors (under any of its tied
                names): it was written for another model.
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
        names = tied_names(self.reference)
        targets = written_one_at_a_time(named_tensors(self.reference, tied_once=True))
        with safe_open(path, framework="pt") as stored, torch.no_grad():
            held = set(stored.keys())
            for name, target in targets:
                stored_name = next((n for n in names.get(name, [name]) if n in held), None)
                if stored_name is None:
                    raise ValueError(
                        f"{path} has no tensor {name!r} of the reference model: it was saved for "
                        "another model; resume from a checkpoint of this run"
                    )
                target.copy_(stored.get_tensor(stored_name))


def reference_sync(
    reference: torch.nn.Module | None, policy: Any, args: GRPOConfig, unwrap: Callable[[Any], Any]
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
