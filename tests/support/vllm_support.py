"""What the vLLM tests share: the environment vLLM needs on CPU, and a tiny model it can run.

vLLM's CPU attention supports head sizes from 32 up, so the vLLM tests use a tiny Llama with two
heads of 32 (`tiny_llama` has four of 16). Taught the Counter episode once per session and saved
to disk, it plays the same two tool rounds as the transformers tests' tiny model.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rollout import RolloutEngine
from rollout.backends.vllm_colocate import INSTALL_HINT, VLLMColocateBackend
from tests.support.episodes import counter_engine, single_row
from tests.support.made_once import folder_made_once
from tests.support.teach import teach
from tests.support.tiny_model import tiny_llama

# One process, as a server push sees it outside a distributed launch.
SINGLE_PROCESS = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)

# "Does not hang", not a speed check: the server took about 250 s to answer at a load average
# of 6-10 on 2 cores, close to the earlier 300 s.
SERVER_START_TIMEOUT_S = 900


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, below the ephemeral range.

    A server started with it binds it seconds later. A port the kernel hands out for port 0
    (the ephemeral range) could be handed out again meanwhile, to any socket that connects or
    binds port 0 (gloo opens many); a port below that range never is.
    """
    low = _first_ephemeral_port()
    candidates = random.SystemRandom().sample(range(max(1024, low - 8192), low), 64)
    for port in candidates:  # SystemRandom: pytest's seeding gives parallel workers the same
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port among {len(candidates)} tried below {low}")


def _first_ephemeral_port() -> int:
    """The lowest port the kernel hands out for port 0 (Linux's; its default elsewhere)."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(path.read_text().split()[0]) if path.exists() else 32768


needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=INSTALL_HINT),
]

# On 2 CPU cores: use both (vLLM reserves one by default) and a small KV cache.
VLLM_CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def vllm_tiny_llama(tokenizer, seed: int) -> LlamaForCausalLM:
    """The tiny Llama with two heads of 32 (a head size vLLM's CPU attention supports)."""
    return tiny_llama(tokenizer, seed, num_attention_heads=2)


def taught_model_path(tmp_path_factory, tokenizer, counter_episode) -> Path:
    """A saved tiny Llama that plays `counter_episode` greedily (taught once per test run)."""

    def taught(folder: Path) -> None:
        model = vllm_tiny_llama(tokenizer, seed=1)
        teach(model, [counter_episode], lr=1e-2, steps=400, until_learned=True)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return folder_made_once(tmp_path_factory, "vllm-tiny-counter", taught)


def untaught_model_path(tmp_path_factory, tokenizer) -> Path:
    """A saved tiny Llama with random weights: it samples almost uniformly from 49,152 tokens.

    So no two sampled completions are the same (the chance is astronomically small), unlike the
    taught model's, which often repeat its one episode or all stop at the same length.
    """
    folder = tmp_path_factory.getbasetemp() / "vllm-tiny-untaught"
    if not (folder / "config.json").exists():
        vllm_tiny_llama(tokenizer, seed=0).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def load_policy(path: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def colocated_backend(model, processing_class, max_model_len: int) -> VLLMColocateBackend:
    """An in-process vLLM engine started from `model` as it is in memory: float32, eager, seed 0."""
    return VLLMColocateBackend.start(
        model.config,
        processing_class,
        model.state_dict().items(),
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        seed=0,
    )


def logprob_gap(model, episodes, temperature: float) -> float:
    """Mean |sampler logprob - training forward logprob| over the sampled (mask-1) tokens."""
    total, count = 0.0, 0
    for episode in episodes:
        ids = torch.tensor([single_row(episode).prompt_ids + single_row(episode).completion_ids])
        with torch.no_grad():
            logits = (
                model(ids).logits[0, len(single_row(episode).prompt_ids) - 1 : -1].float()
                / temperature
            )
        forward = torch.log_softmax(logits, -1).gather(
            -1, ids[0, len(single_row(episode).prompt_ids) :, None]
        )
        for sampled, recomputed, mask in zip(
            single_row(episode).sampler_logprobs,
            forward[:, 0].tolist(),
            single_row(episode).loss_mask,
            strict=True,
        ):
            if mask:
                total += abs(sampled - recomputed)
                count += 1
    assert count, "no sampled tokens to compare"
    return total / count


def trained_copy(model, episode, steps: int = 3) -> LlamaForCausalLM:
    """A copy of `model` after `steps` Adam steps (lr 1e-2) on `episode`'s sampled tokens."""
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    teach(other, [episode], lr=1e-2, steps=steps, until_learned=False)
    return other.eval()


def train_two_steps(
    policy_path: Path,
    tokenizer,
    output_dir: Path,
    trainer_class: Any = None,
    eval_rows: int = 0,
    peft_config: Any = None,
    **vllm_fields,
):
    """The trainer after 2 GRPO steps on the Counter row via vLLM (`vllm_fields`: the mode).

    `trainer_class`: a `GRPOTrainer` subclass to train with (default: `GRPOTrainer`).
    `eval_rows`: that many Counter rows are evaluated after every step (none by default).
    `peft_config`: the trainer trains that adapter (default: the whole model).

    With the untaught model (distinct completions) and `rank_in_call` (distinct rewards in every
    group), each step has a nonzero gradient by construction, not by luck of the draw.
    """
    from datasets import Dataset

    from agentgrpo import GRPOTrainer
    from environments import Counter
    from tests.support.episodes import COUNTER_ROW
    from tests.support.trainer import rank_in_call, short_run_config

    episodes = dict(max_completion_length=48, max_turns=2, chat_template="chatml_tools")
    if eval_rows:
        episodes |= dict(eval_strategy="steps", eval_steps=1)
    args = short_run_config(output_dir, use_vllm=True, **vllm_fields, **episodes)
    trainer = (trainer_class or GRPOTrainer)(
        load_policy(policy_path),
        rank_in_call,
        args=args,
        train_dataset=Dataset.from_list([COUNTER_ROW] * 8),
        eval_dataset=Dataset.from_list([COUNTER_ROW] * eval_rows) if eval_rows else None,
        processing_class=tokenizer,
        environment_factory=Counter,
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def play_on_final_weights(trainer):
    """The trained policy and 4 Counter episodes vLLM plays once its final weights are pushed."""
    import anyio

    from tests.support.episodes import COUNTER_ROW

    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    with trainer.generator.generating(model, trainer.state.global_step):
        return model, anyio.run(trainer.engine.run, [COUNTER_ROW], 4)


def without_multiprocessing_flag() -> dict[str, str]:
    """`os.environ` for a child vLLM server, without VLLM_ENABLE_V1_MULTIPROCESSING.

    A colocated engine earlier in this process set it to 0, which a server must not inherit.
    """
    environment = dict(os.environ)
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return environment


def vllm_counter_engine(backend, tokenizer, temperature: float) -> RolloutEngine:
    """Counter episodes of up to 5 turns and 256 tokens, sampled by a vLLM backend."""
    episode = dict(max_completion_length=256, max_turns=5, temperature=temperature)
    return counter_engine(backend, tokenizer, **episode)
