"""`agentgrpo run vf:ENV_ID` and `eval`: verifiers environments defined here, played for real.

The environments are verifiers 0.4 packages written into a folder on sys.path (the hub is not
reachable here): a single-turn one (a taskset whose tasks have two weighted rewards, and a
harness that asks the model once, streaming as verifiers' own chat program does) and a tool
one (Counter as a verifiers taskset, its harness running a Python `increment` tool). Their
harnesses run in-process, as verifiers allows, and write every reply the endpoint sent them,
token ids included (which the integration asks for through verifiers' sampling overrides), so
the test can find exactly those tokens, mask 1, in the episodes the run recorded.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from agentgrpo.cli import main
from environments import Counter
from environments.contract import class_tools
from rollout import EpisodeConfig, Finish, RolloutEngine, read_records
from rollout.agents import AgentError
from rollout.agents.verifiers_env import verifiers_agent
from tests.support.agents import assert_replies_were_trained_on
from tests.support.cli import agentgrpo_here
from tests.support.episodes import TOOL_TURN, scripted_backend, scripted_episode

# What every harness here shares: write each reply the endpoint sent to $REPLIES.
LOG = """
import json, os

import openai
import verifiers.v1 as vf


def log(reply):
    if "REPLIES" in os.environ:
        with open(os.environ["REPLIES"], "a") as f:
            f.write(json.dumps(reply) + "\\n")


def first_messages(harness, data):
    system, prompt = harness.resolve_prompt(data)
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]


def joined(chunks):
    \"\"\"A streamed reply's chunks as the one completion they carry (our endpoint sends one).\"\"\"
    [delta] = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    choice = delta["choices"][0]
    return {"prompt_token_ids": delta.get("prompt_token_ids"),
            "choices": [{"message": choice["delta"], "logprobs": choice["logprobs"],
                         "token_ids": choice.get("token_ids")}]}
"""

# A single-turn environment: answer a sum; rewards `correct` (weight 2) and `brevity` (0.5).
SUM_ENV = """
class SumData(vf.TaskData):
    answer: str
    explode: bool = False


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def brevity(self, trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10):
            data = SumData(prompt=f"What is {a} + 3?", answer=str(a + 3), explode=a == 9)
            yield SumTask(data, self.config.task)


class OneReply(vf.Harness[vf.HarnessConfig]):
    \"\"\"Asks the model once, streaming; breaks after asking on a task that says `explode`.\"\"\"

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=ctx.model, messages=first_messages(self, data), stream=True)
            log(joined([chunk.model_dump() async for chunk in stream]))
        if data.explode:
            raise RuntimeError("the harness broke on purpose")
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["OneReply", "SumTaskset"]
"""

# Counter as a verifiers taskset: the harness offers `increment` (Counter's own schema) and
# runs it in Python, until the model stops calling it.
COUNTER_ENV = """
from verifiers.v1.types import content_text

TOOLS = json.loads({tools!r})


class CounterData(vf.TaskData):
    target: int


