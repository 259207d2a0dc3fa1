"""Shared fixtures: the real SmolLM2 tokenizer and models built without a model hub."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from tiny_model import tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgrpo.default_model import default_model_path
from environments import Counter
from rollout import Episode, EpisodeConfig, EpisodeRow, RolloutEngine, ScriptedBackend

COUNTER_ROW = {"prompt": "Make the counter reach 7.", "target": 7}


def tool_call(name: str, **arguments) -> str:
    """A Hermes-style tool call as the model writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


COUNTER_TURNS = [tool_call("increment", step=3), tool_call("increment", step=4), "Done."]

# What the chatml_tools template adds after the model's <|im_end|> for a tool result.
TOOL_TURN = (
    "\n<|im_start|>tool\n<tool_response>{}</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def counter_segments(tokenizer) -> list[tuple[list[int], int]]:
    """The completion of the COUNTER_TURNS episode as (token ids, loss mask) segments, by hand."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    return [
        (encode(COUNTER_TURNS[0]) + eos, 1),
        (encode(TOOL_TURN.format(3)), 0),
        (encode(COUNTER_TURNS[1]) + eos, 1),
        (encode(TOOL_TURN.format(7)), 0),
        (encode(COUNTER_TURNS[2]) + eos, 1),
    ]


def eval_figures(stdout: str) -> dict[str, str]:
    """`agentgrpo eval`'s printed figures, `episodes` and `success_rate` among them, by name."""
    return dict(line.split() for line in stdout.splitlines() if len(line.split()) == 2)


def single_row(episode: Episode) -> EpisodeRow:
    """The one training row of an episode that did not fork."""
    [row] = episode.rows
    return row


def scripted_backend(tokenizer, turns: list[str], delay_s: float = 0.0) -> ScriptedBackend:
    """Answer turn k of every episode with turns[k] (k = tool responses seen so far)."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        k = tokenizer.decode(context).count("<tool_response>")
        return tokenizer.encode(turns[min(k, len(turns) - 1)], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos], delay_s=delay_s)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip the tests marked `gpu` where CUDA has no GPU (they state what else they need)."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct as a safetensors folder (converted once, then cached)."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """SmolLM2's real tokenizer (ChatML, vocab 49152)."""
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """The tiny Llama and SmolLM2's tokenizer, saved as a model folder (for subprocesses)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def scripted_episode(tokenizer, turns: list[str], row=COUNTER_ROW) -> Episode:
    """The Counter episode the engine records when the model says `turns` (k-th after k tools)."""
    engine = RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512),
    )
    [episode] = anyio.run(engine.run, [row])
    return episode


def teach(model, episodes: list[Episode], lr: float, steps: int, until_learned: bool) -> None:
    """Fit `model` to the episodes' sampled (mask-1) tokens, all in one batch per step.

    With `until_learned`, stop as soon as greedy decoding reproduces every sampled token (and
    fail if it never does); otherwise run all `steps` (demonstrations that disagree, such as
    one call shown with several arguments, teach a distribution, not a sequence). This is how
    a test gets a real model that calls tools; the engine then runs the real forward passes,
    parsing and tool calls on what the model actually generates.
    """
    rows = [row for episode in episodes for row in episode.rows]
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in rows)
    ids_B_L = torch.zeros(len(rows), width, dtype=torch.long)
    mask_B_L = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, e in enumerate(rows):  # right-padded; padding is never a target
        ids_B_L[b, : len(e.prompt_ids) + len(e.completion_ids)] = torch.tensor(
            e.prompt_ids + e.completion_ids
        )
        mask_B_L[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)] = torch.tensor(
            e.loss_mask
        ).bool()
    keep = width - min(len(e.prompt_ids) for e in rows) + 1  # logits only where targets are
    targets_mask = mask_B_L[:, -keep + 1 :]
    targets = ids_B_L[:, -keep + 1 :][targets_mask]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(ids_B_L, logits_to_keep=keep).logits[:, :-1][targets_mask]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        if until_learned and bool((logits.argmax(-1) == targets).all()) and loss.item() < 0.05:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        if until_learned:
            raise AssertionError(f"the model did not learn the episodes in {steps} steps")
    model.eval()


@pytest.fixture(scope="session")
def counter_episode(tokenizer) -> Episode:
    """A two-round Counter episode (increment 3, increment 4, 'Done.') as the engine records it."""
    return scripted_episode(tokenizer, COUNTER_TURNS)


@pytest.fixture(scope="session")
def tool_calling_tiny_model(tokenizer, counter_episode):
    """The tiny Llama, taught to play `counter_episode` (about 10-20 s on 2 cores)."""
    model = tiny_llama(tokenizer, seed=1)
    teach(model, [counter_episode], lr=1e-2, steps=400, until_learned=True)
    return model


@pytest.fixture(scope="session")
def tool_calling_smollm2(smollm2_path, counter_episode):
    """The real SmolLM2-135M-Instruct, taught the same episode (it never calls tools zero-shot)."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    teach(model, [counter_episode], lr=3e-5, steps=40, until_learned=True)
    return model
