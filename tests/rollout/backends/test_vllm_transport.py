"""The weight broadcast on its own (no vLLM): gloo between CPU processes, NCCL between GPUs."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch

from rollout.backends.weight_transport import WeightGroup, backend_for, new_secret, tensor_specs
from tests.support.vllm_support import free_port

WEIGHTS = {
    "model.embed_tokens.weight": torch.arange(12.0).reshape(4, 3),
    "model.norm.weight": torch.ones(3, dtype=torch.bfloat16),
    "lm_head.bias": torch.tensor([7], dtype=torch.int64),
}


# Limits that only say "does not hang": the spawned worker first imports torch, which takes
# tens of seconds on a loaded 2-core machine, while the sender already waits to join.
JOIN_TIMEOUT_S = 180


def receive(port: int, device: str, specs: list, secret: str, results) -> None:
    """Rank 0, as a server worker: host the store, receive every tensor."""
    group = WeightGroup("127.0.0.1", port, 0, 2, torch.device(device), JOIN_TIMEOUT_S, secret)
    # Plain values: tensors would cross as shared memory that dies with this process.
    received = [(n, str(t.dtype), t.cpu().float().tolist()) for n, t in group.receive(specs)]
    results.put(received)


def broadcast_round_trip(device: str, intruder_fails=None) -> dict[str, torch.Tensor]:
    """Broadcast `WEIGHTS` to a spawned rank 0; `intruder_fails()` runs once it hosts the store."""
    port, specs, secret = free_port(), tensor_specs(WEIGHTS.items()), new_secret()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=receive, args=(port, device, specs, secret, results))
    worker.start()
    sender_device = torch.device("cuda:1" if device == "cuda:0" else device)
    if intruder_fails is not None:
        intruder_fails(port)
    sender = WeightGroup("127.0.0.1", port, 1, 2, sender_device, JOIN_TIMEOUT_S, secret)
    sender.send(WEIGHTS.items())
    received = results.get(timeout=JOIN_TIMEOUT_S)
    worker.join(timeout=JOIN_TIMEOUT_S)
    return {
        name: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))
        for name, dtype, values in received
    }


def test_specs_carry_name_dtype_and_shape_as_json_values():
    assert tensor_specs(WEIGHTS.items()) == [
        ["model.embed_tokens.weight", "float32", [4, 3]],
        ["model.norm.weight", "bfloat16", [3]],
        ["lm_head.bias", "int64", [1]],
    ]


def test_a_weight_group_refuses_a_secret_that_is_not_new_secrets():
    with pytest.raises(ValueError, match="new_secret"):
        WeightGroup("127.0.0.1", free_port(), 0, 1, torch.device("cpu"), 1.0, "guessable")


def test_the_backend_is_nccl_on_gpus_and_gloo_on_cpu():
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def joins_without_the_secret(port: int) -> None:
    """Rank 1 with a secret of its own: it reaches the store but finds no group to join."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:  # rank 0's store is up: what stops the intruder is the secret alone
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0 never hosted its store"
            time.sleep(0.2)
    with pytest.raises(Exception, match=r"[Tt]imeout|timed out"):  # torch's own wording varies
        WeightGroup("127.0.0.1", port, 1, 2, torch.device("cpu"), 3.0, new_secret())


@pytest.mark.process
def test_a_gloo_broadcast_delivers_every_tensor_exactly_to_the_holders_of_the_secret():
    received = broadcast_round_trip("cpu", intruder_fails=joins_without_the_secret)
    assert list(received) == list(WEIGHTS)
    for name, tensor in WEIGHTS.items():
        assert torch.equal(received[name], tensor) and received[name].dtype == tensor.dtype


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA GPUs")
def test_an_nccl_broadcast_between_two_gpus_delivers_every_tensor_exactly():
    received = broadcast_round_trip("cuda:0")
    for name, tensor in WEIGHTS.items():
        assert torch.equal(received[name], tensor)
