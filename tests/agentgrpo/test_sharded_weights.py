"""A sharded policy's tensors, whole one at a time (what a vLLM server push sends), and the
ZeRO-3 reference model, in one process.

The two-process ZeRO-3 and FSDP2 pushes run in
`tests/end_to_end/vllm/test_vllm_server.py::test_a_sharded_run_over_two_processes_pushes_...`;
the two-process ZeRO-3 reference in `tests/end_to_end/test_distributed.py`.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from agentgrpo.reference_sync import SyncReference
from agentgrpo.sharded_weights import (
    _frozen_zero3_config,
    named_tensors,
    whole_one_at_a_time,
    whole_parameters,
    whole_specs,
    written_one_at_a_time,
    zero3_copy,
)
from rollout.backends.weight_transport import tensor_specs
from tests.support.tiny_model import tiny_llama

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (make install)"
)
# A run's DeepSpeed config as a user's JSON may give it: the bucket sizes left to the Trainer
# ("auto", settled only when it prepares the policy) and an optimizer.
ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


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


@pytest.fixture
def deepspeed_process(one_process_group, monkeypatch):
    """The one-process group, with the local rank DeepSpeed reads as a launcher sets it."""
    monkeypatch.setenv("LOCAL_RANK", "0")


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with whole_parameters(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


@needs_deepspeed
def test_a_zero3_copy_is_sharded_and_computes_what_its_source_does(deepspeed_process, tokenizer):
    source = tiny_llama(tokenizer)
    engine = zero3_copy(source, ZERO3_CONFIG)
    copy_ = engine.module
    assert all(hasattr(p, "ds_id") for p in copy_.parameters())
    assert not any(p.requires_grad for p in copy_.parameters()) and not copy_.training
    for name, weight in whole_weights(copy_).items():
        assert torch.equal(weight, source.get_parameter(name)), name
    ids_B_T = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(
            engine(input_ids=ids_B_T).logits, source(input_ids=ids_B_T).logits
        )


@needs_deepspeed
def test_a_zero3_reference_keeps_each_sync_and_comes_back_from_a_checkpoint(
    deepspeed_process, tokenizer, tmp_path
):
    reference = zero3_copy(tiny_llama(tokenizer), ZERO3_CONFIG).module
    start = whole_weights(reference)
    policy = tiny_llama(tokenizer, seed=1)
    sync = SyncReference(reference, policy, alpha=0.25, every=1)
    sync.on_step_end(None, SimpleNamespace(global_step=1), None)
    synced = whole_weights(reference)
    for name, weight in synced.items():
        expected = 0.75 * start[name] + 0.25 * policy.get_parameter(name)
        torch.testing.assert_close(weight, expected, msg=name)
    sync.save(str(tmp_path), writes=True)
    for _, tensor in written_one_at_a_time(list(reference.named_parameters())):
        tensor.zero_()
    assert all(not weight.any() for weight in whole_weights(reference).values())
    sync.load(str(tmp_path))
    for name, weight in whole_weights(reference).items():
        assert torch.equal(weight, synced[name]), name


def test_an_auto_bucket_size_without_a_hidden_size_names_what_to_set():
    with pytest.raises(ValueError, match=r"holds 'auto' sizes.*set numbers in the config"):
        _frozen_zero3_config(ZERO3_CONFIG, PretrainedConfig())
