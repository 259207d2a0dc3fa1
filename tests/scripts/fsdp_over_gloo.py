"""Run a module or script with accelerate's FSDP2 sharding over CPU processes (gloo).

accelerate (1.15) picks FSDP only on GPUs and other accelerators; `shard_with_fsdp_on_cpu` lifts
that one choice so the project's FSDP2 paths run under `accelerate launch` on a CPU machine, e.g.

    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 \
        --mixed_precision no tests/scripts/fsdp_over_gloo.py -m agentgrpo run env:Counter ...

(`tests/scripts/distributed_train.py --fsdp-over-gloo` calls it itself.)
"""

from __future__ import annotations

import runpy
import sys


def shard_with_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP2 shard a launch over CPU processes (gloo), as it does over GPUs.

    accelerate (1.15) picks FSDP only when its process state says GPUs (or other accelerators)
    and runs CPU processes as MULTI_CPU, plain data parallelism; torch's FSDP2 itself runs on
    CPU over gloo. This lifts that one choice, in this process only: the state is then read as
    multi-GPU when the accelerator picks its engine, and everything after (accelerate's FSDP2
    wrapping, torch's `fully_shard`, the trainer) runs as shipped, on the CPU.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original_init = PartialState.__init__

    def init(self, cpu: bool = False, **kwargs) -> None:
        original_init(self, cpu=cpu, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU

    PartialState.__init__ = init


def main() -> None:
    """`fsdp_over_gloo.py -m MODULE ARGS...` or `fsdp_over_gloo.py SCRIPT ARGS...`."""
    shard_with_fsdp_on_cpu()
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
