"""The launch as `Placement.of` reads it from a real accelerator.

The sharded launches (ZeRO, FSDP2) are read by every run of `tests/end_to_end/test_distributed.py`.
"""

from __future__ import annotations

from accelerate import Accelerator

from agentgrpo.placement import Placement


def test_a_single_cpu_process_is_placed_unsharded_without_deepspeed():
    placement = Placement.of(Accelerator(cpu=True))
    assert placement == Placement(engine="NO", num_processes=1)
    assert not placement.uses_deepspeed and not placement.fsdp_saves_shards


def test_a_deepspeed_config_means_deepspeed_whatever_its_stage():
    assert Placement(engine="DEEPSPEED", zero_stage=2, deepspeed_config={}).uses_deepspeed
    assert not Placement(engine="FSDP", fsdp2=True).uses_deepspeed
