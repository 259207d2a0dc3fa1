"""Generation forwards of an FSDP2 (`fully_shard`) model on 2 CPU processes, then a train step.

`tests/end_to_end/test_distributed.py` runs it: `python tests/scripts/fsdp2_generate.py PORT`.
Inside `models.sharded.fsdp2_unsharded`, process p runs p + 1 forward passes (as episodes of
different lengths would) and must get the unsharded model's logits; after the block, a forward
and a backward must still work, sharded again. After an optimizer step,
`reference_sync.SyncReference` mixes the sharded policy into a whole reference copy, which must
then hold the mean of the starting weights and the whole trained ones. Each process prints
`process P ok` at the end.
accelerate does not run FSDP on CPU processes, so the model is sharded with torch's own
`fully_shard`, per decoder layer and at the root, as accelerate's FSDP2 does.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, TrainerState

from agentgrpo.models.reference_sync import SyncReference
from agentgrpo.models.sharded import fsdp2_unsharded
from tests.support.tiny_model import tiny_config


def play(rank: int, port: int) -> None:
    """One process: shard, generate unevenly, check the logits, then train a step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same weights on both processes
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    model = LlamaForCausalLM(tiny_config(LlamaConfig, 256, **sizes))
    ids_1_T = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        whole_1_T_V = model(ids_1_T).logits
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        torch.distributed.fsdp.fully_shard(layer)
    torch.distributed.fsdp.fully_shard(model)
    with fsdp2_unsharded(model), torch.no_grad():
        for _ in range(rank + 1):
            logits_1_T_V = model(ids_1_T).logits
    torch.testing.assert_close(logits_1_T_V, whole_1_T_V)
    model(ids_1_T).logits.sum().backward()
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)  # sharded again
    check_reference_sync(model, reference)
    print(f"process {rank} ok", flush=True)
    dist.destroy_process_group()


def check_reference_sync(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Step the sharded model, mix it into `reference` with alpha 0.5, check the mix."""
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    started = [p.detach().clone() for p in reference.parameters()]
    with fsdp2_unsharded(model):
        trained = [p.detach().clone() for p in model.parameters()]
    assert not isinstance(trained[0], DTensor)
    SyncReference(reference, model, alpha=0.5, every=1).on_step_end(
        None, TrainerState(global_step=1), None
    )
    for mixed, before, after in zip(reference.parameters(), started, trained, strict=True):
        torch.testing.assert_close(mixed, (before + after) / 2)
    assert any(not torch.equal(b, a) for b, a in zip(started, trained, strict=True))


if __name__ == "__main__":
    mp.spawn(play, args=(int(sys.argv[1]),), nprocs=2)
