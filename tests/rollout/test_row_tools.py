"""Rows that carry their own tools: BFCL-format rows play with no environment and no agent.

Each row shows the model its own schemas; calls to tools without an implementation are checked,
recorded and answered with their arguments; the calls are scored against BFCL's ground truth.
"""

from __future__ import annotations

import json

import pytest

from agentgrpo.rewards import tool_call_match
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend
from rollout.row_tools import RowToolsError
from tests.support.episodes import scripted_backend, tool_call

pytestmark = pytest.mark.anyio

# Three rows in BFCL v3's format (`question`, `function`) with their `possible_answer` rows.
TRIANGLE = {
    "name": "calculate_triangle_area",
    "description": "Calculate the area of a triangle given its base and height.",
    "parameters": {
        "type": "dict",
        "properties": {
            "base": {"type": "integer", "description": "The base of the triangle."},
            "height": {"type": "integer", "description": "The height of the triangle."},
            "unit": {"type": "string", "description": "The unit of measure (default 'units')."},
        },
        "required": ["base", "height"],
    },
}
CIRCLE = {
    "name": "geometry.circumference",
    "description": "Calculate the circumference of a circle given the radius.",
    "parameters": {
        "type": "dict",
        "properties": {
            "radius": {"type": "float", "description": "The radius of the circle."},
            "units": {"type": "string", "description": "Units for the output. Default 'cm'."},
        },
        "required": ["radius"],
    },
}
PLAY = {
    "name": "spotify.play",
    "description": "Play specific tracks from a given artist for a specific time duration.",
    "parameters": {
        "type": "dict",
        "properties": {
            "artist": {"type": "string", "description": "The artist whose songs to play."},
            "duration": {"type": "integer", "description": "How long to play, in minutes."},
        },
        "required": ["artist", "duration"],
    },
}


def question(text: str) -> list[list[dict]]:
    """BFCL's `question`: the turns of the conversation, here one user message."""
    return [[{"role": "user", "content": text}]]


BFCL = [
    {
        "id": "simple_0",
        "question": question(
            "Find the area of a triangle with a base of 10 units and height of 5 units."
        ),
        "function": [TRIANGLE],
    },
    {
        "id": "multiple_0",
        "question": question("What is the circumference of a circle with a radius of 4 inches?"),
        "function": [TRIANGLE, CIRCLE],
    },
    {
        "id": "parallel_0",
        "question": question(
            "Play songs from Taylor Swift and Maroon 5, for 20 and 15 minutes respectively, "
            "on Spotify."
        ),
        "function": [PLAY],
    },
]
ANSWERS = {
    "simple_0": [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}],
    "multiple_0": [{"geometry.circumference": {"radius": [4], "units": ["inches", "in"]}}],
    "parallel_0": [
        {"spotify.play": {"artist": ["Taylor Swift"], "duration": [20]}},
        {"spotify.play": {"artist": ["Maroon 5"], "duration": [15]}},
    ],
}
RIGHT = {
    "simple_0": tool_call("calculate_triangle_area", base=10, height=5),
    "multiple_0": tool_call("geometry.circumference", radius=4.0, units="Inches"),
    "parallel_0": tool_call("spotify.play", artist="Maroon 5", duration=15)
    + tool_call("spotify.play", artist="taylor swift", duration=20),
}
WRONG = {
    "simple_0": tool_call("calculate_triangle_area", base=5, height=10),
    "multiple_0": tool_call("calculate_triangle_area", base=4, height=4),
    "parallel_0": tool_call("spotify.play", artist="Taylor Swift", duration=20),
}


def training_rows(max_turns: int | None = 1) -> list[dict]:
    """BFCL's rows as training rows: the first turn is the prompt, the functions the tools."""
    return [
        {
            "prompt": row["question"][0],
            "tools": row["function"],
            "ground_truth": ANSWERS[row["id"]],
            "max_turns": max_turns,
        }
        for row in BFCL
    ]


def answering(tokenizer, answers: dict[str, str]) -> ScriptedBackend:
    """A model that answers each BFCL question with `answers[id]`, then says it is done."""
    eos = tokenizer.eos_token_id
    words = {"simple_0": "triangle with", "multiple_0": "circumference of", "parallel_0": "Spotify"}

    def respond(context: list[int]) -> list[int]:
        text = tokenizer.decode(context)
        [task] = [task for task, word in words.items() if word in text]
        turn = "Done." if "<tool_response>" in text else answers[task]
        return tokenizer.encode(turn, add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def engine(tokenizer, backend, **kwargs) -> RolloutEngine:
    return RolloutEngine(
        backend,
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=4),
        **kwargs,
    )


def scores(episodes) -> list[float | None]:
    completions = [e.messages[len(e.row["prompt"]) :] for e in episodes]
    return tool_call_match(completions, ground_truth=[e.row["ground_truth"] for e in episodes])


