"""Which device `agentgrpo run`, `eval` and `doctor` use: `--device`, checked and described.

`--device` takes `cpu`, `cuda` (the first GPU) or `cuda:N` (the N-th GPU CUDA can see); left
out, a command uses the first GPU when there is one, else the CPU. A device this machine does
not have is an error that says what to use instead.

transformers' Trainer puts a one-process run on `cuda:0` and spreads it over every visible GPU
(`nn.DataParallel`, which agentgrpo's batches do not support), so `agentgrpo run` in one process
makes only the chosen GPU visible (`CUDA_VISIBLE_DEVICES`) before CUDA starts. Under a
distributed launch (`accelerate launch`), each process takes its own GPU, as accelerate assigns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from agentgrpo.placement import Placement
from agentgrpo.precision import describe_precision

DEVICE_FORMS = "cpu, cuda or cuda:N (N counts the GPUs CUDA can see, from 0)"
VISIBLE = "CUDA_VISIBLE_DEVICES"


def parse_device(text: str) -> torch.device:
    """`--device`'s text as a torch device; `cuda` means `cuda:0`.

    Raises:
        ValueError: Not one of `DEVICE_FORMS`.

    Examples:
        >>> parse_device("cuda"), parse_device("cuda:1"), parse_device("cpu")
        (device(type='cuda', index=0), device(type='cuda', index=1), device(type='cpu'))

    """
    try:
        device = torch.device(text.strip().lower())
    except RuntimeError:  # not a device string at all ("gpu", "cuda:-1", ...)
        device = torch.device("meta")
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device takes {DEVICE_FORMS}, not {text!r}")
    return torch.device("cuda", device.index or 0) if device.type == "cuda" else device


def check_available(device: torch.device, cuda_built: bool, gpus: int) -> None:
    """Refuse a CUDA device this machine cannot give, saying what to use instead.

    Args:
        device: From `parse_device`.
        cuda_built: Whether this torch was built with CUDA (`torch.backends.cuda.is_built()`).
        gpus: How many GPUs CUDA sees (`torch.cuda.device_count()`).

    Raises:
        ValueError: A CUDA device, and a CPU-only torch, no GPU, or no GPU with that index.
    """
    if device.type != "cuda":
        return
    if not cuda_built:
        raise ValueError(
            f"--device {device}: this torch ({torch.__version__}) is built for CPU only; "
            "install a CUDA build of torch, or use --device cpu"
        )
    if gpus == 0:
        raise ValueError(
            f"--device {device}: CUDA sees no GPU (check nvidia-smi, the driver and "
            f"{VISIBLE}); use --device cpu"
        )
    if device.index is not None and device.index >= gpus:
        raise ValueError(
            f"--device {device}: CUDA sees {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}; "
            "choose one of those"
        )


def resolve_device(text: str | None) -> torch.device:
    """The device a command runs on: `--device`'s, checked, or the first GPU, else the CPU.

    Raises:
        ValueError: See `parse_device` and `check_available`.
    """
    if text is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = parse_device(text)
    check_available(device, torch.backends.cuda.is_built(), _gpus(device))
    return device


def visible_devices(index: int, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` value that leaves only GPU `index` of those now visible.

    Examples:
        >>> visible_devices(1, None), visible_devices(1, "4,6"), visible_devices(0, "GPU-5a1c")
        ('1', '6', 'GPU-5a1c')

    Raises:
        ValueError: `visible` lists fewer GPUs than `index` needs.
    """
    if visible is None or not visible.strip():
        return str(index)
    listed = [entry.strip() for entry in visible.split(",")]
    if index >= len(listed):
        raise ValueError(
            f"--device cuda:{index}: {VISIBLE}={visible} shows {len(listed)} GPU(s), cuda:0 to "
            f"cuda:{len(listed) - 1}; choose one of those or change {VISIBLE}"
        )
    return listed[index]


def pin_training_device(text: str | None, environ: MutableMapping[str, str]) -> dict[str, Any]:
    """The GRPOConfig fields for `agentgrpo run --device`, making only that GPU visible.

    `cpu` gives `use_cpu=True`. A GPU (`cuda`, `cuda:N`, or none named on a machine with CUDA)
    is made the only visible one through `environ[CUDA_VISIBLE_DEVICES]`, which CUDA reads when
    it starts: so call this before anything touches CUDA. Under a distributed launch
    (`WORLD_SIZE` > 1) nothing is pinned: every process takes its own GPU; with no device named
    and no GPU to take, the processes train together on the CPU (`use_cpu=True`: accelerate
    joins CPU processes over gloo only then, and would otherwise run each alone).

    Raises:
        ValueError: A bad or unavailable device, `cuda:N` in a distributed launch, or a GPU
            asked for after CUDA started in this process.
    """
    device = parse_device(text) if text is not None else None
    if device is not None and device.type == "cpu":
        return {"use_cpu": True}
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        if device is not None and ":" in (text or ""):
            raise ValueError(
                f"--device {device}: under a distributed launch every process uses its own GPU; "
                f"choose the GPUs with {VISIBLE} (or accelerate's --gpu_ids), and pass --device "
                "cuda or nothing"
            )
        return {"use_cpu": True} if device is None and not torch.cuda.is_available() else {}
    if not torch.backends.cuda.is_built():
        if device is not None:
            check_available(device, cuda_built=False, gpus=0)
        return {}
    _pin(device.index if device is not None else 0, environ, required=device is not None)
    return {}