class CounterTask(vf.Task[CounterData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def reached_target(self, task, trace) -> float:
        results = [content_text(m.content) for m in trace.tool_messages]
        return float(results[-1:] == [str(task.target)])

    @vf.reward(weight=0.25)
    async def few_calls(self, trace) -> float:
        return 1.0 / max(1, len(trace.tool_messages))


class CounterTaskset(vf.Taskset[CounterTask, vf.TasksetConfig]):
    def load(self):
        for k in range(4):
            data = CounterData(name=f"reach-7-{{k}}", target=7,
                               prompt="Make the counter reach 7.\\nThe counter is at 0.")
            yield CounterTask(data, self.config.task)


def increment(counter: int, step: int) -> int:
    return counter + step


class CounterLoop(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        messages, counter = first_messages(self, data), 0
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(4):
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=TOOLS)
                log(reply.model_dump())
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls or []:
                    try:
                        counter = increment(counter, **json.loads(call.function.arguments))
                        result = str(counter)
                    except Exception as error:
                        result = f"error: {{error}}"
                    messages.append({{"role": "tool", "tool_call_id": call.id, "content": result}})
                if not message.tool_calls:
                    break
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CounterLoop", "CounterTaskset"]
"""

# The single-turn taskset with an Env of its own that counts how often it is brought up.
COUNTED_ENV = (
    SUM_ENV.replace('__all__ = ["OneReply", "SumTaskset"]', "")
    + """
import asyncio

SERVINGS = []


class CountedEnv(vf.SingleAgentEnv):
    async def start(self):
        SERVINGS.append("start")
        await asyncio.sleep(0.05)  # episodes that come meanwhile wait for it

    async def stop(self):
        SERVINGS.append("stop")


__all__ = ["CountedEnv", "OneReply", "SumTaskset"]
"""
)

# The single-turn taskset played by two seats: a solver, and a judge that is not trained.
JUDGED_ENV = (
    SUM_ENV.replace('__all__ = ["OneReply", "SumTaskset"]', "")
    + """
class JudgedConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    judge: vf.AgentConfig = vf.AgentConfig()


class JudgedEnv(vf.Env[JudgedConfig]):
    async def setup(self, agents):
        agents.judge.trainable = False

    async def run(self, task, agents):
        await agents.solver.run(task)
        await agents.judge.run(task)


__all__ = ["JudgedEnv", "OneReply", "SumTaskset"]
"""
)

COUNTER_TOOLS = [tool.schema for tool in class_tools(Counter).values()]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    """A folder holding the environments as modules `sum_vf` and `counter_vf`, on sys.path."""
    folder = tmp_path_factory.mktemp("vf_envs")
    (folder / "sum_vf.py").write_text(textwrap.dedent(LOG + SUM_ENV))
    counter = COUNTER_ENV.format(tools=json.dumps(COUNTER_TOOLS))
    (folder / "counter_vf.py").write_text(textwrap.dedent(LOG + counter))
    (folder / "counted_vf.py").write_text(textwrap.dedent(LOG + COUNTED_ENV))
    (folder / "judged_vf.py").write_text(textwrap.dedent(LOG + JUDGED_ENV))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder


def play(tokenizer, agent, rows, turns, num_generations=1):
    engine = RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=4),
        player=agent.player,
    )
    return anyio.run(engine.run, list(rows), num_generations)


def records(folder: Path) -> list:
    return [r for path in sorted(folder.glob("*.jsonl")) for r in read_records(path)]


# ---------------------------------------------------------------------- in process


def test_the_taskset_gives_the_rows_and_the_rubric_the_weighted_columns(env_dir):
    agent = verifiers_agent("sum-vf")  # ids name modules as verifiers does: sum-vf is sum_vf
    assert agent.name == "vf-sum_vf"
    assert (agent.columns, agent.weights) == (("brevity", "correct"), (0.5, 2.0))
    train, held_out = agent.dataset("train"), agent.dataset("eval")
    assert (len(train), len(held_out)) == (9, 1)  # the last tenth is held out
    assert train[0]["prompt"] == "What is 0 + 3?"
    assert json.loads(held_out[0]["task"])["answer"] == "12"


def test_the_agent_seats_turn_cap_is_the_runs(env_dir):
    assert verifiers_agent("sum_vf").episode_limits == {}
    capped = verifiers_agent("sum_vf", {"agent": {"max_turns": 5}})
    assert capped.episode_limits == {"max_turns": 5}


def test_an_episode_is_scored_by_the_rubric_one_column_per_function(env_dir, tokenizer):
    agent = verifiers_agent("sum_vf")
    right, wrong = play(tokenizer, agent, agent.dataset("train").select([0, 1]), ["3"])
    assert right.finish is Finish.STOP and right.error is None
    assert right.agent_rewards == {"brevity": 0.5, "correct": 1.0}  # 2 * 1.0 + 0.5 * 0.5 = 2.25
    assert wrong.agent_rewards == {"brevity": 0.5, "correct": 0.0}
    [row] = right.rows
    assert tokenizer.decode(row.completion_ids) == "3<|im_end|>"
    assert row.loss_mask == [1, 1]


def test_the_environment_is_brought_up_once_per_round_for_all_its_episodes(env_dir, tokenizer):
    agent = verifiers_agent("counted_vf")
    import counted_vf  # as verifiers imported it

    rows = agent.dataset("train").select(range(4))
    first = play(tokenizer, agent, rows, ["3"], num_generations=2)
    assert counted_vf.SERVINGS == ["start", "stop"]  # once for the round's 8 episodes
    second = play(tokenizer, agent, rows, ["3"])
    assert counted_vf.SERVINGS == ["start", "stop"] * 2
    assert all(e.finish is Finish.STOP and e.agent_rewards for e in first + second)


def test_an_episode_whose_harness_raises_ends_as_error_and_the_others_play_on(env_dir, tokenizer):
    agent = verifiers_agent("sum_vf")
    rows = [*agent.dataset("eval"), agent.dataset("train")[0]]  # the eval row explodes
    broken, fine = play(tokenizer, agent, rows, ["3"])
    assert broken.finish is Finish.ERROR and broken.agent_rewards is None
    assert "HarnessError" in broken.error and "the harness broke on purpose" in broken.error
    assert len(broken.rows) == 1  # what it sampled before breaking is still recorded
    assert fine.finish is Finish.STOP and fine.agent_rewards["correct"] == 1.0


def test_the_tool_environment_records_tool_results_as_mask_0(env_dir, tokenizer):
    agent = verifiers_agent("counter_vf")
    [episode] = play(tokenizer, agent, agent.dataset("train").select([0]), COUNTER_SCRIPT)
    assert episode.rows == scripted_episode(tokenizer, COUNTER_SCRIPT).rows  # masks too
    assert episode.agent_rewards == {"few_calls": 0.5, "reached_target": 1.0}
    assert [(c.name, dict(c.arguments), c.result) for c in episode.tool_calls] == [
        ("increment", {"step": 3}, "3"),
        ("increment", {"step": 4}, "7"),
    ]


def test_a_seat_that_is_not_trained_must_not_ask_the_policy(env_dir, tokenizer):
    agent = verifiers_agent("judged_vf")  # both seats run locally, not on verifiers' default
    with pytest.raises(AgentError, match="seat 'judge' is not trainable but asked the policy"):
        play(tokenizer, agent, agent.dataset("train").select([0]), ["3"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="verifiers' own harnesses run under uv")
def test_verifiers_own_bash_harness_plays_through_the_endpoint(env_dir, tokenizer):
    """Its chat program (run by uv, which fetches its packages from PyPI once) streams."""
    agent = verifiers_agent("sum_vf", {"agent": {"harness": {"id": "bash"}}})
    call = '<tool_call>{"name": "bash", "arguments": {"command": "echo $((0 + 3))"}}</tool_call>'
    [episode] = play(tokenizer, agent, agent.dataset("train").select([0]), [call, "3"])
    assert episode.finish is Finish.STOP and episode.agent_rewards["correct"] == 1.0
    assert [(c.name, c.result) for c in episode.tool_calls] == [("bash", "3\n")]
    [row] = episode.rows
    spans = [(mask, tokenizer.decode(ids)) for mask, ids in mask_spans(row)]
    assert spans == [(1, call + "<|im_end|>"), (0, TOOL_TURN.format("3\n")), (1, "3<|im_end|>")]


def mask_spans(row) -> list[tuple[int, list[int]]]:
    """A row's completion as runs of one loss mask: (mask, token ids)."""
    spans: list[tuple[int, list[int]]] = []
    for token, mask in zip(row.completion_ids, row.loss_mask, strict=True):
        if not spans or spans[-1][0] != mask:
            spans.append((mask, []))
        spans[-1][1].append(token)
    return spans


def test_a_row_not_made_by_the_environment_is_a_setup_error(env_dir, tokenizer):
    agent = verifiers_agent("sum_vf")
    with pytest.raises(AgentError, match="'task' column holds a SumData as JSON"):
        play(tokenizer, agent, [{"prompt": "What is 1 + 1?"}], ["2"])


COUNTER_SCRIPT = [
    '<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>',
    '<tool_call>{"name": "increment", "arguments": {"step": 4}}</tool_call>',
    "Done.",
]


# ---------------------------------------------------------------------- the command line


def test_run_and_eval_a_single_turn_environment(env_dir, tiny_model_dir, tmp_path, monkeypatch):
    replies = tmp_path / "replies.jsonl"
    monkeypatch.setenv("REPLIES", str(replies))
    out = tmp_path / "out"
    result = agentgrpo_here(
        "run", "vf:sum_vf", "--model", str(tiny_model_dir), "--chat-template", "chatml_tools",
        "--output-dir", str(out), "--max-steps", "2", "--per-device-train-batch-size", "4",
        "--num-generations", "2", "--max-completion-length", "24",
        cwd=env_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "environment  vf:sum_vf (9 rows)" in result.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "reward" in s]
    assert [s["step"] for s in trained] == [1, 2]
    for step in trained:  # each rubric function is a reward metric; the reward, their weighted sum
        assert step["reward"] == pytest.approx(
            2.0 * step["rewards/correct/mean"] + 0.5 * step["rewards/brevity/mean"]
        )
    played = records(out / "episodes")
    assert len(played) == 8
    for record in played:
        assert set(record.rewards) == {"correct", "brevity"}
        assert record.reward == pytest.approx(
            2.0 * record.rewards["correct"] + 0.5 * record.rewards["brevity"]
        )
    assert assert_replies_were_trained_on(replies, out / "episodes") == 8

    replies.unlink()
    result = agentgrpo_here(
        "eval", "vf:sum_vf", "--model", str(out / "model"), "--chat-template", "chatml_tools",
        "--max-completion-length", "24",
        cwd=env_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "episodes               1" in result.stdout  # the one held-out task, whose harness
    assert "mean_reward        0.000" in result.stdout  # breaks: an error, scored 0, not a crash
    [reply] = [json.loads(line) for line in replies.read_text().splitlines()]
    assert reply["choices"][0]["token_ids"]  # the integration asked for the token ids


def test_run_and_eval_a_tool_environment_with_the_taught_tiny_model(
    env_dir, tool_calling_tiny_model, tokenizer, tmp_path, monkeypatch
):
    """The tiny model taught Counter's episode plays it, greedily, as the verifiers taskset."""
    model_dir = tmp_path / "model"
    tool_calling_tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    replies = tmp_path / "replies.jsonl"
    monkeypatch.setenv("REPLIES", str(replies))
    out = tmp_path / "out"
    result = agentgrpo_here(
        "run", "vf:counter_vf", "--model", str(model_dir), "--chat-template", "chatml_tools",
        "--output-dir", str(out), "--max-steps", "1", "--per-device-train-batch-size", "4",
        "--num-generations", "2", "--max-completion-length", "160", "--max-turns", "3",
        "--temperature", "0", "--env-args", '{"agent": {"max_turns": 3}}',
        cwd=env_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    again = """agentgrpo eval vf:counter_vf --env-args '{"agent": {"max_turns": 3}}' --model"""
    assert f"evaluate it: {again} {out / 'model'}" in result.stdout
    [taught] = scripted_episode(tokenizer, COUNTER_SCRIPT).rows
    played = records(out / "episodes")
    assert len(played) == 4
    for record in played:
        assert record.episode.finish is Finish.STOP
        [row] = record.episode.rows  # the taught tokens: tool results mask 0, sampled turns 1
        assert (row.prompt_ids, row.completion_ids, row.loss_mask) == (
            taught.prompt_ids, taught.completion_ids, taught.loss_mask
        )  # fmt: skip
        assert record.rewards == {"few_calls": 0.5, "reached_target": 1.0}
        assert record.reward == pytest.approx(1.0 * 1.0 + 0.25 * 0.5)
    assert assert_replies_were_trained_on(replies, out / "episodes") == 4 * 3

    result = agentgrpo_here(
        "eval", "vf:counter_vf", "--model", str(model_dir), "--chat-template", "chatml_tools",
        "--max-completion-length", "160", "--max-turns", "3", "--temperature", "0",
        cwd=env_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success_rate       1.000" in result.stdout
    assert "mean_reward        1.125" in result.stdout


# ---------------------------------------------------------------------- user errors


def test_env_args_that_are_not_a_json_object(user_error):
    message = user_error("run", "vf:sum_vf", "--env-args", '{"agent": ')
    assert "--env-args takes a JSON object" in message and "Expecting value" in message
    assert "not a list" in user_error("eval", "vf:sum_vf", "--env-args", "[1, 2]")


def test_env_args_for_a_source_that_is_not_verifiers(user_error):
    message = user_error("run", "env:Counter", "--env-args", "{}")
    assert "--env-args configures a verifiers environment (vf:ENV_ID), not env:Counter" in message


def test_env_args_that_do_not_fit_the_environments_config(env_dir, user_error):
    message = user_error("run", "vf:sum_vf", "--env-args", '{"taskset": {"split": "test"}}')
    assert "taskset.split: Extra inputs are not permitted" in message
    retrying = '{"agent": {"retries": {"max_retries": 2}}}'
    message = user_error("run", "vf:sum_vf", "--env-args", retrying)
    assert "retries failed episodes (agent)" in message and "set their retries to 0" in message


def test_an_environment_that_is_not_installed(user_error):
    message = user_error("eval", "vf:no-such-env")
    assert "no verifiers environment 'no-such-env' is installed" in message
    assert "imports a module named 'no_such_env'" in message


def test_verifiers_not_installed(user_error, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` now fails
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    message = user_error("run", "vf:sum_vf")
    assert "verifiers package (0.4), which is not installed" in message
    assert "pip install 'agentgrpo[verifiers]'" in message


def test_envs_lists_the_verifiers_source(capsys):
    assert main(["envs"]) == 0
    assert "vf:ENV_ID" in capsys.readouterr().out


def test_a_reward_that_was_not_declared_up_front_stops_the_run(env_dir, tokenizer):
    (env_dir / "keyed_vf.py").write_text(
        textwrap.dedent(LOG + SUM_ENV).replace(
            "return float(task.answer in trace.last_reply)",
            "return {'exact': float(task.answer in trace.last_reply)}",
        )
    )
    importlib.invalidate_caches()  # the folder's listing is cached since the first import
    agent = verifiers_agent("keyed_vf")
    with pytest.raises(AgentError, match="recorded reward 'exact', which its tasks do not"):
        play(tokenizer, agent, agent.dataset("train").select([0]), ["3"])
