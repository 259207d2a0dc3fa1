"""Long episodes: context policies compact a full context into a new token-exact row, and an
environment with ``respond`` answers turns without tool calls in words.

The model is scripted (`ScriptedBackend`) so each test knows every turn; the same paths run
against the real model in tests/end_to_end/test_long_horizon.py.
"""

from __future__ import annotations

import anyio
import pytest

from environments import EnvironmentRespondError, EnvironmentSpecError, check_environment
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend
from rollout.compaction import (
    SUMMARY_HEADER,
    SUMMARY_INSTRUCTION,
    TRUNCATED_MARKER,
    ContextPolicyError,
    context_policy_of,
)
from tests.support.episodes import tool_call

pytestmark = pytest.mark.anyio

ROW = {"prompt": "Read the ledger page by page, then say done."}
PAGE = "entry " * 100  # about 100 tokens of tool result
CALL = tool_call("read")
WINDOW = 700


class Ledger:
    """Every `read` returns a long page; the model reads until the script says done."""

    def reset(self, **row):
        self.pages = 0

    def read(self) -> str:
        """Read the next page.

        Returns:
            The page.
        """
        self.pages += 1
        return f"page {self.pages}: {PAGE}"


class Questions:
    """Twenty questions in miniature: yes or no to each question, the game ends on 'cat'."""

    def reset(self, **row):
        self.asked: list[str] = []

    def respond(self, message: str) -> str | None:
        self.asked.append(message)
        return None if "cat" in message else f"No ({len(self.asked)})."


def script(tokenizer, answer):
    """A backend answering with `answer(context_text)`, then the end-of-turn token."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        text = answer(tokenizer.decode(context))
        return tokenizer.encode(text, add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def reader(reads: int):
    """The model: `read` until its context shows `reads` pages read, then 'Done.'

    Pages read are its calls in the context plus what its latest summary says; asked for a
    summary, it writes how many pages it has read.
    """

    def answer(text: str) -> str:
        summaries = text.split("I read ")[1:]
        pages = text.count(CALL) + sum(int(part.split(" pages")[0]) for part in summaries)
        if SUMMARY_INSTRUCTION in text.rsplit("<|im_start|>user", 1)[-1]:
            return f"I read {pages} pages."
        return "Done." if pages >= reads else CALL

    return answer


def engine(tokenizer, backend, env=Ledger, **fields) -> RolloutEngine:
    config = EpisodeConfig(**{"max_completion_length": 4096, "max_turns": 20, **fields})
    return RolloutEngine(
        backend, tokenizer, environment_factory=env, chat_template="chatml_tools", config=config
    )


def play(engine: RolloutEngine):
    [episode] = anyio.run(lambda: engine.run([ROW]))
    return episode


def assert_token_exact(episode, backend: ScriptedBackend) -> None:
    """Every request was some row's context, and what it sampled follows there with mask 1."""
    for context, _ in backend.requests:
        row = next(
            r
            for r in episode.rows
            if (r.prompt_ids + r.completion_ids)[: len(context)] == context
            and len(context) >= len(r.prompt_ids)
        )
        start = len(context) - len(row.prompt_ids)
        answer = backend.respond(context)[: len(row.completion_ids) - start]
        assert row.completion_ids[start : start + len(answer)] == answer
        assert set(row.loss_mask[start : start + len(answer)]) == {1}


def test_without_a_policy_a_full_window_ends_the_episode(tokenizer):
    episode = play(engine(tokenizer, script(tokenizer, reader(8)), max_context=WINDOW))
    assert episode.finish is Finish.LENGTH
    assert episode.stats.compactions == ()
    # A tool result that leaves no room for the next turn is not added: no row passes the window.
    narrow = play(engine(tokenizer, script(tokenizer, reader(8)), max_context=600))
    [row] = narrow.rows
    assert narrow.finish is Finish.LENGTH and len(row.prompt_ids) + len(row.completion_ids) <= 600


def test_truncate_replaces_old_results_and_goes_on_in_a_new_exact_row(tokenizer):
    backend = script(tokenizer, reader(8))
    policy = context_policy_of("truncate", threshold=0.6, keep_last=1)
    episode = play(engine(tokenizer, backend, max_context=WINDOW, context=policy))

    assert episode.finish is Finish.STOP
    compactions = episode.stats.compactions
    assert compactions and len(episode.rows) == len(compactions) + 1
    assert all(c.tokens_after < c.tokens_before and c.policy == "truncate" for c in compactions)
    assert all(len(r.prompt_ids) + len(r.completion_ids) <= WINDOW for r in episode.rows)
    assert_token_exact(episode, backend)
    last_prompt = tokenizer.decode(episode.rows[-1].prompt_ids)
    assert TRUNCATED_MARKER in last_prompt
    # The record keeps every result whole; the model saw the marker.
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert len(results) == episode.stats.tool_calls and TRUNCATED_MARKER not in results
    assert len(episode.tool_calls) == len(results)


