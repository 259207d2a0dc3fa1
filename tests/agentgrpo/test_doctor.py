"""`agentgrpo doctor`: each check on the shipped template and on templates broken on purpose."""

from __future__ import annotations

import subprocess
import threading

import pytest

from agentgrpo.cli import main
from agentgrpo.doctor import (
    Setup,
    SetupCheckError,
    Status,
    check_environment_runs,
    check_generation,
    check_history,
    check_parser,
    check_stop_tokens,
    check_template,
    fast_checks,
    startup_checks,
)
from agentgrpo.doctor.checks import parser_label
from environments import Counter, class_tools
from rollout import (
    PARSERS,
    ParsedTurn,
    RolloutEngine,
    ScriptedBackend,
    ToolCall,
    load_template,
)
from rollout.parsers import get_parser, parse_hermes
from tests.support.cli import agentgrpo_here
from tests.support.episodes import counter_engine, scripted_backend, tool_call
from tests.support.parsing import trl_template
from tests.support.tiny_model import tiny_llama

# ChatML with Hermes calls, as rollout/templates/chatml_tools.jinja, cut down; each bad template
# below changes one thing in it.
CHATML = """\
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ CONTENT }}
{%- for call in message.tool_calls or [] %}CALL{% endfor %}END
{% elif message.role == 'tool' %}<|im_start|>tool
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_CALL = (
    '<tool_call>{"name": {{ call.function.name | tojson }}, '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>'
)


def chatml(
    content: str = "message.content",
    call: str = HERMES_CALL,
    end: str = "<|im_end|>",
) -> str:
    """The CHATML template with the assistant's content, call and end-of-turn token replaced."""
    text = CHATML.replace("{{ CONTENT }}", "{{ " + content + " }}")
    return text.replace("CALL", call).replace("END", end)


DROPS_PAST_REASONING = chatml(
    content="message.content if loop.last else message.content.split('</think>')[-1].lstrip()"
)
UNREADABLE_CALLS = chatml(
    call="<tool_call>{{ call.function.name }}({{ call.function.arguments | tojson }})</tool_call>"
)
WRONG_END_OF_TURN = chatml(end="<|endoftext|>")
IGNORES_TOOLS = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def setup(tokenizer, template: str = "chatml_tools", **fields) -> Setup:
    """The checks' input: SmolLM2's tokenizer, `template`, and its eos as the stop token."""
    fields.setdefault("stop_token_ids", frozenset({tokenizer.eos_token_id}))
    return Setup(tokenizer, load_template(tokenizer, template), **fields)


# ---------------------------------------------------------------------- the shipped template


def test_the_shipped_template_passes_every_fast_check(tokenizer):
    results = fast_checks(setup(tokenizer))
    assert [(r.name, r.status) for r in results] == [
        ("template", Status.OK),
        ("parser", Status.OK),
        ("history", Status.OK),
        ("stop", Status.OK),
    ]
    assert all(r.fix == "" for r in results)
    parser = results[1].message
    assert "parser hermes reads back lookup(word='agent', limit=2)" in parser
    assert "<tool_call> (5 tokens)" in parser  # not a special token of SmolLM2
    assert "'<|im_end|>' (id 2)" in results[3].message


def test_the_probe_calls_the_runs_own_tool_with_arguments_of_its_types(tokenizer):
    schemas = tuple(t.schema for t in class_tools(Counter).values())
    result = check_parser(setup(tokenizer, tools=schemas))
    assert "reads back increment(step=2)" in result.message


# ---------------------------------------------------------------------- broken templates


def test_a_template_that_ignores_tools_fails_and_the_other_checks_are_not_run(tokenizer):
    [result] = fast_checks(setup(tokenizer, IGNORES_TOOLS))
    assert (result.name, result.status) == ("template", Status.FAIL)
    assert "drops the tool schemas" in result.message and "tool calls" in result.message
    assert "chatml_tools" in result.fix