def _pin(index: int, environ: MutableMapping[str, str], required: bool) -> None:
    """Leave GPU `index` alone visible; when CUDA has no GPU, undo that (or fail if `required`)."""
    if torch.cuda.is_initialized():
        if index != 0:
            raise ValueError(
                f"--device cuda:{index} must be chosen before CUDA starts in this process; set "
                f"{VISIBLE}={index} in the environment instead"
            )
        return
    before = environ.get(VISIBLE)
    environ[VISIBLE] = visible_devices(index, before)
    if torch.cuda.is_available():
        return
    if before is None:
        del environ[VISIBLE]
    else:
        environ[VISIBLE] = before
    if required:
        raise ValueError(
            f"--device cuda:{index}: CUDA sees no such GPU (check nvidia-smi, the driver and "
            f"{VISIBLE}={before}); use --device cpu"
        )


def describe_device(device: torch.device, environ: MutableMapping[str, str]) -> str:
    """The device for a start-up summary: `cpu`, or `cuda:0 (NVIDIA H100 80GB HBM3)`.

    A GPU's line also says which GPUs `CUDA_VISIBLE_DEVICES` shows, when it is set. The CPU is
    `cpu` whether one process or several run on it (accelerate's processes there say `cpu:0`).
    """
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return str(device)
    details = [torch.cuda.get_device_name(device)]
    if environ.get(VISIBLE):
        details.append(f"{VISIBLE}={environ[VISIBLE]}")
    return f"{device} ({', '.join(details)})"


def describe_run_device(
    device: torch.device,
    autocast: torch.dtype | None,
    environ: MutableMapping[str, str] | None = None,
) -> str:
    """`describe_device` and the precision (float32 weights), for eval's and doctor's summary."""
    where = describe_device(device, os.environ if environ is None else environ)
    return f"{where}, {describe_precision(torch.float32, autocast)}"


def inference_autocast(device: torch.device) -> torch.dtype | None:
    """The autocast dtype a model plays in on `device`, as a training run there would.

    bfloat16 on a GPU that supports it (what `bf16=None` turns on for training), else None
    (float32): `agentgrpo eval` and `doctor --generate` then see the numbers training sees.
    """
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None


def _gpus(device: torch.device) -> int:
    if device.type != "cuda" or not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def check_launch(environ: Mapping[str, str], placement: Placement) -> None:
    """Refuse a launch that accelerate runs otherwise than it was asked to.

    Its processes run one by one (`check_processes_joined`), FSDP asked for and not run
    (`check_sharded_launch`), or FSDP version 1 (`check_fsdp_version`).

    Args:
        environ: The process environment.
        placement: How accelerate runs it.
    """
    check_processes_joined(environ, placement.num_processes)
    check_sharded_launch(environ, placement.engine)
    check_fsdp_version(placement.engine, placement.fsdp2)