def test_summarize_trains_the_summary_and_restarts_from_the_task_and_it(tokenizer):
    backend = script(tokenizer, reader(8))
    policy = context_policy_of("summarize", threshold=0.6, summary_tokens=32)
    episode = play(engine(tokenizer, backend, max_context=WINDOW, context=policy))

    assert episode.finish is Finish.STOP
    assert {c.policy for c in episode.stats.compactions} == {"summarize"}
    assert_token_exact(episode, backend)
    asked = [
        i
        for i, r in enumerate(episode.rows)
        if tokenizer.decode(r.prompt_ids).endswith(
            f"{SUMMARY_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )
    ]
    assert asked
    summary_row = episode.rows[asked[0]]
    summary = tokenizer.decode(summary_row.completion_ids)
    assert summary.startswith("I read ") and set(summary_row.loss_mask) == {1}
    after = tokenizer.decode(episode.rows[asked[0] + 1].prompt_ids)
    assert ROW["prompt"] in after and SUMMARY_HEADER in after and "page 1:" not in after
    assert CALL not in after
    roles = [m["role"] for m in episode.messages]
    assert roles.count("user") == 1 + len(asked)  # the task, then each summary request


def test_a_policy_function_writes_the_new_context(tokenizer):
    seen = []

    def keep_task_and_last(messages, tok):
        seen.append((len(messages), tok is tokenizer))
        old = [{**m, "content": "(read)"} if m["role"] == "tool" else m for m in messages[:-1]]
        return [*old, messages[-1]]

    backend = script(tokenizer, reader(8))
    policy = context_policy_of(keep_task_and_last, threshold=0.6)
    episode = play(engine(tokenizer, backend, max_context=WINDOW, context=policy))
    assert episode.finish is Finish.STOP and seen and all(same for _, same in seen)
    assert {c.policy for c in episode.stats.compactions} == {"function"}
    assert_token_exact(episode, backend)


def test_a_policy_function_that_returns_no_conversation_is_a_loud_error(tokenizer):
    policy = context_policy_of(lambda messages, tok: "short", threshold=0.6)
    with pytest.raises(ContextPolicyError, match="list of message dicts"):
        play(engine(tokenizer, script(tokenizer, reader(8)), max_context=WINDOW, context=policy))


def test_bad_settings_name_the_option():
    with pytest.raises(ContextPolicyError, match=r"context_threshold=1\.2"):
        context_policy_of("truncate", threshold=1.2)
    with pytest.raises(ContextPolicyError, match="context_policy='squash'"):
        context_policy_of("squash")


def test_a_summary_that_cannot_fit_the_window_is_refused_at_start(tokenizer):
    policy = context_policy_of("summarize", threshold=0.9, summary_tokens=128)
    with pytest.raises(ContextPolicyError, match="context_summary_tokens=128"):
        engine(tokenizer, script(tokenizer, reader(1)), max_context=WINDOW, context=policy)


def test_an_environment_names_its_own_policy(tokenizer):
    class Declared(Ledger):
        context_policy = "truncate"

    built = engine(tokenizer, script(tokenizer, reader(8)), env=Declared, max_context=WINDOW)
    assert built.context.context_policy.kind == "truncate"
    assert play(built).stats.compactions


def test_respond_turns_a_reply_into_the_next_user_turn(tokenizer):
    guesses = ["Is it a dog?", "Is it a fish?", "It is a cat."]
    backend = script(tokenizer, lambda text: guesses[text.count("No (")])
    episode = play(engine(tokenizer, backend, env=Questions))

    assert episode.finish is Finish.STOP and episode.stats.responses == 2
    assert [m["content"] for m in episode.messages if m["role"] == "user"][1:] == [
        "No (1).",
        "No (2).",
    ]
    [row] = episode.rows
    text = tokenizer.decode(row.completion_ids)
    assert "<|im_start|>user\nNo (1).<|im_end|>" in text
    replies = [i for i, m in enumerate(row.loss_mask) if m == 0]
    assert "No (1)." in tokenizer.decode([row.completion_ids[i] for i in replies])
    assert_token_exact(episode, backend)
    assert episode.environment.asked[-1] == "It is a cat."


def test_a_respond_that_fails_stops_the_run_naming_it(tokenizer):
    class Broken(Questions):
        def respond(self, message):
            return 3

    backend = script(tokenizer, lambda text: "Is it a dog?")
    with pytest.raises(EnvironmentRespondError, match=r"Broken.respond\(\) returned int"):
        play(engine(tokenizer, backend, env=Broken))


def test_an_async_respond_is_refused_by_the_check():
    class Async(Questions):
        async def respond(self, message):
            return None

    with pytest.raises(EnvironmentSpecError, match="respond"):
        check_environment(Async)