def test_a_template_that_does_not_compile_fails_the_template_check(tokenizer):
    result = check_template(setup(tokenizer, "{% for m in messages %}{{ m.content }}"))
    assert result.status is Status.FAIL and "cannot render" in result.message


def test_a_call_the_parser_cannot_read_fails_the_round_trip(tokenizer):
    result = check_parser(setup(tokenizer, UNREADABLE_CALLS, tool_call_parser="hermes"))
    assert (result.name, result.status) == ("parser", Status.FAIL)
    assert "parser hermes cannot read the call the template writes" in result.message
    assert "<tool_call>lookup(" in result.message
    assert "--tool-call-parser" in result.fix


def test_a_template_whose_format_cannot_be_told_fails_with_the_parsers_to_choose_from(tokenizer):
    result = check_parser(setup(tokenizer, UNREADABLE_CALLS.replace("tool_call", "call")))
    assert result.status is Status.FAIL
    assert all(name in result.fix for name in PARSERS)


def test_a_parser_registered_later_is_picked_up_by_name(tokenizer, monkeypatch):
    def read_lookup(text: str) -> ParsedTurn:
        return ParsedTurn("", [ToolCall("lookup", {"word": "agent", "limit": 2})])

    monkeypatch.setitem(PARSERS, "lookup_only", read_lookup)
    result = check_parser(setup(tokenizer, UNREADABLE_CALLS, tool_call_parser="lookup_only"))
    assert result.status is Status.OK and result.message.startswith("parser lookup_only reads")


def test_a_parser_typed_against_the_tool_schemas_is_named_by_its_registered_name():
    typed = get_parser("qwen3_xml", tools=[class_tools(Counter)["increment"].schema])
    assert parser_label(typed) == "parser qwen3_xml"


def test_a_parser_that_reads_arguments_as_text_is_a_warning(tokenizer):
    def as_text(text: str) -> ParsedTurn:
        [call] = parse_hermes(text).tool_calls
        return ParsedTurn("", [ToolCall(call.name, {k: str(v) for k, v in call.arguments.items()})])

    result = check_parser(setup(tokenizer, parser=as_text))
    assert result.status is Status.WARNING and "limit='2'" in result.message


def test_a_template_that_drops_past_reasoning_warns_that_the_run_forks_at_turn_1(tokenizer):
    result = check_history(setup(tokenizer, DROPS_PAST_REASONING))
    assert (result.name, result.status) == ("history", Status.WARNING)
    assert "rewrites assistant turn 1 once a tool result follows it" in result.message
    assert "drops '<think>\\nFirst I look the word up.\\n</think>" in result.message
    assert "fork" in result.message


def test_an_end_of_turn_token_that_is_not_a_stop_token_fails(tokenizer):
    result = check_stop_tokens(setup(tokenizer, WRONG_END_OF_TURN))
    assert (result.name, result.status) == ("stop", Status.FAIL)
    assert "ends an assistant tool-call turn with '<|endoftext|>' (id 0)" in result.message
    assert "not a stop token of generation ('<|im_end|>' (id 2))" in result.message


