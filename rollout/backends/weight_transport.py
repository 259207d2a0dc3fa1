"""Broadcasting a model's tensors from the trainer to vLLM workers: NCCL on GPUs, gloo on CPU.

The trainer and the vLLM server's workers form a process group of their own, outside
`torch.distributed`'s global state (the trainer may already run one for DDP): a `TCPStore` that
the server's first worker hosts on `vllm_group_port`, and one gloo or NCCL backend object over
it. Ranks `0 .. W-2` are the server's workers (tensor-parallel ranks), rank `W-1` the trainer,
which broadcasts. Both sides run this module; it needs only torch.

The store listens on every interface of the server and cannot check who connects, so every key
of the group lives under a secret the trainer draws for each join and hands the workers over
the server's guarded HTTP (`WeightGroup`'s `secret`): a process that reaches the port without
it finds no rendezvous to join.

A push is two messages: the tensors' names, dtypes and shapes go over HTTP
(`tensor_specs`, JSON), then each tensor is broadcast in that order. A worker receives into
empty tensors and hands them to vLLM one at a time, so it never holds a second copy of the
model.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on `device`: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def new_secret() -> str:
    """A fresh secret for one join of the weight group (64 hexadecimal characters)."""
    return secrets.token_hex(32)


def tensor_specs(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[list]:
    """`[name, dtype, shape]` of each tensor, in order: what a receiver allocates (JSON-able).

    >>> tensor_specs([("model.norm.weight", torch.ones(3, dtype=torch.bfloat16))])
    [['model.norm.weight', 'bfloat16', [3]]]
    """
    return [
        [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        for name, tensor in named_tensors
    ]


class WeightGroup:
    """One member of the trainer-to-workers broadcast group.

    Args:
        host: Address of the store, which rank 0 (the server's first worker) hosts; rank 0
            listens on every interface.
        port: The store's port (`vllm_group_port`).
        rank: This member's rank; the trainer is `world_size - 1`.
        world_size: The server's workers plus the trainer.
        device: Where this member's tensors live; picks NCCL (cuda) or gloo (cpu).
        timeout_s: How long joining and each broadcast may take.
        secret: The join's secret (`new_secret`), the same for every member; the group's
            keys in the store are prefixed with it.

    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        secret: str,
    ):
        if len(secret) < 32:
            raise ValueError("a weight group's secret is new_secret()'s: 32 characters or more")
        timeout = timedelta(seconds=timeout_s)
        tcp_store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        store = dist.PrefixStore(f"agentgrpo-weights/{secret}", tcp_store)
        self.device = device
        self.source = world_size - 1
        self._store = store  # the backend does not keep the store alive by itself
        self._group = _backend(backend_for(device), store, rank, world_size, timeout)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor, in order (trainer side; receivers use the same order)."""
        for _, tensor in named_tensors:
            self._broadcast(tensor.detach().to(self.device).contiguous())

    def receive(self, specs: list[list]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for each spec as its broadcast arrives (worker side).

        The caller must exhaust the iterator: the trainer sends every tensor of the push.
        """
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(tensor)
            yield name, tensor

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.source
        # torch's stubs leave out broadcast on the gloo and NCCL backends, which do have it.
        self._group.broadcast([tensor], options).wait()  # type: ignore[union-attr]


def _backend(
    name: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """A bare gloo or NCCL backend over `store`, addressed by group ranks only."""
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
