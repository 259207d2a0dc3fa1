"""Bad model output and huge tool results are data for the model, never a crashed run."""

from __future__ import annotations

import json

import anyio
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from environments import Counter
from rollout import EpisodeConfig, EpisodeRecord, Finish, RolloutEngine, record_line
from rollout.parsers import MAX_JSON_DEPTH, parse_hermes, parse_llama3_json
from rollout.record import record_from_dict
from rollout.text_encoding import EncodeCache, max_token_chars
from tests.support.episodes import COUNTER_ROW, scripted_backend, single_row

DEEP = "[" * 1000 + "]" * 1000
HUGE_INT = "9" * 5000
LONE_SURROGATE = '"\\ud800"'  # the JSON escape, as the model writes it


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: Any text.

    """
    return text


def lone_surrogate() -> str:
    """Return text holding a lone surrogate, as a tool that reads undecodable bytes might."""
    return "before \ud800 after"


def dump(size: int) -> str:
    """Return `size` characters of text.

    Args:
        size: How many characters.

    """
    return ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


def raw_call(name: str, arguments_json: str) -> str:
    """A Hermes call whose arguments are written as raw JSON text."""
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments_json}}}</tool_call>'


def play(tokenizer, turns: list[str], max_completion_length: int = 20_000, max_turns: int = 10):
    """One Counter episode, with plain tools too, where the model says `turns`."""
    engine = RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        environment_factory=Counter,
        tools=[echo, lone_surrogate, dump],
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=max_completion_length, max_turns=max_turns),
    )
    [episode] = anyio.run(engine.run, [COUNTER_ROW])
    return episode


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (f'{{"text": {DEEP}}}', f"the JSON nests deeper than {MAX_JSON_DEPTH} levels"),
        (f'{{"step": {HUGE_INT}}}', "an integer has 5000 digits, over 4300"),
        (f'{{"text": {LONE_SURROGATE}}}', "lone surrogate \\ud800"),
        ('"{\\"text\\": \\"\\\\ud800\\"}"', "lone surrogate \\ud800"),
    ],
    ids=["nested-1000-deep", "int-5000-digits", "lone-surrogate", "surrogate-in-string-args"],
)
def test_unreadable_json_is_a_parse_error_the_episode_goes_on_after(tokenizer, arguments, reason):
    episode = play(tokenizer, [raw_call("echo", arguments), "Done."])
    assert episode.finish == Finish.STOP
    assert episode.stats.tool_errors == {"parse": 1}
    [tool_message] = [m for m in episode.messages if m["role"] == "tool"]
    assert tool_message["content"].startswith("Error: could not parse tool call:")
    assert reason in tool_message["content"]
    tool_message["content"].encode("utf-8")  # valid Unicode: it was tokenized and can be saved


def test_both_written_parsers_refuse_json_nested_too_deep_for_python():
    turn = parse_hermes(raw_call("echo", DEEP))
    assert turn.tool_calls == []
    assert "nests deeper than" in turn.errors[0]
    turn = parse_llama3_json(f'{{"name": "echo", "parameters": {DEEP}}}\n{{"name": "add"}}')
    assert [call.name for call in turn.tool_calls] == ["add"]
    assert "nests deeper than" in turn.errors[0]


def test_json_nested_just_within_the_limit_is_read():
    nested = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    turn = parse_hermes(raw_call("echo", f'{{"text": {nested}}}'))
    assert turn.errors == []
    assert len(turn.tool_calls) == 1


def test_a_huge_integer_in_llama3_json_is_an_error_and_the_next_call_is_kept():
    turn = parse_llama3_json(f'{{"name": "f", "parameters": {{"n": {HUGE_INT}}}}};{{"name": "g"}}')
    assert [call.name for call in turn.tool_calls] == ["g"]
    assert turn.errors == [
        "Error: could not parse tool call: an integer has 5000 digits, over 4300. Write the "
        'whole turn as {"name": "<tool name>", "parameters": {<JSON object>}}; separate several '
        'calls with ";" or a newline.'
    ]


def test_a_paired_surrogate_escape_is_the_character_it_encodes():
    turn = parse_hermes(raw_call("echo", '{"text": "\\ud83d\\ude00"}'))
    assert turn.tool_calls[0].arguments == {"text": "\N{GRINNING FACE}"}


def test_a_tool_result_holding_a_lone_surrogate_reaches_the_model_as_a_replacement_character(
    tokenizer,
):
    episode = play(tokenizer, [raw_call("lone_surrogate", "{}"), "Done."])
    assert episode.finish == Finish.STOP
    [tool_message] = [m for m in episode.messages if m["role"] == "tool"]
    assert tool_message["content"] == "before \N{REPLACEMENT CHARACTER} after"
    assert "\N{REPLACEMENT CHARACTER}" in tokenizer.decode(single_row(episode).completion_ids)


def test_a_ten_megabyte_tool_result_is_cut_before_tokenizing_and_the_episode_ends_with_length(
    tokenizer,
):
    budget_tokens = 256
    episode = play(tokenizer, [raw_call("dump", '{"size": 10000000}'), "Done."], budget_tokens)
    assert episode.finish == Finish.LENGTH
    [tool_message] = [m for m in episode.messages if m["role"] == "tool"]
    assert len(tool_message["content"]) <= budget_tokens * max_token_chars(tokenizer)
    assert tool_message["content"] == dump(len(tool_message["content"]))
    assert all(
        mask == 1 for mask in single_row(episode).loss_mask
    )  # nothing of the result was appended


@pytest.mark.parametrize("max_turns", [10, 1])  # the result shown next turn / the last turn's
def test_a_cut_tool_result_is_recorded_as_cut_with_its_whole_length(tokenizer, max_turns):
    budget_tokens = 256
    turns = [raw_call("dump", '{"size": 10000000}'), "Done."]
    episode = play(tokenizer, turns, budget_tokens, max_turns)
    [tool_message] = [m for m in episode.messages if m["role"] == "tool"]
    [call] = episode.tool_calls
    assert len(tool_message["content"]) <= budget_tokens * max_token_chars(tokenizer)
    assert call.result == tool_message["content"] == dump(len(call.result))
    assert call.result_chars == 10_000_000
    line = record_line(EpisodeRecord(episode, {}, 0.0, 0.0, 0))
    assert len(line) < 3 * budget_tokens * max_token_chars(tokenizer)  # not 10 MB twice
    [read] = record_from_dict(json.loads(line)).episode.tool_calls
    assert read == call


@pytest.mark.parametrize("size", [100, 400, 900])
def test_a_tool_result_that_fits_is_kept_whole_and_appended(tokenizer, size):
    episode = play(tokenizer, [raw_call("dump", json.dumps({"size": size})), "Done."], 2048)
    assert episode.finish == Finish.STOP
    [tool_message] = [m for m in episode.messages if m["role"] == "tool"]
    assert tool_message["content"] == dump(size)
    assert [(c.result, c.result_chars) for c in episode.tool_calls] == [(dump(size), None)]


def test_cutting_a_tool_result_decides_exactly_as_tokenizing_it_whole(tokenizer):
    """Right at the bound, with the text that packs the most characters into each token."""
    longest = max(tokenizer.get_vocab(), key=len)
    worst = tokenizer.convert_tokens_to_string([longest])
    bound = max_token_chars(tokenizer)
    assert bound == len(longest)
    for budget_tokens in (1, 7, 64):
        text = (worst * (budget_tokens + 1))[: budget_tokens * bound]
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= budget_tokens


def tokenizer_with(normalizer=None, pre_tokenizer=None, byte_fallback=True):
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    backend = Tokenizer(
        models.BPE(vocab, [("a", "b")], unk_token="<unk>", byte_fallback=byte_fallback)
    )
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_character_bound_is_the_longest_token_string_times_four_where_text_composes():
    assert max_token_chars(tokenizer_with()) == len("<unk>")
    assert max_token_chars(tokenizer_with(normalizers.NFC())) == 4 * len("<unk>")
    replace = normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "_")])
    assert max_token_chars(tokenizer_with(replace)) == len("<unk>")


@pytest.mark.parametrize(
    "tokenizer_without_a_bound",
    [
        tokenizer_with(normalizers.Strip()),
        tokenizer_with(normalizers.BertNormalizer()),
        tokenizer_with(normalizers.Replace("  ", " ")),
        tokenizer_with(pre_tokenizer=pre_tokenizers.Whitespace()),
        tokenizer_with(byte_fallback=False),
    ],
    ids=["strip", "bert", "collapse-spaces", "whitespace-split", "unk-swallows-text"],
)
def test_a_tokenizer_that_may_drop_characters_has_no_bound_so_nothing_is_cut(
    tokenizer_without_a_bound,
):
    assert max_token_chars(tokenizer_without_a_bound) is None


def test_the_encode_cache_is_bounded_by_total_size_and_drops_the_least_recently_used():
    cache = EncodeCache(lambda text: tuple(map(ord, text)), max_size=2000)
    texts = [f"{i:03d}" * 20 for i in range(50)]  # each 60 characters + 60 ids = 120
    for text in texts:
        assert cache(text) == tuple(map(ord, text))
        assert cache.size <= 2000
    assert cache.size == 16 * 120
    assert [text in cache for text in texts] == [False] * 34 + [True] * 16
    cache(texts[34])  # now the most recently used: it stays when the next one comes in
    cache("new" * 20)
    assert texts[34] in cache
    assert texts[35] not in cache


def test_a_text_too_big_for_the_cache_is_encoded_but_not_kept():
    cache = EncodeCache(lambda text: tuple(map(ord, text)), max_size=2000)
    cache("x" * 60)
    assert cache("y" * 1000) == (ord("y"),) * 1000
    assert "y" * 1000 not in cache
    assert "x" * 60 in cache


def test_a_text_encoded_twice_at_once_is_kept_once():
    # Agent sessions encode in worker threads: a second encoding of a text can start before the
    # first is kept. Here the encoder itself asks the cache again, which interleaves the same way.
    def encode(text: str) -> tuple[int, ...]:
        if not nested:
            nested.append(text)
            cache(text)
        return tuple(map(ord, text))

    nested: list[str] = []
    cache = EncodeCache(encode, max_size=2000)
    assert cache("ab" * 10) == tuple(map(ord, "ab" * 10))
    assert cache.size == 40  # 20 characters and 20 ids, counted once
