"""A chat template is code we did not write: every render ends, quickly, within bounded memory.

Each hostile template below once hung or took gigabytes (two nested `range(100000)` loops ran
past 100 s; `'x' * 2000000000` took 7 s and 2 GB while compiling). Now each stops with
`TemplateRenderError`, naming the template, the bound and the line, before it builds the value
it is refused (memory is measured with tracemalloc). Real templates render exactly as plain
jinja2 renders them.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import time
import tracemalloc
from pathlib import Path

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

import rollout.template
import rollout.template_source
from agentgrpo.doctor import Setup, Status, check_template
from rollout import ChatRenderer, RenderLimits, TemplateRenderError, load_template
from rollout.template_source import describe_template
from tests.support.parsing import trl_template

HUGE_STRING = "{{ ('x' * 2000000000)|length }}"
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
FAST = RenderLimits(timeout_s=1.0)
HELLO = [{"role": "user", "content": "Hello."}]

# Each builds far more than the bounds allow, a different way; the time limit is the backstop.
HOSTILE = {
    "doubling with +": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s|length }}"
    ),
    "doubling with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}"
    ),
    "a list of fresh megabytes": (
        "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}{{ ns.l|length }}"
    ),
    "a padding filter": "{{ 'x'|center(2000000000)|length }}",
    "a padding method": "{% set w = 2000000000 %}{{ 'x'.ljust(w)|length }}",
    "a % width from the values": "{{ ('%*d' % (2000000000, 1))|length }}",
    "a format width": "{{ '{:>{}}'.format(1, 2000000000)|length }}",
    "joining one string many times": "{% set s = 'x' * 10000000 %}{{ ([s] * 1000)|join|length }}",
    "replacing with a long string": "{% set s = 'x' * 100000 %}{{ s.replace('', s)|length }}",
    "tojson of one string many times": (
        "{% set s = 'x' * 10000000 %}{{ ([s] * 1000)|tojson|length }}"
    ),
    "a huge power": "{{ (10 ** 1000000000) % 7 }}",
    "squaring a number": (
        "{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}{{ ns.n % 7 }}"
    ),
    "bytes of an int": "{{ (1).to_bytes(2000000000, 'big')|length }}",
    "output in a loop": "{% set s = 'x' * 10000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
    "a block set": (
        "{% set s = 'x' * 10000000 %}{% set b %}{% for i in range(1000) %}{{ s }}{% endfor %}"
        "{% endset %}{{ b|length }}"
    ),
    "lorem ipsum": "{{ lipsum(100000000)|length }}",
    "nested loops over a string": (
        "{% set s = 'x' * 100000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}"
    ),
    "a macro that calls itself twice": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    ),
    "a macro that never returns": "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
}


def render_measured(tokenizer, template: str, limits: RenderLimits = FAST):
    """Build a renderer and render HELLO; return the error, the seconds and the peak MiB."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(TemplateRenderError) as error:
            ChatRenderer(tokenizer, template, limits=limits).render(HELLO, generation_prompt=True)
        return error.value, time.monotonic() - started, tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_a_two_gigabyte_string_is_refused_before_it_is_built(tokenizer):
    error, seconds, peak_mib = render_measured(tokenizer, HUGE_STRING, RenderLimits())
    message = str(error)
    assert message.startswith("The chat template given as jinja source (starting \"{{ ('x' *")
    assert "builds a value of 2,000,000,000 characters or items with `*`" in message
    assert "over the bound of 16,777,216 (line 1 of the template)" in message
    assert "Fix the template, or pass another one" in message
    assert seconds < 1 and peak_mib < 64


def test_two_nested_range_loops_stop_at_the_render_time_limit(tokenizer):
    error, seconds, _ = render_measured(tokenizer, NESTED_LOOPS, RenderLimits(timeout_s=0.5))
    assert "ran past the render time limit of 0.5 s (line 1 of the template)" in str(error)
    assert seconds < 5


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_stops_quickly_in_bounded_memory(tokenizer, name):
    error, seconds, peak_mib = render_measured(tokenizer, HOSTILE[name])
    assert str(error).startswith("The chat template given as jinja source")
    assert seconds < 10, error
    assert peak_mib < 400, (peak_mib, error)  # the largest value allowed: 16 Mi characters


