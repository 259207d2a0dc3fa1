"""Sharded policy weights (DeepSpeed ZeRO-3, FSDP2) held whole while they are needed whole.

A policy that generates itself needs its whole weights for the round (`generation_weights`); a
colocated vLLM push or a copy of a model needs them for one block (`whole_parameters`); a vLLM
server push, a reference-model sync and a checkpoint of the reference need each tensor whole
only while it is used (`whole_one_at_a_time`). Under ZeRO-3 and FSDP2 the reference model is
sharded as the policy is (`zero3_copy`, `fsdp2_copy`), and is written one tensor at a time
(`written_one_at_a_time`); reward models, which score episodes whenever they end, are whole
copies (`whole_copy`). Every function here is a collective under shards: all processes enter it
together. Outside these blocks the weights stay sharded.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def generation_weights(
    accelerator: Any, model: Any, zero3_gather: bool, policy_generates: bool = True
) -> Iterator[Any]:
    """Generate in eval mode (no dropout, KV cache on), with sharded weights held whole.

    When the policy generates itself: under ZeRO-3 with `zero3_gather`, every process gathers
    the whole weights once, and DeepSpeed's hooks are taken off while generating: with them
    each forward pass is a collective, and episodes of different lengths on different
    processes (different numbers of forward passes) would wait for each other forever. Under
    FSDP2 every module is unsharded once (`fsdp2_unsharded`). When vLLM generates, nothing is
    gathered here: the weight push gathers for itself (`ServerPush`, `ColocatedPush`).

    Args:
        accelerator: The trainer's `Accelerator`.
        model: The policy as the trainer wrapped it (`Trainer.model_wrapped`: under DeepSpeed
            its engine), or unwrapped.
        zero3_gather: Gather ZeRO-3 partitioned weights for generation: a ZeRO-3 run
            (`Placement.zero_stage`) with `ds3_gather_for_generation`.
        policy_generates: Whether the policy generates (transformers), not vLLM.

    Yields the unwrapped policy; its train/eval mode is restored afterwards.
    """
    policy = accelerator.unwrap_model(model)
    was_training = policy.training
    policy.eval()
    try:
        with contextlib.ExitStack() as whole:
            if policy_generates:
                whole.enter_context(_zero3_gathered(model, policy, zero3_gather))
                whole.enter_context(fsdp2_unsharded(policy))
            yield policy
    finally:
        policy.train(was_training)


@contextlib.contextmanager
def whole_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, `model.parameters()` are the whole tensors, whatever shards them.

    Under DeepSpeed ZeRO-3 the weights are gathered from every process; under FSDP2
    (`fully_shard`) they are unsharded (`fsdp2_unsharded`); otherwise nothing changes. With
    shards this is a collective: every process enters the block together.
    Changes made to the gathered ZeRO-3 weights inside the block are not kept.
    """
    gathered = contextlib.nullcontext()
    if zero3_partitioned(model):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gathered, fsdp2_unsharded(model):
        yield


