"""The warm start: demonstrations laid out exactly as episodes are, and the trainer running it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentgrpo.models.warm_start import environment_demonstrations, warm_start
from environments import Counter, class_tools
from rollout import ChatRenderer, TemplateDriftError, load_template
from rollout.demonstrations import demonstration_ids
from tests.support.episodes import scripted_episode, single_row, tool_call
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import train_after_warm_start


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    schemas = [tool.schema for tool in class_tools(Counter).values()]
    return ChatRenderer(tokenizer, load_template(tokenizer, "chatml_tools"), schemas)


def test_a_demonstration_is_token_for_token_the_episode_the_engine_records(tokenizer, renderer):
    turns = [tool_call("increment", step=3), "The counter is now 3."]
    episode = scripted_episode(tokenizer, turns, row={"prompt": "Reach 3.", "target": 3})
    [(ids, mask)] = demonstration_ids(renderer, episode.messages, tokenizer.eos_token)
    played = single_row(episode).prompt_ids + single_row(episode).completion_ids
    assert ids[: len(played)] == played
    assert (
        mask[: len(played)]
        == [0] * len(single_row(episode).prompt_ids) + single_row(episode).loss_mask
    )
    assert tokenizer.decode(ids[len(played) :]) == "\n" and mask[len(played) :] == [0]


def test_only_assistant_turns_are_trained(tokenizer, renderer):
    [conversation] = Counter.demonstrations(1, seed=3)
    [(ids, mask)] = demonstration_ids(renderer, conversation, tokenizer.eos_token)
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    step = conversation[1]["tool_calls"][0]["function"]["arguments"]["step"]
    call = tool_call("increment", step=step)
    assert trained == f"{call}<|im_end|>The counter is now {step}.<|im_end|>"


def test_bad_demonstrations_are_refused(tokenizer, renderer):
    with pytest.raises(ValueError, match="at least one assistant turn"):
        demonstration_ids(renderer, [{"role": "user", "content": "hi"}], tokenizer.eos_token)
    [conversation] = Counter.demonstrations(1)
    with pytest.raises(TemplateDriftError, match="does not end assistant turns"):
        demonstration_ids(renderer, conversation, "<|endoftext|>")


def test_counter_demonstrations_teach_the_format_not_the_answers():
    conversations = Counter.demonstrations(50, seed=0)
    assert conversations == Counter.demonstrations(50, seed=0)
    for user, call, result, answer in conversations:
        assert not any(ch.isdigit() for ch in user["content"].replace("at 0.", ""))
        step = call["tool_calls"][0]["function"]["arguments"]["step"]
        assert result["content"] == str(step) and str(step) in answer["content"]
    steps = {c[1]["tool_calls"][0]["function"]["arguments"]["step"] for c in conversations}
    assert steps == set(range(1, 10))


def test_warm_start_lowers_the_loss_on_the_demonstrations(tokenizer, renderer):
    model = tiny_llama(tokenizer).eval()
    conversations = Counter.demonstrations(12, seed=0)
    losses = warm_start(model, renderer, conversations, 3e-3, tokenizer.eos_token)
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]
    assert not model.training  # trained in train mode, handed back in the mode it came in


def test_an_environment_without_demonstrations_is_a_clear_error():
    class Bare:
        def reset(self) -> None: ...

    with pytest.raises(ValueError, match="Bare has none"):
        environment_demonstrations(Bare, 2, seed=0)
    with pytest.raises(ValueError, match="needs an environment class"):
        environment_demonstrations(None, 2, seed=0)


class Messages(Counter):
    @classmethod
    def demonstrations(cls, n, seed=0):  # one conversation's messages, not a list of them
        return Counter.demonstrations(1, seed=seed)[0]


class Nothing(Counter):
    @classmethod
    def demonstrations(cls, n, seed=0):
        return None


class OfInstances(Counter):
    def demonstrations(self, n, seed=0):
        return Counter.demonstrations(n, seed=seed)


class Unseeded(Counter):
    @classmethod
    def demonstrations(cls, n):
        return Counter.demonstrations(n)


class Raising(Counter):
    @classmethod
    def demonstrations(cls, n, seed=0):
        raise KeyError("level")


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        (Messages, "Messages.demonstrations(): conversation 0 is a dict, not a list of messages; "
         "return a list of conversations, each a list of messages"),
        (Nothing, "Nothing.demonstrations() returned NoneType; return a list of conversations"),
        (OfInstances, "OfInstances.demonstrations is an instance method; make it a @classmethod"),
        (Unseeded, "Unseeded.demonstrations cannot be called as demonstrations(2, seed=0)"),
        (Raising, "Raising.demonstrations(2, seed=0) raised KeyError: 'level'"),
    ],
)  # fmt: skip
def test_demonstrations_of_the_wrong_shape_or_kind_are_refused_saying_what_to_return(
    environment, expected
):
    with pytest.raises(ValueError) as caught:
        environment_demonstrations(environment, 2, seed=0)
    assert str(caught.value).startswith(expected)
    assert "\n" not in str(caught.value)  # one `error:` line on the command line


def _call(name, arguments):
    function = {"name": name, "arguments": arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{"function": function}]}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (_call("incrementt", {"step": 1}), "unknown tool 'incrementt'. Did you mean 'increment'?"),
        (_call("increment", {"step": "two"}), "argument 'step' must be an integer"),
        (_call("increment", '{"step": 1}'), "arguments must be a JSON object"),
        ({"role": "tool", "name": "increment", "content": 3}, "content is int, not str"),
    ],
)
def test_demonstrations_the_run_would_not_accept_are_refused_naming_where(message, expected):
    class Shown(Counter):
        @classmethod
        def demonstrations(cls, n, seed=0):
            [good] = Counter.demonstrations(1, seed=seed)
            return [good, [{"role": "user", "content": "Go."}, message]][:n]

    with pytest.raises(
        ValueError, match=r"Shown\.demonstrations\(\): conversation 1, message 1: "
    ) as caught:
        environment_demonstrations(Shown, 2, seed=0)
    assert expected in str(caught.value)
    assert len(environment_demonstrations(Shown, 1, seed=0)) == 1  # the good one passes


def test_trainer_warm_starts_before_grpo_and_not_on_resume(tokenizer, tmp_path, capsys):
    model = tiny_llama(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = train_after_warm_start(
        model, tokenizer, tmp_path, 3, chat_template="chatml_tools", save_warm_start=True
    )
    assert "warm start 3/3" in capsys.readouterr().out
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "warm_start")  # as GRPO began
    pairs = zip(saved.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert (tmp_path / "warm_start" / "tokenizer_config.json").exists()

    trainer._warm_start = lambda: pytest.fail("a resumed run must not warm-start again")
    with pytest.raises(Exception, match="checkpoint"):  # nothing saved: resume fails, later
        trainer.train(resume_from_checkpoint=str(tmp_path / "missing"))
