"""Long episodes on a real model: a summary compaction and an environment that answers in words.

A tiny Llama is taught one scripted game of `Questions` played under the ``"summarize"`` policy
in a window too small for the whole game: its questions, a summary when asked, and the guess.
Played by the engine on the real forward passes, the game must come out the same, token for
token: the replies appended with mask 0, the summary sampled (mask 1) in a row of its own, the
compacted context's row, and every sampler logprob equal to the model's own.
"""

from __future__ import annotations

import re

import anyio
import pytest
import torch

from environments import Questions
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend, TransformersBackend
from rollout.compaction import SUMMARY_HEADER, SUMMARY_INSTRUCTION, context_policy_of
from tests.support.teach import teach
from tests.support.tiny_model import tiny_llama

pytestmark = pytest.mark.slow

QUESTIONS = ["Can it fly?", "Is it a pet?", "Is it a parrot?"]
ROW = {**Questions.dataset("train")[0], "animal": "parrot"}
CONFIG = EpisodeConfig(  # the two answers fill the window past half: one summary, then the guess
    max_completion_length=512,
    max_turns=8,
    max_context=260,
    temperature=0.0,
    context=context_policy_of("summarize", threshold=0.5, summary_tokens=16),
)


def player(text: str) -> str:
    """The scripted game: the next question by how many were answered, or the summary."""
    summaries = re.findall(r"Asked (\d+)\.", text)
    answered = text.count("Yes.<") + text.count("No.<") + sum(map(int, summaries[-1:]))
    if SUMMARY_INSTRUCTION in text.rsplit("<|im_start|>user", 1)[-1]:
        return f"Asked {answered}."
    return QUESTIONS[answered]


def play(backend, tokenizer):
    engine = RolloutEngine(
        backend, tokenizer, environment_factory=Questions, chat_template="chatml_tools",
        config=CONFIG,
    )  # fmt: skip
    [episode] = anyio.run(engine.run, [ROW])
    return episode


def test_a_real_model_replays_a_summarized_dialogue_token_for_token(tokenizer):
    eos = tokenizer.eos_token_id
    scripted = ScriptedBackend(
        lambda c: tokenizer.encode(player(tokenizer.decode(c)), add_special_tokens=False) + [eos],
        [eos],
    )
    lesson = play(scripted, tokenizer)
    assert lesson.finish is Finish.STOP and lesson.environment.solved
    assert [c.policy for c in lesson.stats.compactions] == ["summarize"]
    assert lesson.stats.responses == 2 and len(lesson.rows) == 3

    model = tiny_llama(tokenizer, seed=2)
    teach(model, [lesson], lr=1e-2, steps=300, until_learned=True)
    episode = play(TransformersBackend.from_tokenizer(model, tokenizer), tokenizer)

    assert [(r.prompt_ids, r.completion_ids, r.loss_mask) for r in episode.rows] == [
        (r.prompt_ids, r.completion_ids, r.loss_mask) for r in lesson.rows
    ]
    assert episode.messages == lesson.messages and episode.environment.solved
    summary_row = lesson.stats.compactions[0].row - 1
    assert tokenizer.decode(episode.rows[summary_row].completion_ids).startswith("Asked 2.")
    assert SUMMARY_HEADER in tokenizer.decode(episode.rows[summary_row + 1].prompt_ids)
    for row in episode.rows:  # the sampler's logprobs are the model's own, row by row
        ids = torch.tensor([row.prompt_ids + row.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row.prompt_ids) - 1 : -1]
        forward = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(row.completion_ids)[:, None]
        )[:, 0]
        sampled = torch.tensor(row.loss_mask).bool()
        assert torch.allclose(
            torch.tensor(row.sampler_logprobs)[sampled], forward[sampled], atol=1e-4
        )