def named_tensors(
    model: torch.nn.Module, tied_once: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """`model.state_dict()`'s names and tensors, as the modules hold them now (shards or whole).

    Each parameter (a tied one under each of its names, or under its first only with
    `tied_once`, as the `Parameter` itself, so that ZeRO-3 can gather it) and each persistent
    buffer: what `state_dict()` holds, read from the modules, because under FSDP2
    `state_dict()` always gives each process's shards (its hook reshards the modules first).
    """
    parameters = model.named_parameters(remove_duplicate=tied_once)
    tensors: dict[str, torch.Tensor] = dict(parameters)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors[f"{prefix}.{name}" if prefix else name] = buffer
    return list(tensors.items())


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name (as `named_parameters()` gives it) -> all its names.

    A weight tied to another (an output layer sharing the input embedding) has several.
    """
    names_by_id: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(parameter), []).append(name)
    return {names[0]: names for names in names_by_id.values()}


def whole_specs(named: Sequence[tuple[str, torch.Tensor]]) -> list[list]:
    """`[name, dtype, shape]` of each tensor as it is whole (a ZeRO-3 or FSDP2 shard included).

    The shape of a ZeRO-3 parameter is its `ds_shape` (the module holds an empty tensor); an
    FSDP2 `DTensor` gives its global shape. What a vLLM server allocates before a push.
    """
    return [
        [name, str(t.dtype).removeprefix("torch."), list(getattr(t, "ds_shape", t.shape))]
        for name, t in named
    ]


def whole_one_at_a_time(
    named: Sequence[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of `named`'s tensors whole, one at a time: never more than one gathered for this.

    A ZeRO-3 parameter is gathered from every process and let go when the next tensor is asked
    for; an FSDP2 `DTensor` is all-gathered into a new tensor; any other tensor comes as it is.
    A collective under shards: every process iterates to the end, in the same order (a process
    that does not use the tensors still takes part in each gather).
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in named:
        if hasattr(tensor, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                yield name, tensor.detach()
        elif isinstance(tensor, DTensor):
            with torch.no_grad():
                whole = tensor.full_tensor()
            yield name, whole
        else:
            yield name, tensor.detach()


def written_one_at_a_time(
    named: Sequence[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of `named`'s parameters whole, one at a time; what is written into it is kept.

    `whole_one_at_a_time` for writing. A ZeRO-3 parameter is gathered, and sharded again from
    the main process's values when the next is asked for; an FSDP2 `DTensor` comes as a whole
    copy, split again from the main process's values into the shards. Every process must write
    the same values, and iterate to the end in the same order. Any other tensor comes as it is.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, tensor in named:
        if hasattr(tensor, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                yield name, tensor.data
        elif isinstance(tensor, DTensor):
            with torch.no_grad():
                whole = tensor.full_tensor()
            yield name, whole
            with torch.no_grad():
                tensor.copy_(distribute_tensor(whole, tensor.device_mesh, tensor.placements))
        else:
            yield name, tensor.data


def zero3_copy(model: Any, deepspeed_config: dict) -> Any:
    """A frozen copy of `model`, sharded by DeepSpeed ZeRO-3: a DeepSpeed engine without optimizer.

    The reference model under ZeRO-3, as TRL shards its own: each process holds its share of the
    weights, and a forward gathers each layer's from every process, so every process runs the
    copy together, as it does the policy. The copy is made sharded (`deepspeed.zero.Init`, in
    the config's precision) and `model`'s weights (whole or ZeRO-3 shards) are written into it one
    parameter at a time: while it is built, a process holds beyond its shards at most one
    parameter whole (the policy's and the copy's).
    A collective. The engine keeps the copy's hooks (they go when it is collected); the copy
    itself is its `module`.

    Args:
        model: The policy, whole or sharded by ZeRO-3 (`from_pretrained` under `zero3_init_flag`).
        deepspeed_config: The run's DeepSpeed config (the accelerate plugin's): its ZeRO-3
            settings and precision, without an optimizer or scheduler.
    """
    import deepspeed
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import set_zero3_state  # "zero.Init ran already"

    config = _frozen_zero3_config(deepspeed_config, model.config)
    # In the config's precision, as the policy's engine holds it: zero.Init's `dtype` argument
    # is not used on a CPU (DeepSpeed 0.19 picks bfloat16 there whatever it says).
    zero_init = deepspeed.zero.Init(config_dict_or_path=config)
    with no_init_weights(), zero_init, set_zero3_state():  # every weight is written below
        copy_ = type(model)(model.config)
    copy_.tie_weights()
    pairs = paired_one_at_a_time(list(copy_.named_parameters()), list(model.named_parameters()))
    with torch.no_grad():
        for target, source in pairs:
            target.copy_(source.to(target.dtype))
        for name, buffer in model.named_buffers():
            copy_.get_buffer(name).copy_(buffer)
    copy_.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=copy_, config=config)
    engine.eval()  # DeepSpeed's returns None
    return engine


def paired_one_at_a_time(
    targets: Sequence[tuple[str, torch.Tensor]], sources: Sequence[tuple[str, torch.Tensor]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each target parameter beside its source's, aligned element for element, one pair at a time.

    What is written into a target is kept (a copy filled from its source, a reference mixed
    with its policy). Two FSDP2 `DTensor`s sharded alike (a reference made by `fsdp2_copy`
    beside its policy) come as their local shards: nothing is gathered.
    Any other pair comes whole (`written_one_at_a_time`, `whole_one_at_a_time`), a collective
    under shards: every process iterates to the end, in the same order.
    """
    from torch.distributed.tensor import DTensor

    for (name, target), (source_name, source) in zip(targets, sources, strict=True):
        if isinstance(target, DTensor) and _split_as(source, target):
            yield target.to_local(), source.to_local()
            continue
        written = written_one_at_a_time([(name, target)])
        read = whole_one_at_a_time([(source_name, source)])
        for (_, whole_target), (_, whole_source) in zip(written, read, strict=True):
            yield whole_target, whole_source


def _split_as(source: torch.Tensor, target: DTensor) -> TypeGuard[DTensor]:
    """Whether `source` is a `DTensor` split as `target` is: same shape, processes and way."""
    from torch.distributed.tensor import DTensor

    return bool(
        isinstance(source, DTensor)
        and source.device_mesh == target.device_mesh
        and source.placements == target.placements
        and source.shape == target.shape
    )


def fsdp2_copy(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """A frozen copy of the whole `model`, sharded by FSDP2 as accelerate shards the policy.

    The reference model under FSDP2, as TRL shards its own (`prepare_fsdp`), but in accelerate's
    units: each decoder layer, the embeddings and the output layer, the root
    (`fsdp2_prepare_model`). Each unit is gathered for its forward and freed after it, the root
    and output layer too (a frozen model has no backward to free them). Its forward is a
    collective: every process runs the copy together, as it does the policy.

    Args:
        model: The policy, whole (the Trainer shards it later, when it prepares it).
        accelerator: The run's `Accelerator`, whose FSDP plugin (version 2) says how to shard.
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    copy_ = copy.deepcopy(model).requires_grad_(False)
    copy_ = fsdp2_prepare_model(accelerator, copy_)
    copy_.set_reshard_after_forward(True)
    return copy_.eval()


def _frozen_zero3_config(deepspeed_config: dict, model_config: Any) -> dict:
    """`deepspeed_config` for a model that is never trained, its ZeRO-3 sizes set as TRL's.

    The optimizer and scheduler go. From the model's hidden size H, as TRL sizes its reference:
    buckets of H x H, parameters below 10 x H kept whole after their first use, no prefetching
    (a forward gathers each layer as it runs). Without a hidden size the config's own sizes
    stay, which the Trainer would settle from "auto" only when it prepares the policy.
    """
    config = copy.deepcopy(deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    hidden = getattr(model_config.get_text_config(decoder=True), "hidden_size", None)
    if hidden is not None:
        zero["reduce_bucket_size"] = hidden * hidden
        zero["stage3_param_persistence_threshold"] = 10 * hidden
        zero["stage3_prefetch_bucket_size"] = 0
    elif "auto" in zero.values():
        raise ValueError(
            "the DeepSpeed config's zero_optimization holds 'auto' sizes and the model's config "
            "has no hidden_size to size them by: set numbers in the config"
        )
    return config


def whole_copy(model: Any) -> Any:
    """An ordinary copy of a ZeRO-3 model, built from its weights gathered from every process.

    For a model that runs outside DeepSpeed's engine (a reward model):
    without the engine's hooks a forward would read its empty shards. A collective: every
    process makes the copy at the same time, and each holds it whole. The copy is built with
    transformers' ZeRO-3 initialisation off: a class that builds its base model with
    `AutoModel.from_config` (the sequence classifiers) would otherwise be sharded again.
    """
    from transformers.modeling_utils import set_zero3_state  # "zero.Init ran already"

    with whole_parameters(model):
        state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with set_zero3_state():
        copy_ = type(model)(model.config)
    copy_.load_state_dict(state)
    return copy_.to(dtype=next(model.parameters()).dtype)


def zero3_partitioned(model: Any) -> bool:
    """Whether DeepSpeed ZeRO-3 holds `model`'s parameters as shards."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) shards any of `model`'s modules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


@contextlib.contextmanager
def fsdp2_unsharded(policy: torch.nn.Module) -> Iterator[None]:
    """Hold an FSDP2 (`fully_shard`) policy's weights whole until the block ends.

    Every FSDP module is unsharded once (a collective all processes make together) and kept
    unsharded after each forward, so generating needs no collective: processes may run
    different numbers of forward passes. Afterwards each module is resharded and gets back its
    own reshard-after-forward setting. A policy without FSDP modules is left alone.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    # FSDP2 has no public getter for the setting; its param group keeps it as this property.
    reshards = [_reshards_after_forward(m) for m in modules]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module, reshard in zip(modules, reshards, strict=True):
            module.set_reshard_after_forward(reshard, recurse=False)
            module.reshard()


def _reshards_after_forward(module: Any) -> bool:
    group = module._get_fsdp_state()._fsdp_param_group
    return bool(group is not None and group._reshard_after_forward)


def _zero3_gathered(model: Any, policy: Any, gather: bool) -> Any:
    """The context that holds ZeRO-3 weights whole while generating (nothing unless `gather`)."""
    if not gather:
        return contextlib.nullcontext()
    import deepspeed

    whole = deepspeed.zero.GatheredParameters(list(policy.parameters()))
    if getattr(model, "optimizer", None) is None:  # not yet an engine: no hooks to take off
        return whole
    return _without_zero3_hooks(model, whole)


@contextlib.contextmanager
def _without_zero3_hooks(engine: Any, whole: Any) -> Iterator[None]:
    """Inside `whole` (the gathered weights), run forwards with no ZeRO-3 hook at all.

    DeepSpeed hooks every module (fetch and release its shards) and the root once more (start
    of a forward: a broadcast that checks every process runs the same step). Both are
    collectives; the hooks are put back, in their order, afterwards. DeepSpeed's own
    `unwrap_model_for_generation` leaves the root's hook on, and so still hangs.
    """
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    root_hooks = offload.module._forward_pre_hooks
    start_id = offload.fwd_pre_hook.id
    with whole:
        start_hook = root_hooks.pop(start_id)
        for handle in offload.forward_hooks + offload.backward_hooks:
            handle.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)
            later = list(root_hooks.items())
            root_hooks.clear()
            root_hooks.update([(start_id, start_hook), *later])
