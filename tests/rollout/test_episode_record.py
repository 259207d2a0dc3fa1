"""The episode record: each trained episode kept as data in episodes/step-N.jsonl, read back."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import anyio
import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.learner.advantages import group_advantages
from agentgrpo.reporting.run_log import episode_file, read_episodes, recorded_steps
from environments import Counter
from rollout import (
    EpisodeRecord,
    ScriptedBackend,
    read_records,
    record_from_dict,
    record_line,
    record_to_dict,
)
from rollout.record import TAG
from tests.support.cli import agentgrpo_here
from tests.support.episodes import Workbench, chatml_engine, single_row, tool_call
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import StopAfter, short_run_config

# Turn 1: a good call, an unknown tool, bad arguments and a garbled call; turn 2: a tool that
# raises and one that times out; turn 3: the answer.
WORKBENCH_TURNS = [
    "\n".join(
        [
            tool_call("increment", step=3),
            tool_call("decrement", step=1),
            tool_call("increment", step="four"),
            "<tool_call>{oops</tool_call>",
        ]
    ),
    tool_call("explode", x=1) + "\n" + tool_call("hang", x=2),
    "Done.",
]


def by_turn(tokenizer, turns: list[str]) -> ScriptedBackend:
    """Answer the k-th model turn with turns[k], however many tool results came before."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        k = tokenizer.decode(context).count("<|im_start|>assistant") - 1
        return tokenizer.encode(turns[k], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


@pytest.fixture(scope="module")
def workbench_episode(tokenizer):
    backend = by_turn(tokenizer, WORKBENCH_TURNS)
    engine = chatml_engine(
        backend, tokenizer, Workbench, max_completion_length=1024, tool_timeout_s=0.3
    )
    [episode] = anyio.run(engine.run, [{"prompt": "Reach 3.", "target": 3}])
    return episode


def scored(episode, **overrides) -> EpisodeRecord:
    fields = dict(
        rewards={"short": 0.25, "Counter": None}, reward=0.25, advantage=-0.5, policy_version=3
    )
    return EpisodeRecord(episode, **(fields | overrides))


def round_trip(record: EpisodeRecord) -> EpisodeRecord:
    return record_from_dict(json.loads(record_line(record)))


def strict_json(line: str):
    """Parse as strict JSON: NaN and Infinity tokens are refused."""

    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(line, parse_constant=refuse)


# ---------------------------------------------------------------------- the record itself


def test_each_tool_call_is_recorded_with_its_result_and_error_kind(workbench_episode):
    calls = [(c.name, c.error) for c in workbench_episode.tool_calls]
    assert calls == [
        ("increment", None),
        ("decrement", "unknown_tool"),
        ("increment", "bad_arguments"),
        (None, "parse"),
        ("explode", "exception"),
        ("hang", "timeout"),
    ]
    assert workbench_episode.tool_calls[0].arguments == {"step": 3}
    tool_messages = [m["content"] for m in workbench_episode.messages if m["role"] == "tool"]
    assert [c.result for c in workbench_episode.tool_calls] == tool_messages
    assert len(workbench_episode.tool_calls) == workbench_episode.stats.tool_calls


def test_a_multi_turn_tool_episode_round_trips_exactly(workbench_episode):
    record = scored(workbench_episode)
    back = round_trip(record)
    assert back == record
    assert back.episode.environment is None  # the live instance is not data
    assert workbench_episode.environment is not None


def test_float32_logprobs_and_rewards_come_back_bit_for_bit(workbench_episode):
    mask = torch.tensor(single_row(workbench_episode).loss_mask, dtype=torch.float32)
    logprobs_T = torch.randn(len(mask), generator=torch.Generator().manual_seed(0)) * mask
    row = dataclasses.replace(single_row(workbench_episode), sampler_logprobs=logprobs_T.tolist())
    episode = dataclasses.replace(workbench_episode, rows=(row,))
    reward = torch.tensor(1 / 3, dtype=torch.float32).item()
    back = round_trip(scored(episode, reward=reward, advantage=np.float32(-0.1)))
    assert torch.equal(
        torch.tensor(single_row(back.episode).sampler_logprobs, dtype=torch.float32), logprobs_T
    )
    assert single_row(back.episode).sampler_logprobs == single_row(episode).sampler_logprobs
    assert back.reward == reward and back.advantage == np.float32(-0.1)


def test_a_line_is_strict_ascii_json_even_for_nan_and_lone_surrogates(workbench_episode):
    row = {"prompt": "Reach 3.", "target": 3, "weight": float("nan"), "note": "\ud800"}
    episode = dataclasses.replace(workbench_episode, row=row, env_reward=float("inf"))
    line = record_line(scored(episode, advantage=float("-inf")))
    assert line.isascii() and line.endswith("\n") and line.count("\n") == 1
    strict_json(line)
    back = record_from_dict(json.loads(line)).episode
    assert math.isnan(back.row["weight"]) and back.row["note"] == "\ud800"
    assert back.env_reward == float("inf")


def test_row_values_json_lacks_are_kept_exactly_or_tagged_with_their_repr(workbench_episode):
    row = {
        "prompt": "Reach 3.",
        "pair": (1, "a"),
        "numpy": [np.int64(7), np.float32(0.5)],
        "huge": 7**6000,
        "uses_the_tag": {TAG: "repr"},
        "bytes": b"\x00\x01",
        "by_number": {1: "one"},
    }
    episode = dataclasses.replace(workbench_episode, row=row)
    back = round_trip(scored(episode)).episode.row
    exact = ["prompt", "pair", "numpy", "huge", "uses_the_tag"]
    assert {k: back[k] for k in exact} == {k: row[k] for k in exact}
    assert back["bytes"] == {TAG: "repr", "type": "builtins.bytes", "value": "b'\\x00\\x01'"}
    assert back["by_number"] == {TAG: "repr", "type": "builtins.dict", "value": "{1: 'one'}"}


def test_a_record_of_another_format_is_refused_saying_so(workbench_episode, tmp_path):
    data = record_to_dict(scored(workbench_episode)) | {"format": 99}
    with pytest.raises(ValueError, match="found format 99"):
        record_from_dict(data)
    path = tmp_path / "step-00001.jsonl"
    path.write_text(record_line(scored(workbench_episode)) + json.dumps(data) + "\n")
    with pytest.raises(ValueError, match=r"step-00001\.jsonl, line 2"):
        read_records(path)


# ---------------------------------------------------------------------- a real training run


def short(completion_ids, **kwargs) -> list[float]:
    """Reward: 1 for an empty completion, falling to 0 at 64 tokens."""
    return [max(0.0, 1 - len(ids) / 64) for ids in completion_ids]


class RoundsSeen(TrainerCallback):
    """Keeps `trainer.last_episodes` at the end of each step that trained a new round."""

    def __init__(self):
        self.trainer = None
        self.rounds: dict[int, list] = {}
        self._previous = None

    def on_step_end(self, args, state, control, **kwargs):
        episodes = self.trainer.last_episodes
        if episodes is not self._previous:
            self.rounds[state.global_step] = list(episodes)
            self._previous = episodes


def counter_config(output_dir, **overrides) -> GRPOConfig:
    """The short run on Counter episodes: up to 3 turns and 48 tokens, at lr 1e-3."""
    episodes = dict(max_completion_length=48, max_turns=3, chat_template="chatml_tools")
    return short_run_config(output_dir, **(episodes | {"learning_rate": 1e-3} | overrides))


def train_counter(model, tokenizer, args, resume=None, stop_at=None) -> RoundsSeen:
    seen = RoundsSeen()
    callbacks = [seen] + ([StopAfter(stop_at)] if stop_at else [])
    trainer = GRPOTrainer(
        model,
        short,
        args,
        Dataset.from_list([{"prompt": "Make the counter reach 7.", "target": 7}] * 32),
        processing_class=tokenizer,
        environment_factory=Counter,
        callbacks=callbacks,
    )
    seen.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return seen


@pytest.fixture(scope="module")
def trained_run(tokenizer, tool_calling_tiny_model, tmp_path_factory):
    """Two GRPO steps of the tool-calling tiny model on Counter; the rounds it trained on."""
    output_dir = tmp_path_factory.mktemp("run")
    model = copy.deepcopy(tool_calling_tiny_model)
    seen = train_counter(model, tokenizer, counter_config(output_dir))
    return output_dir, seen.rounds


def test_every_trained_episode_is_read_back_equal_to_the_one_trained_on(trained_run):
    output_dir, rounds = trained_run
    assert recorded_steps(output_dir) == sorted(rounds) == [1, 2]
    for step, trained in rounds.items():
        records = read_episodes(output_dir, step)
        assert [r.episode for r in records] == [episode for episode, _ in trained]
        assert [r.policy_version for r in records] == [step - 1] * len(trained)
        assert {r.process for r in records} == {0}
    records = [r for step in rounds for r in read_episodes(output_dir, step)]
    calls = [call for r in records for call in r.episode.tool_calls]
    assert calls and all(call.result for call in calls)  # the taught model calls its tool


def test_recorded_rewards_and_advantages_are_those_the_trainer_computed(trained_run):
    output_dir, rounds = trained_run
    for step, trained in rounds.items():
        records = read_episodes(output_dir, step)
        for record, (episode, reward) in zip(records, trained, strict=True):
            assert record.rewards == {
                "short": pytest.approx(short([single_row(episode).completion_ids])[0]),
                "Counter": episode.env_reward,
            }
            assert record.reward == reward  # the combined reward, exactly
        rewards_N = torch.tensor([reward for _, reward in trained])
        expected_N = group_advantages(rewards_N, 4, scale="group")
        torch.testing.assert_close(torch.tensor([r.advantage for r in records]), expected_N)


def test_a_round_serving_several_steps_is_recorded_at_the_first(tokenizer, tmp_path):
    args = counter_config(
        tmp_path, steps_per_generation=2, max_steps=4, max_completion_length=8, max_turns=1
    )
    seen = train_counter(tiny_llama(tokenizer), tokenizer, args)
    assert sorted(seen.rounds) == recorded_steps(tmp_path) == [1, 3]
    assert [r.policy_version for r in read_episodes(tmp_path, 3)] == [2] * 8
    with pytest.raises(FileNotFoundError, match="steps with episodes: 1, 3"):
        read_episodes(tmp_path, 2)


def test_a_resumed_run_replaces_the_steps_it_replays_and_keeps_the_earlier_ones(
    tokenizer, tmp_path
):
    args = counter_config(
        tmp_path,
        max_steps=4,
        max_completion_length=8,
        max_turns=1,
        save_strategy="steps",
        save_steps=2,
    )
    train_counter(tiny_llama(tokenizer), tokenizer, args, stop_at=3)  # checkpoint-2, step 3
    kept = {step: episode_file(tmp_path, step).read_bytes() for step in (1, 2)}
    (tmp_path / "episodes" / "step-00009.jsonl").write_text("left by an older run\n")
    seen = train_counter(
        tiny_llama(tokenizer), tokenizer, args, resume=str(tmp_path / "checkpoint-2")
    )
    assert recorded_steps(tmp_path) == [1, 2, 3, 4]
    assert {step: episode_file(tmp_path, step).read_bytes() for step in (1, 2)} == kept
    for step in (3, 4):
        records = read_episodes(tmp_path, step)
        assert [r.episode for r in records] == [e for e, _ in seen.rounds[step]]
        assert len({(r.episode.group, r.episode.index) for r in records}) == 4
    assert not list((tmp_path / "episodes").glob("*.tmp"))


def test_log_episodes_off_writes_no_record(tokenizer, tmp_path):
    args = counter_config(tmp_path, max_steps=1, max_completion_length=8, log_episodes=False)
    train_counter(tiny_llama(tokenizer), tokenizer, args)
    assert recorded_steps(tmp_path) == []


def test_the_cli_run_writes_the_record(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = agentgrpo_here(
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(out),
        "--max-steps", "2", "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "16", "--warm-start-steps", "0",
        "--chat-template", "chatml_tools", "--save-strategy", "no",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert recorded_steps(out) == [1, 2]
    for step in (1, 2):
        records = read_episodes(out, step)
        assert len(records) == 4
        assert all(set(r.rewards) == {"Counter"} for r in records)
        assert all(r.episode.row["target"] in range(1, 10) for r in records)