async def test_right_calls_score_one_and_wrong_ones_zero(tokenizer):
    rows = training_rows()
    right = await engine(tokenizer, answering(tokenizer, RIGHT)).run(rows, num_generations=2)
    wrong = await engine(tokenizer, answering(tokenizer, WRONG)).run(rows, num_generations=2)
    assert scores(right) == [1.0] * 6
    assert scores(wrong) == [0.0] * 6
    assert [e.finish for e in right] == [Finish.MAX_TURNS] * 6  # max_turns 1: the calls answer
    parallel = right[4]
    assert [(c.name, json.loads(c.result)) for c in parallel.tool_calls] == [
        ("spotify.play", {"artist": "Maroon 5", "duration": 15}),
        ("spotify.play", {"artist": "taylor swift", "duration": 20}),
    ]
    assert all(c.error is None for e in right for c in e.tool_calls)


async def test_each_row_shows_the_model_its_own_tools_with_json_schema_types(tokenizer):
    rows = training_rows()
    episodes = await engine(tokenizer, answering(tokenizer, RIGHT)).run(rows)
    prompts = [tokenizer.decode(e.rows[0].prompt_ids) for e in episodes]
    assert "calculate_triangle_area" in prompts[0] and "spotify.play" not in prompts[0]
    assert "geometry.circumference" in prompts[1] and "calculate_triangle_area" in prompts[1]
    assert "spotify.play" in prompts[2] and "calculate_triangle_area" not in prompts[2]
    assert '"dict"' not in prompts[1] and '"type": "number"' in prompts[1]


async def test_without_a_turn_limit_the_model_reads_the_echo_and_answers(tokenizer):
    episodes = await engine(tokenizer, answering(tokenizer, RIGHT)).run(training_rows(None))
    assert [e.finish for e in episodes] == [Finish.STOP] * 3
    assert scores(episodes) == [1.0] * 3


async def test_a_call_that_breaks_the_rows_schema_is_a_tool_error(tokenizer):
    bad = {"simple_0": tool_call("calculate_triangle_area", base="ten", height=5)}
    [episode] = await engine(tokenizer, answering(tokenizer, bad)).run(training_rows()[:1])
    [call] = episode.tool_calls
    assert call.error == "bad_arguments" and "'base'" in call.result


def test_a_group_and_rows_with_the_same_tools_share_one_context(tokenizer):
    played = engine(tokenizer, scripted_backend(tokenizer, ["Done."]))
    simple, multiple, _ = training_rows()
    same_tools = {**simple, "tools": json.dumps(simple["tools"]), "ground_truth": None}
    assert played.context_for(simple) is played.context_for(same_tools)
    assert played.context_for(simple) is not played.context_for(multiple)
    assert played.context_for({"prompt": "hi"}) is played.context


async def test_a_row_tool_named_like_a_plain_tool_runs_the_plain_tool(tokenizer):
    def calculate_triangle_area(base: int, height: int, unit: str = "units") -> str:
        """Area of a triangle.

        Args:
            base: The base.
            height: The height.
            unit: The unit.
        """
        return f"{base * height / 2} {unit}"

    played = engine(tokenizer, answering(tokenizer, RIGHT), tools=[calculate_triangle_area])
    [episode] = await played.run(training_rows()[:1])
    assert episode.tool_calls[0].result == "25.0 units"


def test_openai_shaped_schemas_are_read_as_they_are(tokenizer):
    played = engine(tokenizer, scripted_backend(tokenizer, ["Done."]))
    schema = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    context = played.context_for({"prompt": "hi", "tools": [schema]})
    assert context.renderer.tools == [schema]
    assert set(context.tools) == {"ping"}


@pytest.mark.parametrize(
    ("tools", "problem"),
    [
        ({"name": "ping"}, "it is a dict, not a list of schemas"),
        ("[{", "its JSON does not parse"),
        ([{"description": "no name"}], "names no function"),
        ([{"name": "ping"}, {"name": "ping"}], "tools ['ping'] appear twice"),
    ],
)
def test_a_tools_value_that_is_not_a_list_of_schemas_names_the_row_and_the_fix(
    tokenizer, tools, problem
):
    played = engine(tokenizer, scripted_backend(tokenizer, ["Done."]))
    with pytest.raises(RowToolsError, match="column cannot be read") as raised:
        played.context_for({"prompt": "hi", "tools": tools, "id": "row-7"})
    assert problem in str(raised.value) and "row-7" in str(raised.value)
    assert "a list of tool schemas" in str(raised.value)


def test_a_turn_limit_that_is_not_a_positive_int_is_refused(tokenizer):
    played = engine(tokenizer, scripted_backend(tokenizer, ["Done."]))
    with pytest.raises(RowToolsError, match="'max_turns' column must be a positive int"):
        played.context_for({"prompt": "hi", "tools": [PLAY], "max_turns": 0})
