"""The fixtures of the vLLM tests: vLLM's CPU environment, the taught tiny policy, its LoRA.

Module-scoped: each test module gets its own environment, policy and engine or server.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.support.vllm_support import VLLM_CPU_ENVIRONMENT, load_policy, taught_model_path


@pytest.fixture(scope="module")
def vllm_environment(tmp_path_factory):
    """vLLM's CPU settings and a private cache folder, for one test module."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in VLLM_CPU_ENVIRONMENT.items():
            patch.setenv(name, value)
        patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        yield


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory, tokenizer, counter_episode):
    return taught_model_path(tmp_path_factory, tokenizer, counter_episode)


@pytest.fixture(scope="module")
def policy(policy_path):
    return load_policy(policy_path)


@pytest.fixture(scope="module")
def lora_policy(policy_path):
    """The taught tiny Llama with a LoRA adapter whose B is random: it changes the outputs."""
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(load_policy(policy_path), lora).eval()
