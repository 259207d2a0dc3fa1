"""A sharded policy's tensors, whole one at a time: what a vLLM server push sends.

The two-process ZeRO-3 and FSDP2 pushes run in
`tests/end_to_end/vllm/test_vllm_server.py::test_a_sharded_run_over_two_processes_pushes_...`.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from agentgrpo.sharded_weights import named_tensors, whole_one_at_a_time, whole_specs
from rollout.backends.weight_transport import tensor_specs
from tests.support.tiny_model import tiny_llama


def by_name(specs: list[list]) -> dict[str, list]:
    return {name: rest for name, *rest in specs}


def test_a_plain_model_is_streamed_as_its_state_dict(tokenizer):
    model = tiny_llama(tokenizer)
    state = model.state_dict()
    named = named_tensors(model)
    assert by_name(whole_specs(named)) == by_name(tensor_specs(state.items()))
    streamed = dict(whole_one_at_a_time(named))
    assert streamed.keys() == state.keys()
    assert all(streamed[name].data_ptr() == state[name].data_ptr() for name in state)


def test_an_fsdp2_model_is_streamed_whole_while_its_parameters_stay_shards(
    one_process_group, tokenizer
):
    model = tiny_llama(tokenizer)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    named = named_tensors(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert by_name(whole_specs(named)) == by_name(tensor_specs(state.items()))
    for name, tensor in whole_one_at_a_time(named):
        assert not isinstance(tensor, DTensor) and torch.equal(tensor, state[name]), name
        assert all(isinstance(p, DTensor) for p in model.parameters())  # nothing unsharded
