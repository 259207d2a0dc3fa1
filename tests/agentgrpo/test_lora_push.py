"""Adapter-only LoRA pushes without vLLM: the decision, its fallbacks, the saved adapter, versions.

The pushes into a real vLLM are tested in tests/end_to_end/vllm/test_vllm_lora.py.
"""

from __future__ import annotations

import json
import warnings

import anyio
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from agentgrpo import GRPOConfig
from agentgrpo.generation.adapters import (
    LoraLimits,
    adapter_pushes,
    colocate_limits,
    save_adapter,
    unservable,
)
from agentgrpo.generation.weight_sync import base_weights
from rollout.backends.lora_versions import AdapterVersions
from tests.support.tiny_model import tiny_llama

SERVER = LoraLimits(max_lora_rank=16, max_loras=4)


def lora_policy(tokenizer, **lora):
    """The tiny Llama with a LoRA adapter whose B is not zero (it changes the outputs)."""
    settings = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False) | lora
    return get_peft_model(tiny_llama(tokenizer), LoraConfig(**settings))


def config(tmp_path, push: str = "auto", **fields) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_lora_push=push, **fields)


def decide(args, policy, limits=SERVER) -> bool:
    return adapter_pushes(args, policy, lambda: unservable(policy, limits), "server")


def test_a_plain_lora_policy_pushes_its_adapter_without_a_warning(tokenizer, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decide(config(tmp_path), lora_policy(tokenizer))
        assert decide(config(tmp_path, "adapter"), lora_policy(tokenizer))


def test_merged_pushes_are_kept_when_asked_for(tokenizer, tmp_path):
    assert not decide(config(tmp_path, "merged"), lora_policy(tokenizer))


@pytest.mark.parametrize(
    ("lora", "limits", "reason"),
    [
        (dict(use_dora=True), SERVER, "use_dora=True"),
        (dict(modules_to_save=["lm_head"]), SERVER, "modules_to_save"),
        (dict(r=32), SERVER, "rank 32 is over the engine's max_lora_rank 16"),
        (dict(rank_pattern={"v_proj": 64}), SERVER, "rank 64 is over"),
        (dict(target_modules=["q_proj", "embed_tokens"]), SERVER, "LoRA on model.embed_tokens"),
        (dict(lora_bias=True), SERVER, "LoRA bias"),
        ({}, None, "agentgrpo vllm-serve --enable-lora"),
    ],
)
def test_what_vllm_cannot_serve_as_an_adapter_is_pushed_merged_with_the_reason(
    tokenizer, tmp_path, lora, limits, reason
):
    policy = lora_policy(tokenizer, **lora)
    for push in ("auto", "adapter"):
        with pytest.warns(UserWarning, match="pushing merged weights") as caught:
            assert not decide(config(tmp_path, push), policy, limits)
        assert reason in str(caught[0].message)


def test_a_colocated_engine_takes_the_smallest_vllm_rank_that_holds_the_adapter(tokenizer):
    assert colocate_limits(lora_policy(tokenizer, r=4)).max_lora_rank == 8
    assert colocate_limits(lora_policy(tokenizer, r=16)).max_lora_rank == 16
    too_big = lora_policy(tokenizer, r=600)
    assert "rank 600 is over the engine's max_lora_rank 512" in unservable(
        too_big, colocate_limits(too_big)
    )


def test_adapter_pushes_without_peft_are_refused_only_when_asked_for(tokenizer, tmp_path):
    full = tiny_llama(tokenizer)
    with pytest.raises(ValueError, match=r"vllm_lora_push='adapter'.*peft_config=LoraConfig"):
        decide(config(tmp_path, "adapter"), full)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not decide(config(tmp_path, "auto"), full)


def test_an_unknown_push_is_refused_naming_what_works(tmp_path):
    with pytest.raises(ValueError, match="vllm_lora_push='lora' must be one of auto, adapter"):
        config(tmp_path, "lora", use_vllm=True)


def test_the_saved_adapter_holds_exactly_the_trained_lora_tensors(tokenizer, tmp_path):
    policy = lora_policy(tokenizer)
    q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():  # as an optimizer step would
        q_proj.lora_B["default"].weight.add_(0.5)
    size = save_adapter(policy, tmp_path / "v1")
    saved = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    trained = {
        name.replace(".default", ""): tensor
        for name, tensor in policy.state_dict().items()
        if "lora_" in name
    }
    assert saved.keys() == trained.keys() and len(saved) == 2 * 2 * 2  # A, B; q, v; 2 layers
    assert all(torch.equal(saved[name], trained[name]) for name in saved)
    assert json.loads((tmp_path / "v1" / "adapter_config.json").read_text())["r"] == 4
    files = tmp_path / "v1" / "adapter_model.safetensors", tmp_path / "v1" / "adapter_config.json"
    assert size == sum(path.stat().st_size for path in files)
    whole = sum(t.numel() * t.element_size() for _, t in base_weights(policy))
    assert size < whole / 100


def test_the_base_weights_are_the_unmerged_ones_under_the_base_models_names(tokenizer):
    base = tiny_llama(tokenizer)
    expected = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    pushed = dict(base_weights(get_peft_model(base, LoraConfig(r=4, init_lora_weights=False))))
    assert pushed.keys() == expected.keys()
    assert all(torch.equal(pushed[name], expected[name]) for name in expected)


def test_versions_past_keep_are_evicted_oldest_first(tmp_path):
    versions = AdapterVersions(keep=2)
    adapters = [versions.next_adapter(step, str(tmp_path)) for step in range(4)]
    assert len({a.lora_id for a in adapters}) == 4 and min(a.lora_id for a in adapters) >= 1
    assert [versions.add(a) for a in adapters] == [[], [], [adapters[0]], [adapters[1]]]
    assert versions.loaded == adapters[2:] and versions.newest == adapters[3]


def test_two_runs_never_name_an_adapter_alike(tmp_path):
    # A server outlives a run: a resumed run must not reuse a name the server still holds.
    first, second = AdapterVersions(keep=2), AdapterVersions(keep=2)
    names = {versions.next_adapter(0, str(tmp_path)).name for versions in (first, second)}
    assert len(names) == 2 and all(name.endswith("-v0-1") for name in names)


def test_an_episode_finishes_on_the_version_it_started_with(tmp_path):
    versions = AdapterVersions(keep=2)
    v0, v1, v2 = (versions.next_adapter(step, str(tmp_path)) for step in range(3))
    seen: dict[str, list[int]] = {"old": [], "new": []}
    started_old, pushed_v1 = anyio.Event(), anyio.Event()
    started_new, pushed_v2 = anyio.Event(), anyio.Event()

    async def old_episode() -> None:  # its turns span two pushes
        seen["old"].append(versions.for_request().version)
        started_old.set()
        await pushed_v1.wait()
        seen["old"].append(versions.for_request().version)  # v0 still loaded: kept
        await pushed_v2.wait()
        seen["old"].append(versions.for_request().version)  # v0 evicted: the newest

    async def new_episode() -> None:
        await pushed_v1.wait()
        seen["new"].append(versions.for_request().version)
        started_new.set()
        await pushed_v2.wait()
        seen["new"].append(versions.for_request().version)  # v1 still loaded: kept

    async def main() -> None:
        versions.add(v0)
        async with anyio.create_task_group() as episodes:
            episodes.start_soon(old_episode)
            episodes.start_soon(new_episode)
            await started_old.wait()
            versions.add(v1)
            pushed_v1.set()
            await started_new.wait()
            versions.add(v2)
            pushed_v2.set()

    anyio.run(main)
    assert seen == {"old": [0, 0, 2], "new": [1, 1]}


def test_a_frozen_adapter_is_pinned_inside_and_the_episodes_own_version_is_kept(tmp_path):
    versions = AdapterVersions(keep=2)
    v0, frozen, v1 = (versions.next_adapter(step, str(tmp_path)) for step in (0, 0, 1))
    seen = []

    async def game() -> None:  # a policy seat and a snapshot seat take turns in one task
        for turn in range(4):
            if turn % 2:
                with versions.pinned(frozen):
                    seen.append(versions.for_request())
            else:
                seen.append(versions.for_request())
            if turn == 1:
                versions.add(v1)  # a push mid-game: the policy seat stays on its version

    versions.add(v0)
    anyio.run(game)
    assert seen == [v0, frozen, v0, frozen] and versions.loaded == [v0, v1]  # not one of them


def test_before_the_first_push_requests_use_the_engines_own_weights():
    assert AdapterVersions(keep=1).for_request() is None
    with pytest.raises(ValueError, match="at least the newest"):
        AdapterVersions(keep=0)


def test_vision_policies_and_servers_on_other_machines_are_pushed_merged(tokenizer, tmp_path):
    from agentgrpo.generation.generator import _adapter_refusal
    from agentgrpo.generation.weight_sync import ServerPush
    from rollout.backends.vllm_server import ServerConnection

    policy, args = lora_policy(tokenizer), config(tmp_path)
    assert "reads images" in _adapter_refusal(args, policy, object(), None)
    assert _adapter_refusal(args, policy, None, None) is None  # colocated, text only
    remote = ServerPush(ServerConnection("http://gpu-box:8000", timeout_s=1.0), 51216)
    assert "may not read the trainer's adapter folder" in _adapter_refusal(
        args, policy, None, remote
    )
