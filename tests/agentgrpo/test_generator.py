"""The generator chosen once: the combination table's refusals, and what each config gets."""

from __future__ import annotations

import pytest
import torch

from agentgrpo.generation.generator import check_combination, choose_generators
from agentgrpo.generation.local import CopiedWeights, SharedWeights
from agentgrpo.placement import Placement
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config

ZERO3_OVER_TWO = Placement(engine="DEEPSPEED", num_processes=2, zero_stage=3)


def test_zero3_generation_from_shards_over_processes_is_refused_with_the_fix(tmp_path):
    shards = short_run_config(tmp_path, ds3_gather_for_generation=False)
    with pytest.raises(ValueError, match="leave ds3_gather_for_generation=True"):
        check_combination(shards, ZERO3_OVER_TWO)
    check_combination(shards, Placement(engine="DEEPSPEED", num_processes=1, zero_stage=3))
    check_combination(shards, Placement(engine="DEEPSPEED", num_processes=2, zero_stage=2))
    check_combination(short_run_config(tmp_path), ZERO3_OVER_TWO)  # gathered: generates


def test_async_over_sharded_weights_is_refused_naming_the_engine_and_what_works(tmp_path):
    asynchronous = short_run_config(tmp_path, async_grpo=True, queue_maxsize=64)
    zero3 = Placement(engine="DEEPSPEED", zero_stage=3)
    with pytest.raises(ValueError, match=r"from DeepSpeed ZeRO-3's sharded weights.*ZeRO-2"):
        check_combination(asynchronous, zero3)
    with pytest.raises(ValueError, match="from FSDP's sharded weights"):
        check_combination(asynchronous, Placement(engine="FSDP", fsdp2=True))
    check_combination(asynchronous, Placement(engine="DEEPSPEED", zero_stage=2))
    check_combination(asynchronous, Placement())
    check_combination(short_run_config(tmp_path), zero3)  # synchronous: gathered per round


def test_transformers_rounds_share_the_policy_and_an_async_producer_copies_it(tmp_path, tokenizer):
    policy = tiny_llama(tokenizer)
    synchronous = choose_generators(
        short_run_config(tmp_path), Placement(), policy, tokenizer, accelerator=None
    )
    assert isinstance(synchronous.rounds, SharedWeights) and synchronous.producer is None
    assert synchronous.rounds.backend.model is policy

    asynchronous = choose_generators(
        short_run_config(tmp_path, async_grpo=True, queue_maxsize=64),
        Placement(),
        policy,
        tokenizer,
        accelerator=None,
    )
    producer = asynchronous.producer
    assert isinstance(asynchronous.rounds, SharedWeights) and isinstance(producer, CopiedWeights)
    assert producer.model is not policy and producer.backend.model is producer.model
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    with producer.generating(policy, step=3):  # a round on step 3: copied in first
        assert producer.version == 3
    for mine, theirs in zip(producer.model.parameters(), policy.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_an_fsdp2_launch_decodes_without_cuda_graphs(tmp_path, tokenizer):
    """FSDP's forward hooks make its streams wait on the current one: no capture takes that."""
    policy, args = tiny_llama(tokenizer), short_run_config(tmp_path)
    fsdp2 = choose_generators(args, Placement(engine="FSDP", fsdp2=True), policy, tokenizer, None)
    plain = choose_generators(args, Placement(), policy, tokenizer, accelerator=None)
    assert not fsdp2.rounds.backend.cuda_graphs and plain.rounds.backend.cuda_graphs
