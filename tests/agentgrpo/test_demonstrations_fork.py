"""Warm-start demonstrations fork where episodes fork, so they train turns in the model's context.

Qwen3's template (read from the installed trl package; the test skips without it) drops a past
turn's empty `<think>` block once a tool result follows; with thinking off every turn after a
tool turn therefore starts a new row, in a demonstration as in an episode.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from agentgrpo.models.warm_start import warm_start
from environments import Counter, class_tools
from rollout import ChatRenderer, EpisodeRow, TemplateDriftError
from rollout.demonstrations import DemonstrationRow, demonstration_ids
from tests.support.episodes import scripted_backend
from tests.support.parsing import qwen3_engine, trl_template
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import train_after_warm_start

THINKING_OFF = {"enable_thinking": False}
ROW = {"prompt": "Make the counter reach 3.", "target": 3}


def call(step: int) -> dict:
    return {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}


def call_text(step: int) -> str:
    """The call as Qwen3's template writes it, which is what the model learns to write."""
    return f'<tool_call>\n{{"name": "increment", "arguments": {{"step": {step}}}}}\n</tool_call>'


# Two calls (1, then 2: the counter reaches 3) and an answer: three assistant turns.
DEMONSTRATION = [
    {"role": "user", "content": "Make the counter reach 3.\nThe counter is at 0."},
    {"role": "assistant", "content": "", "tool_calls": [call(1)]},
    {"role": "tool", "name": "increment", "content": "1"},
    {"role": "assistant", "content": "", "tool_calls": [call(2)]},
    {"role": "tool", "name": "increment", "content": "3"},
    {"role": "assistant", "content": "The counter is now 3."},
]
TURNS = [call_text(1), call_text(2), "The counter is now 3."]


def qwen3_renderer(tokenizer) -> ChatRenderer:
    schemas = [tool.schema for tool in class_tools(Counter).values()]
    return ChatRenderer(tokenizer, trl_template("qwen3"), schemas, THINKING_OFF)


def as_played(row: EpisodeRow) -> DemonstrationRow:
    """An episode's row as a demonstration lays it out: the prompt (mask 0), then the rest."""
    return DemonstrationRow(
        row.prompt_ids + row.completion_ids, [0] * len(row.prompt_ids) + row.loss_mask
    )


def test_with_thinking_off_a_demonstration_is_the_episodes_rows_token_for_token(tokenizer):
    engine = qwen3_engine(
        tokenizer,
        scripted_backend(tokenizer, TURNS),
        trl_template("qwen3"),
        chat_template_kwargs=THINKING_OFF,
    )
    [episode] = anyio.run(engine.run, [ROW])
    assert episode.messages == DEMONSTRATION  # the episode played the demonstration's turns
    rows = demonstration_ids(qwen3_renderer(tokenizer), DEMONSTRATION, "<|im_end|>")
    assert len(rows) == len(episode.rows) == 3  # one row per assistant turn
    played = [as_played(row) for row in episode.rows]
    assert rows[:2] == played[:2]
    # The last row goes on with what the template writes after the last turn, untrained.
    last, last_played = rows[2], played[2]
    assert last.ids[: len(last_played.ids)] == last_played.ids
    assert last.mask[: len(last_played.mask)] == last_played.mask
    assert tokenizer.decode(last.ids[len(last_played.ids) :]) == "\n"
    assert last.mask[len(last_played.mask) :] == [0]


def test_each_forked_row_trains_one_turn_after_the_templates_fresh_prompt(tokenizer):
    renderer = qwen3_renderer(tokenizer)
    rows = demonstration_ids(renderer, DEMONSTRATION, "<|im_end|>")
    for row, turn, end in zip(rows, TURNS, (1, 3, 5), strict=True):
        prompt = renderer.render(DEMONSTRATION[:end], generation_prompt=True)
        trained = [i for i, m in zip(row.ids, row.mask, strict=True) if m]
        assert tokenizer.decode(row.ids[: row.mask.index(1)]) == prompt
        assert tokenizer.decode(trained) == turn + "<|im_end|>"


def test_a_turn_that_does_not_start_with_the_generation_prompt_is_a_clear_error(tokenizer):
    template = (  # the generation prompt opens a think block that assistant turns never show
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    renderer = ChatRenderer(tokenizer, template)
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    with pytest.raises(TemplateDriftError, match="does not start with the generation prompt"):
        demonstration_ids(renderer, messages, "<|im_end|>")


def test_a_forked_warm_start_step_weighs_every_trained_token_the_same(tokenizer):
    renderer = qwen3_renderer(tokenizer)
    model = tiny_llama(tokenizer).eval()
    rows = demonstration_ids(renderer, DEMONSTRATION, "<|im_end|>")
    row_losses = []  # the trained tokens' losses, row by row
    with torch.no_grad():
        for row in rows:
            logits_T_V = model(input_ids=torch.tensor([row.ids])).logits[0, :-1]
            losses_T = torch.nn.functional.cross_entropy(
                logits_T_V, torch.tensor(row.ids[1:]), reduction="none"
            )
            row_losses.append(losses_T[torch.tensor(row.mask[1:]) == 1].tolist())
    token_mean = sum(map(sum, row_losses)) / sum(map(len, row_losses))
    mean_of_rows = sum(sum(r) / len(r) for r in row_losses) / len(row_losses)
    assert [len(r) for r in row_losses] == [29, 29, 8]  # so the two means differ
    [loss] = warm_start(model, renderer, [DEMONSTRATION], 1e-12, "<|im_end|>")
    assert loss == pytest.approx(token_mean, rel=1e-5)
    assert loss != pytest.approx(mean_of_rows, rel=1e-5)


def test_trainer_warm_starts_through_qwen3s_forking_template(tokenizer, tmp_path, capsys):
    [demo] = Counter.demonstrations(1, seed=0)
    assert len(demonstration_ids(qwen3_renderer(tokenizer), demo, "<|im_end|>")) == 2
    model = tiny_llama(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    template = dict(chat_template=trl_template("qwen3"), chat_template_kwargs=THINKING_OFF)
    train_after_warm_start(model, tokenizer, tmp_path, 2, **template, tool_call_parser="hermes")
    assert "warm start 2/2" in capsys.readouterr().out
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