def check_processes_joined(environ: Mapping[str, str], num_processes: int) -> None:
    """Refuse a launch of several processes that accelerate runs one by one.

    `accelerate launch --num_processes N` (or torchrun) starts N processes with `WORLD_SIZE=N`.
    On a machine without a GPU, accelerate joins them (over gloo) only when they train on the
    CPU (`use_cpu=True`); otherwise each runs alone: N separate runs, each on all the rows,
    writing one output folder.

    Args:
        environ: The process environment.
        num_processes: The processes accelerate joined (`Placement.num_processes`).

    Raises:
        ValueError: `WORLD_SIZE` > 1 and one process in the accelerator.

    Example:
        >>> check_processes_joined({"WORLD_SIZE": "2"}, 2)
        >>> check_processes_joined({}, 1)
    """
    launched = int(environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes == 1:
        raise ValueError(
            f"this launch started {launched} processes (WORLD_SIZE={launched}), but accelerate "
            "runs each of them alone: without a GPU it joins processes only when they train on "
            "the CPU. Set use_cpu=True in GRPOConfig (agentgrpo run: --device cpu, or no "
            "--device) to train them together over gloo, or launch one process"
        )


def check_fsdp_version(engine: str, is_fsdp2: bool) -> None:
    """Refuse FSDP version 1: the policy's sharded weights are gathered under FSDP2 only.

    Generating (with transformers, or pushing to vLLM) needs the policy's whole weights;
    agentgrpo gathers them from FSDP2's shards (`models.sharded.fsdp2_unsharded`,
    `weight_sync.whole_parameters`) and DeepSpeed ZeRO-3's, not from FSDP1's flat parameters
    (`fsdp_version: 1`, accelerate's default).

    Args:
        engine: `Placement.engine` (e.g. "FSDP").
        is_fsdp2: `Placement.fsdp2`.

    Raises:
        ValueError: FSDP, not version 2.

    Example:
        >>> check_fsdp_version("FSDP", is_fsdp2=True)
        >>> check_fsdp_version("MULTI_GPU", is_fsdp2=False)
    """
    if engine == "FSDP" and not is_fsdp2:
        raise ValueError(
            "the accelerate config runs FSDP version 1 (fsdp_version: 1, accelerate's default): "
            "agentgrpo gathers the policy's sharded weights for generation under FSDP2 only. "
            "Set fsdp_version: 2 in the config (as examples/accelerate/fsdp2.yaml does)"
        )


def check_sharded_launch(environ: Mapping[str, str], engine: str) -> None:
    """Refuse a launch that asked for FSDP and got accelerate's plain data parallelism.

    `accelerate launch` with an FSDP config sets `ACCELERATE_USE_FSDP=true`; accelerate (1.15)
    shards with FSDP only on GPUs and other accelerators, and on CPU processes quietly runs
    DDP over gloo instead. That run would train, unsharded, while its config says otherwise.

    Args:
        environ: The process environment.
        engine: `Placement.engine` (e.g. "FSDP").

    Raises:
        ValueError: FSDP was asked for and `engine` is not FSDP.

    Example:
        >>> check_sharded_launch({"ACCELERATE_USE_FSDP": "true"}, "FSDP")
        >>> check_sharded_launch({}, "MULTI_CPU")
    """
    asked = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if asked and engine != "FSDP":
        raise ValueError(
            f"the accelerate config asks for FSDP, but accelerate runs this launch as {engine}: "
            "accelerate shards with FSDP only on GPUs (and other accelerators), never on CPU "
            "processes. Launch on GPUs, or on CPU use examples/accelerate/deepspeed_zero2.yaml "
            "or deepspeed_zero3.yaml (DeepSpeed shards over gloo) or ddp.yaml"
        )


def skip_unused_deepspeed_build(environ: Mapping[str, str]) -> bool:
    """Under DeepSpeed on CPU processes, keep DeepSpeed from compiling an op ZeRO never calls.

    DeepSpeed's torch backend, on its CPU accelerator, JIT-compiles its shared-memory
    all-reduce (`deepspeed_shm_comm`: about a minute of g++ on 2 cores the first time, cached
    under ~/.cache/torch_extensions) as its process group starts. Only `inference_all_reduce`
    calls that op (DeepSpeed's tensor-parallel inference layers), and without it that call falls
    back to torch.distributed's all_reduce; ZeRO training talks through torch.distributed alone.
    Marking the op incompatible before the process group starts skips the build.

    Args:
        environ: The process environment (`accelerate launch` sets `ACCELERATE_USE_DEEPSPEED`).

    Returns:
        Whether the build is skipped: a DeepSpeed launch and DeepSpeed's accelerator is the CPU.
    """
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError:  # accelerate says what to install when it starts DeepSpeed
        return False
    if get_accelerator().device_name() != "cpu":
        return False
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


def name_deepspeed_accelerator(environ: MutableMapping[str, str], torch_accelerator: Any) -> bool:
    """Tell DeepSpeed its accelerator is the CPU where this torch has no other, so it stays quiet.

    accelerate imports DeepSpeed whenever it is installed (its `extract_model_from_parallel`,
    which transformers' Trainer calls on every launch, checks for `DeepSpeedEngine`), and
    DeepSpeed then guesses its accelerator and warns "Setting accelerator to CPU. If you have GPU
    or other accelerator, we were unable to detect it." on every CPU run, DeepSpeed's or not.
    Where torch is built without any accelerator that guess is certain, so `DS_ACCELERATOR=cpu`
    names it instead; a value the user set is kept, and a torch with an accelerator built in
    (CUDA, XPU, ...) is left to DeepSpeed's own detection.

    Args:
        environ: The process environment, set before DeepSpeed is first imported.
        torch_accelerator: `torch.accelerator.current_accelerator(check_available=False)`: the
            accelerator this torch was built for, None for a CPU-only build.

    Returns:
        Whether `DS_ACCELERATOR` was set.

    Example:
        >>> environ = {}
        >>> name_deepspeed_accelerator(environ, None), environ
        (True, {'DS_ACCELERATOR': 'cpu'})
        >>> name_deepspeed_accelerator({}, torch.device("cuda"))
        False
    """
    if torch_accelerator is not None or "DS_ACCELERATOR" in environ:
        return False
    environ["DS_ACCELERATOR"] = "cpu"
    return True