def test_a_template_past_a_bound_is_not_reported_as_missing_tool_support(tokenizer):
    renderer = ChatRenderer(tokenizer, HUGE_STRING)
    with pytest.raises(TemplateRenderError, match="over the bound"):
        renderer.check_tool_support()


def test_the_error_names_the_model_folder_a_template_came_with(tokenizer):
    assert describe_template(tokenizer.chat_template, None, tokenizer) == (
        f"The chat template of {tokenizer.name_or_path!r} "
        "(tokenizer_config.json or chat_template.jinja)"
    )
    builtin = load_template(tokenizer, "chatml_tools")
    assert describe_template(builtin, tokenizer) == "The built-in chat template 'chatml_tools'"


def test_the_rendered_text_is_bounded_in_size(tokenizer):
    limits = RenderLimits(max_chars=1000)
    long = [{"role": "user", "content": "y" * 600}, {"role": "user", "content": "z" * 600}]
    renderer = ChatRenderer(tokenizer, load_template(tokenizer, "chatml_tools"), limits=limits)
    with pytest.raises(TemplateRenderError, match="rendered more than 1,000 characters"):
        renderer.render(long, True)


# ------------------------------------------------------------------------ in agentgrpo doctor


def test_doctor_fails_the_huge_string_template_at_once(tokenizer):
    started = time.monotonic()
    result = check_template(Setup(tokenizer, HUGE_STRING, frozenset({tokenizer.eos_token_id})))
    assert result.status is Status.FAIL and "over the bound of 16,777,216" in result.message
    assert time.monotonic() - started < 5


def test_doctor_fails_the_nested_loops_template_at_the_time_limit(tokenizer, monkeypatch):
    monkeypatch.setattr(rollout.template, "RenderLimits", functools.partial(RenderLimits, 1.0))
    started = time.monotonic()
    result = check_template(Setup(tokenizer, NESTED_LOOPS, frozenset({tokenizer.eos_token_id})))
    assert result.status is Status.FAIL
    assert "ran past the render time limit of 1 s" in result.message
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------ real templates, unchanged

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "increment",
            "description": "Add step.",
            "parameters": {
                "type": "object",
                "properties": {"step": {"type": "integer", "description": "Value to add."}},
                "required": ["step"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "increment", "arguments": {"step": 3}}}
CONVERSATIONS = [
    HELLO,
    [
        {"role": "system", "content": "You count."},
        {"role": "user", "content": "Count to 3, ü 漢字."},
        {"role": "assistant", "content": "<think>Add.</think>Adding.", "tool_calls": [CALL]},
        {"role": "tool", "name": "increment", "content": "3"},
        {"role": "assistant", "content": "Done."},
    ],
]


def trl_templates() -> list[str]:
    """Every template TRL ships (text, vision and training variants), by name."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    return sorted(path.stem for path in folder.glob("*.jinja"))


def plain_jinja(source: str):
    """The template compiled the way it was before bounds: jinja2's immutable sandbox."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, rollout.template_source._GenerationBlock],
    )
    env.filters["tojson"] = rollout.template_source._tojson
    env.globals["raise_exception"] = rollout.template_source._raise_exception
    env.globals["strftime_now"] = lambda fmt: "26 Jul 2024"
    return env.from_string(source)


def outcome(render) -> str | tuple[str, str]:
    """What `render()` returns, or its error's type and message (templates may raise)."""
    try:
        return render()
    except Exception as error:
        return type(error).__name__, str(error)


@pytest.mark.parametrize("name", ["chatml_tools", *trl_templates()])
def test_a_real_template_renders_exactly_as_plain_jinja_renders_it(tokenizer, name):
    source = load_template(tokenizer, "chatml_tools") if name == "chatml_tools" else None
    source = source or trl_template(name)
    renderer = ChatRenderer(tokenizer, source, TOOLS)
    renderer._compiled.globals["strftime_now"] = lambda fmt: "26 Jul 2024"
    plain = plain_jinja(source)
    for messages, prompt in itertools.product(CONVERSATIONS, (True, False)):
        variables = dict(tools=TOOLS, add_generation_prompt=prompt, **renderer._special)
        expected = outcome(functools.partial(plain.render, messages=messages, **variables))
        got = outcome(functools.partial(renderer.render, messages, prompt))
        assert got == expected