def test_the_same_template_passes_when_generation_also_stops_on_its_token(tokenizer):
    stops = frozenset({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")})
    result = check_stop_tokens(setup(tokenizer, WRONG_END_OF_TURN, stop_token_ids=stops))
    assert result.status is Status.OK and "'<|endoftext|>' (id 0)" in result.message


# ---------------------------------------------------------------------- real templates


def test_qwen3_forks_where_it_drops_an_empty_think_block(tokenizer):
    """Qwen3 keeps reasoning written after the last user message, but renders an assistant
    turn without reasoning with an empty think block while it is the last message, and
    without one once a tool result follows: the probe's second turn, which has no reasoning."""
    result = check_history(setup(tokenizer, trl_template("qwen3")))
    assert result.status is Status.WARNING
    assert "rewrites assistant turn 2 once a tool result follows it" in result.message
    assert "drops '<think>\\n\\n</think>\\n\\n'" in result.message


def test_qwen3s_training_template_extends_every_turn(tokenizer):
    result = check_history(setup(tokenizer, trl_template("qwen3_training")))
    assert result.status is Status.OK and "no forks" in result.message


# ---------------------------------------------------------------------- the environment


def test_counter_meets_the_contract_resets_and_renders(tokenizer):
    result = check_environment_runs(Counter, Counter.dataset, setup(tokenizer))
    assert result.status is Status.OK and "tools (increment) render" in result.message


def test_an_environment_whose_reset_raises_fails_naming_it(tokenizer):
    class Broken(Counter):
        def reset(self, target: int) -> str:
            raise KeyError("no such level")

    result = check_environment_runs(Broken, Counter.dataset, setup(tokenizer))
    assert result.status is Status.FAIL and "Broken" in result.message
    assert "reset" in result.message


def test_an_environment_with_an_undocumented_tool_fails_the_contract(tokenizer):
    class Undocumented(Counter):
        def jump(self, to: int) -> int:
            return to

    result = check_environment_runs(Undocumented, Counter.dataset, setup(tokenizer))
    assert result.status is Status.FAIL and "jump" in result.message


def test_an_environment_without_rows_is_a_warning(tokenizer):
    result = check_environment_runs(Counter, None, setup(tokenizer))
    assert result.status is Status.WARNING and "dataset()" in result.message


def test_an_environment_whose_rows_are_empty_fails_saying_so(tokenizer):
    result = check_environment_runs(Counter, lambda: [], setup(tokenizer))
    assert result.status is Status.FAIL
    assert result.message == "Counter: its task rows are empty, so reset was not tried"
    assert "at least one row" in result.fix


def test_an_environment_whose_reset_hangs_fails_naming_the_call_and_the_limit(
    tokenizer, monkeypatch
):
    from agentgrpo.doctor import live

    released = threading.Event()

    class Hangs(Counter):
        def reset(self, target: int) -> str:
            released.wait(30)
            return ""

    monkeypatch.setattr(live, "RESET_TIMEOUT_S", 0.5)
    try:
        result = check_environment_runs(Hangs, Counter.dataset, setup(tokenizer))
    finally:
        released.set()
    assert result.status is Status.FAIL
    assert "Hangs: reset() had not returned after 0.5 s (" in result.message
    assert "return promptly" in result.fix


def test_the_command_names_an_empty_dataset_and_its_split(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(
        "from environments import Counter\n\nclass Empty(Counter):\n    @classmethod\n"
        "    def dataset(cls, split='train'):\n        return []\n"
    )
    args = ["doctor", "envs.py:Empty", "--model", str(tiny_model_dir)]
    assert main([*args, "--chat-template", "chatml_tools"]) == 1
    [line] = [line for line in capsys.readouterr().out.splitlines() if "environment" in line]
    assert line.startswith("fail    environment Empty: Empty.dataset(split='train') returned no")


# ---------------------------------------------------------------------- generation


def greedy_counter_engine(tokenizer, backend) -> RolloutEngine:
    """Greedy Counter episodes of up to 2 turns and 256 tokens."""
    episode = dict(max_completion_length=256, max_turns=2, temperature=0.0)
    return counter_engine(backend, tokenizer, **episode)


def test_generation_reports_the_tool_call_rate_of_played_episodes(tokenizer):
    engine = greedy_counter_engine(
        tokenizer, scripted_backend(tokenizer, [tool_call("increment", step=7), "Done."])
    )
    result = check_generation(engine, Counter.dataset(), 3)
    assert result.status is Status.OK
    assert result.message.startswith("3 episode(s): 3 called a tool (100%), 3 call(s), 0 parse")


def test_generation_warns_about_calls_the_parser_cannot_read(tokenizer):
    engine = greedy_counter_engine(
        tokenizer, scripted_backend(tokenizer, ["<tool_call>{oops</tool_call>"])
    )
    result = check_generation(engine, Counter.dataset(), 2)
    assert result.status is Status.WARNING and "4 parse failure(s)" in result.message
    assert "--tool-call-parser" in result.fix


def test_a_real_model_that_never_calls_a_tool_is_a_warning(tokenizer):
    from rollout import TransformersBackend

    backend = TransformersBackend.from_tokenizer(tiny_llama(tokenizer), tokenizer, seed=0)
    result = check_generation(greedy_counter_engine(tokenizer, backend), Counter.dataset(), 2)
    assert result.status is Status.WARNING and "0 called a tool (0%)" in result.message
    assert "--warm-start-steps" in result.fix


# ---------------------------------------------------------------------- run's start-up


def test_start_up_checks_pass_the_default_run_silently(tokenizer, capsys):
    engine = greedy_counter_engine(tokenizer, scripted_backend(tokenizer, ["Done."]))
    results = startup_checks(engine)
    assert {r.status for r in results} == {Status.OK}
    assert capsys.readouterr().out == ""


def test_start_up_checks_stop_a_run_whose_turns_never_stop(tokenizer):
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    backend = ScriptedBackend(lambda context: [endoftext], [endoftext])
    with pytest.raises(SetupCheckError, match="stop: the template ends an assistant"):
        startup_checks(greedy_counter_engine(tokenizer, backend))


def test_start_up_checks_print_a_fork_warning_and_go_on(tokenizer, capsys):
    engine = RolloutEngine(
        scripted_backend(tokenizer, ["Done."]),
        tokenizer,
        environment_factory=Counter,
        chat_template=DROPS_PAST_REASONING,
    )
    startup_checks(engine)
    assert capsys.readouterr().out.startswith("warning history     the template rewrites")


# ---------------------------------------------------------------------- the command


def doctor(*args: str) -> subprocess.CompletedProcess:
    """`agentgrpo doctor ARGS`, in this process."""
    return agentgrpo_here("doctor", *args)


@pytest.mark.slow
def test_the_command_passes_the_embedded_model_with_counter_and_plays_sampled_episodes(
    smollm2_path,
):
    result = doctor("--generate", "2", "env:Counter")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "agentgrpo doctor: the embedded SmolLM2-135M-Instruct"
    assert [line.split()[:2] for line in lines[1:6]] == [
        ["ok", "template"],
        ["ok", "parser"],
        ["ok", "history"],
        ["ok", "stop"],
        ["ok", "environment"],
    ]
    [line] = [line for line in lines if line.split()[1:2] == ["generate"]]
    assert line.split()[0] in ("ok", "warning")  # whether it calls a tool is sampling's
    assert "2 episode(s):" in line and "parse failure(s)" in line


def test_the_command_fails_a_chat_template_file_that_ignores_tools(smollm2_path, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(IGNORES_TOOLS)
    result = doctor("--chat-template", str(template))
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("fail")]
    assert line.startswith("fail    template    The chat template drops the tool schemas")
    assert "fix: pass --chat-template chatml_tools" in line


def test_the_command_fails_a_model_whose_own_template_cannot_show_tools(tiny_model_dir):
    result = doctor("--model", str(tiny_model_dir), "env:Counter")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "fail    template" in result.stdout


def test_generate_without_an_environment_is_a_usage_error(capsys):
    assert main(["doctor", "--generate", "2"]) == 2
    assert "--generate plays episodes of ENV" in capsys.readouterr().err


def test_run_stops_at_start_up_when_a_check_fails(tiny_model_dir, tmp_path):
    result = agentgrpo_here(
        "run", "env:Counter", "--model", str(tiny_model_dir),
        "--chat-template", WRONG_END_OF_TURN, "--output-dir", str(tmp_path / "out"),
        "--max-steps", "1", "--warm-start-steps", "0",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: stop: the template ends an assistant tool-call turn with '<|endoftext|>'" in (
        result.stderr
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
