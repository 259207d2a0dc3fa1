"""A sharded policy's tensors, whole one at a time (what a vLLM server push sends), and the
ZeRO-3 and FSDP2 reference models, in one process.

The two-process ZeRO-3 and FSDP2 pushes run in
`tests/end_to_end/vllm/test_vllm_server.py::test_a_sharded_run_over_two_processes_pushes_...`;
the two-process sharded references (built by `zero3_copy` and `fsdp2_copy`) in
`tests/end_to_end/test_distributed.py`.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from agentgrpo.devices import skip_unused_deepspeed_build
from agentgrpo.models.reference_sync import REFERENCE_FILE, SyncReference
from agentgrpo.models.sharded import (
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
    """The one-process group as a DeepSpeed launch on CPU processes runs it.

    The local rank DeepSpeed reads is set as a launcher sets it, and, as `GRPOConfig` does
    under such a launch, DeepSpeed skips building the shared-memory all-reduce that only its
    inference layers call (a minute of g++ the first time).
    """
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    import deepspeed

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    assert skip_unused_deepspeed_build(os.environ)


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


def fsdp2_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` sharded by FSDP2 in the one-process group, its layers and root as accelerate does.

    One process holds the whole of each shard: the two-process runs of
    `tests/end_to_end/test_distributed.py` check that writes reach every process's shard.
    """
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).requires_grad_(False)


def as_it_is(model: torch.nn.Module) -> torch.nn.Module:
    return model


# engine -> (how the reference is made from the starting policy, how the policy is held)
SYNCED_PAIRS = {
    "zero3": (lambda model: zero3_copy(model, ZERO3_CONFIG).module, as_it_is),
    "fsdp2": (lambda model: fsdp2_sharded(frozen_copy(model)), fsdp2_sharded),
    "fsdp2 reference, whole policy": (lambda model: fsdp2_sharded(frozen_copy(model)), as_it_is),
    "whole": (frozen_copy, as_it_is),
}


@pytest.mark.parametrize(
    "engine", [pytest.param("zero3", marks=needs_deepspeed), *list(SYNCED_PAIRS)[1:]]
)
def test_a_reference_keeps_each_sync_and_comes_back_from_a_checkpoint(
    engine, deepspeed_process, tokenizer, tmp_path
):
    make_reference, hold_policy = SYNCED_PAIRS[engine]
    reference = make_reference(tiny_llama(tokenizer))
    start = whole_weights(reference)
    policy = hold_policy(tiny_llama(tokenizer, seed=1))
    current = whole_weights(policy)
    sync = SyncReference(reference, policy, alpha=0.25, every=1)
    sync.on_step_end(None, SimpleNamespace(global_step=1), None)
    synced = whole_weights(reference)
    for name, weight in synced.items():
        torch.testing.assert_close(weight, 0.75 * start[name] + 0.25 * current[name], msg=name)
    sync.save(str(tmp_path), writes=True)
    with safe_open(str(tmp_path / REFERENCE_FILE), framework="pt") as saved:
        assert "lm_head.weight" not in set(saved.keys())  # tied to the embedding: written once
    for _, tensor in written_one_at_a_time(list(reference.named_parameters())):
        tensor.zero_()
    assert all(not weight.any() for weight in whole_weights(reference).values())
    sync.load(str(tmp_path))
    for name, weight in whole_weights(reference).items():
        assert torch.equal(weight, synced[name]), name


def test_a_reference_saved_under_the_other_tied_name_loads(tokenizer, tmp_path):
    # An earlier version let safetensors choose which name of a tied weight to keep.
    source = tiny_llama(tokenizer, seed=1)
    weights = {n: t for n, t in source.state_dict().items() if n != "model.embed_tokens.weight"}
    save_file(weights, str(tmp_path / REFERENCE_FILE))
    reference = tiny_llama(tokenizer)
    SyncReference(reference, source, alpha=0.5, every=1).load(str(tmp_path))
    for name, weight in source.state_dict().items():
        assert torch.equal(reference.get_parameter(name), weight), name


def test_a_reference_file_of_another_model_is_refused_with_what_to_do(tokenizer, tmp_path):
    model = tiny_llama(tokenizer)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / REFERENCE_FILE))
    with pytest.raises(ValueError, match=r"has no tensor 'model.embed_tokens.weight'.*resume"):
        SyncReference(model, model, alpha=0.5, every=1).load(str(tmp_path))


def test_an_auto_bucket_size_without_a_hidden_size_names_what_to_set():
    with pytest.raises(ValueError, match=r"holds 'auto' sizes.*set numbers in the config"):
        _frozen_zero3_config(ZERO3_CONFIG, PretrainedConfig())
