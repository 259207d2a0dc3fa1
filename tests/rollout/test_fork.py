"""Fork on drift: a template that rewrites history moves the episode to a new, token-exact row.

Qwen3's template (read from the installed trl package) re-renders past assistant turns: it keeps
the reasoning of turns after the last user message, but drops an empty `<think>` block (what the
model writes with thinking off, and what the generation prompt holds with
`enable_thinking=False`). Its `_training` variant always keeps it, so it never forks.
"""

from __future__ import annotations

import json
import math

import anyio
import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOTrainer
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.learner.losses import aggregate
from agentgrpo.learner.masked import masked_mean_per_episode
from agentgrpo.learner.objectives import log_importance_ratio
from agentgrpo.learner.token_weights import off_policy_sequence_mask, sampler_correction
from agentgrpo.reporting.metrics import RewardLayout, episode_stats, round_metrics
from agentgrpo.rounds.data import episodes_from_rollout_func
from agentgrpo.rounds.pipeline import RoundPlan, split_micro_batches
from environments import Counter
from rollout import (
    Episode,
    EpisodeRecord,
    EpisodeRow,
    EpisodeStats,
    Finish,
    record_from_dict,
    record_line,
    record_to_dict,
)
from tests.support.episodes import scripted_backend, tool_call
from tests.support.parsing import qwen3_engine, trl_template
from tests.support.teach import teach
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import rank_in_call, short_run_config, tiny_trainer

pytestmark = pytest.mark.anyio

ROW = {"prompt": "Make the counter reach 3.", "target": 3}
EMPTY_THINK = "<think>\n\n</think>\n\n"
TURNS = [EMPTY_THINK + tool_call("increment", step=3), "<think>\nIt is 3.\n</think>\n\nDone."]


def sampled(tokenizer, text: str) -> list[int]:
    """The ids the scripted backend answers `text` with (its stop token last)."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def scripted_logprobs(count: int) -> list[float]:
    return [-(k + 1) / 100 for k in range(count)]


# --------------------------------------------------------------------------- the engine


async def test_qwen3_forks_where_it_drops_a_past_turns_empty_reasoning(tokenizer):
    backend = scripted_backend(tokenizer, TURNS)
    engine = qwen3_engine(tokenizer, backend, trl_template("qwen3"))
    [episode] = await engine.run([ROW])
    first, second = episode.rows
    turn_1, turn_2 = sampled(tokenizer, TURNS[0]), sampled(tokenizer, TURNS[1])
    # Row 1: the task's prompt, then the first turn exactly as sampled; the tool turn is not in it.
    assert first.prompt_ids == backend.requests[0][0]
    assert first.completion_ids == turn_1
    assert first.loss_mask == [1] * len(turn_1)
    assert first.sampler_logprobs == scripted_logprobs(len(turn_1))
    # Row 2: the template's fresh rendering of the conversation is the prompt the model saw.
    renderer = engine.context.renderer
    fresh = renderer.render(episode.messages[:3], generation_prompt=True)
    assert second.prompt_ids == renderer.encode(fresh) == backend.requests[1][0]
    history = tokenizer.decode(second.prompt_ids[len(first.prompt_ids) :])
    assert history.startswith("<tool_call>")  # the past turn, rendered without its empty think
    assert second.completion_ids == turn_2
    assert second.loss_mask == [1] * len(turn_2)
    assert second.sampler_logprobs == scripted_logprobs(len(turn_2))
    assert (episode.finish, episode.env_reward, episode.forks) == (Finish.STOP, 1.0, 1)


async def test_qwen3_keeps_a_tool_loops_reasoning_so_such_an_episode_stays_one_row(tokenizer):
    turns = ["<think>\nAdd 3.\n</think>\n\n" + tool_call("increment", step=3), "Done."]
    engine = qwen3_engine(tokenizer, scripted_backend(tokenizer, turns), trl_template("qwen3"))
    [episode] = await engine.run([ROW])
    assert len(episode.rows) == 1


async def test_qwen3s_training_template_keeps_the_forking_episode_on_one_row(tokenizer):
    backend = scripted_backend(tokenizer, TURNS)
    engine = qwen3_engine(tokenizer, backend, trl_template("qwen3_training"))
    [episode] = await engine.run([ROW])
    [row] = episode.rows
    turn_1, turn_2 = sampled(tokenizer, TURNS[0]), sampled(tokenizer, TURNS[1])
    glue = len(row.completion_ids) - len(turn_1) - len(turn_2)
    assert row.loss_mask == [1] * len(turn_1) + [0] * glue + [1] * len(turn_2)
    assert row.completion_ids[: len(turn_1)] == turn_1
    assert row.completion_ids[len(turn_1) + glue :] == turn_2
    assert row.prompt_ids + row.completion_ids[: len(turn_1) + glue] == backend.requests[1][0]


async def test_with_thinking_off_every_turn_after_a_tool_turn_forks(tokenizer):
    turns = [tool_call("increment", step=1), tool_call("increment", step=2), "Done."]
    engine = qwen3_engine(
        tokenizer,
        scripted_backend(tokenizer, turns),
        trl_template("qwen3"),
        chat_template_kwargs={"enable_thinking": False},
    )
    [episode] = await engine.run([ROW])
    assert len(episode.rows) == 3
    assert [row.completion_ids for row in episode.rows] == [sampled(tokenizer, t) for t in turns]
    layout = RewardLayout([], [], num_generations=2, with_tools=True)
    metrics = round_metrics(
        episode_stats([episode, episode]), torch.ones(2, 0), torch.ones(2), layout
    )
    assert metrics["episodes/rows_mean"] == 3.0
    assert metrics["turns/fork_frequency"] == 1.0  # both turns after the first forked


# --------------------------------------------------------------------------- the learner
# Three batch rows: a two-row episode (rows 0 and 1) beside a one-row episode (row 2).

LOSS_3x2 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
MASK_3x2 = torch.tensor([[1, 1], [1, 0], [1, 1]])
EPISODE_3 = torch.tensor([0, 0, 1])


def test_grpo_averages_each_episode_over_the_tokens_of_all_its_rows():
    # Episode 0: tokens 1, 2, 3 -> mean 2. Episode 1: 5, 6 -> 5.5. Mean over episodes: 3.75.
    # (Counting rows as sequences would give (1.5 + 3 + 5.5) / 3.)
    assert aggregate(LOSS_3x2, MASK_3x2, "grpo", episode_B=EPISODE_3).item() == 3.75


def test_token_level_losses_count_each_token_once_whatever_the_rows():
    # Active tokens 1 + 2 + 3 + 5 + 6 = 17 over 5 of them.
    assert aggregate(LOSS_3x2, MASK_3x2, "bnpo", episode_B=EPISODE_3).item() == pytest.approx(3.4)
    for loss_type in ("dapo", "cispo", "sapo", "luspo"):
        loss = aggregate(LOSS_3x2, MASK_3x2, loss_type, num_items=10, episode_B=EPISODE_3)
        assert loss.item() == pytest.approx(1.7), loss_type  # 17 / 10


def test_dr_grpo_divides_by_episodes_not_rows():
    loss = aggregate(LOSS_3x2, MASK_3x2, "dr_grpo", max_completion_length=4, episode_B=EPISODE_3)
    assert loss.item() == 17 / (2 * 4)


def test_without_episode_ids_each_row_is_its_own_episode():
    assert aggregate(LOSS_3x2, MASK_3x2, "grpo").item() == pytest.approx((1.5 + 3 + 5.5) / 3)
    loss = aggregate(LOSS_3x2, MASK_3x2, "dr_grpo", max_completion_length=4)
    assert loss.item() == pytest.approx(17 / (3 * 4))


def test_the_sequence_level_ratio_is_the_mean_over_the_whole_episode():
    logprobs = torch.tensor([[0.1, 0.2], [0.6, 9.0], [0.4, -0.4]])
    log_ratio = log_importance_ratio(logprobs, torch.zeros(3, 2), MASK_3x2, "sequence", EPISODE_3)
    assert torch.allclose(log_ratio, torch.tensor([[0.3, 0.3], [0.3, 0.3], [0.0, 0.0]]))


def test_off_policy_masking_keeps_or_drops_an_episodes_rows_together():
    # Drift (sampler - policy): row 0 alone is 1.0 > 0.5, but the episode's mean is 1/6.
    sampler = torch.tensor([[1.0, 1.0], [-1.5, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([-1.0, -1.0, -1.0])
    keep = off_policy_sequence_mask(
        torch.zeros(3, 2), sampler, advantages, MASK_3x2, 0.5, EPISODE_3
    )
    assert keep.tolist() == [True, True, False]


def test_the_sequence_sampler_correction_is_per_episode():
    old = torch.tensor([[0.1, 0.2], [0.6, 0.0], [0.0, 0.0]])
    weights = sampler_correction(
        old, torch.zeros(3, 2), MASK_3x2, "sequence_truncate", 10.0, None, EPISODE_3
    )
    expected = math.exp(0.3)
    assert torch.allclose(weights, torch.tensor([[expected] * 2, [expected, 0.0], [1.0, 1.0]]))


def test_the_episode_mean_is_the_mean_over_all_its_rows():
    mean_B = masked_mean_per_episode(LOSS_3x2, MASK_3x2, EPISODE_3)
    assert mean_B.tolist() == [2.0, 2.0, 5.5]


def two_row_episode(index: int, finish: Finish = Finish.STOP) -> Episode:
    rows = (
        EpisodeRow([1, 2], [3, 4], [1, 1], [-0.1, -0.2]),
        EpisodeRow([1, 2, 3, 9], [5], [1], [-0.5]),
    )
    return Episode(rows, [], finish, EpisodeStats(2, 1, {}), {}, 0, index)


def one_row_episode(index: int) -> Episode:
    rows = (EpisodeRow([1], [6, 7, 8], [1, 0, 1], [-0.3, 0.0, -0.4]),)
    return Episode(rows, [], Finish.STOP, EpisodeStats(1, 0, {}), {}, 0, index)


def test_a_batch_has_one_row_per_episode_row_sharing_the_episodes_advantage():
    batch = collate_episodes([two_row_episode(0), one_row_episode(1)], torch.tensor([1.0, -1.0]), 0)
    assert batch.episode_B.tolist() == [0, 0, 1]
    assert batch.advantages_B.tolist() == [1.0, 1.0, -1.0]
    assert batch.loss_mask_B_C.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 1]]
    assert batch.input_ids_B_L[1].tolist() == [1, 2, 3, 9, 5, 0, 0]


def test_mask_truncated_completions_drops_every_row_of_a_cut_off_episode():
    episodes = [two_row_episode(0, Finish.LENGTH), one_row_episode(1)]
    batch = collate_episodes(episodes, torch.zeros(2), 0, mask_truncated_completions=True)
    assert batch.loss_mask_B_C.sum(-1).tolist() == [0, 0, 2]


def test_micro_batches_never_split_an_episodes_rows():
    episodes = [two_row_episode(0), one_row_episode(1), two_row_episode(2), one_row_episode(3)]
    batch = collate_episodes(episodes, torch.zeros(4), 0)
    plan = RoundPlan(prompts_per_process=2, num_generations=2, micro_batch_size=1, micro_batches=4)
    torch.manual_seed(0)
    micro_batches = split_micro_batches(batch, plan, round_tokens=10)
    assert sorted(len(m) for m in micro_batches) == [1, 1, 2, 2]
    for micro in micro_batches:
        [episode] = set(micro.episode_B.tolist())
        assert len(micro) == len(episodes[episode].rows)


# --------------------------------------------------------------------------- records, rollout_func


async def test_a_forked_episode_round_trips_through_its_record(tokenizer):
    engine = qwen3_engine(tokenizer, scripted_backend(tokenizer, TURNS), trl_template("qwen3"))
    [episode] = await engine.run([ROW])
    record = EpisodeRecord(episode, {"Counter": 1.0}, 1.0, 0.5, policy_version=3)
    back = record_from_dict(json.loads(record_line(record)))
    assert back == record and len(back.episode.rows) == 2


def test_a_record_of_format_1_reads_back_as_one_row():
    record = EpisodeRecord(one_row_episode(0), {}, 0.0, 0.0, policy_version=0)
    data = record_to_dict(record)
    [row] = data.pop("rows")
    assert record_from_dict(data | row | {"format": 1}) == record


def test_rollout_func_rows_with_one_episode_id_are_one_episode():
    output = {
        "prompt_ids": [[1], [1, 2, 3], [1], [4], [4]],
        "completion_ids": [[2, 3], [7, 0], [5, 0], [6, 0], [8, 0]],
        "logprobs": [[-0.1, -0.2], [-0.3, -0.4], [-0.5, -0.6], [-0.7, -0.8], [-0.9, -1.0]],
        "episode_ids": ["a", "a", "b", "c", "d"],
        "bonus": [1, 2, 3, 4, 5],
    }
    rows = [{"prompt": "x"}, {"prompt": "y"}]
    episodes = episodes_from_rollout_func(output, rows, 2, {0}, lambda ids: str(ids))
    assert [len(e.rows) for e in episodes] == [2, 1, 1, 1]
    assert episodes[0].rows[1] == EpisodeRow([1, 2, 3], [7, 0], [1, 1], [-0.3, -0.4])
    assert [e.row["bonus"] for e in episodes] == [1, 3, 4, 5]  # an episode's first entry's
    assert [e.group for e in episodes] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="3 episodes for 2 prompts"):
        episodes_from_rollout_func(output | {"episode_ids": list("aabbc")}, rows, 2, {0}, str)


# --------------------------------------------------------------------------- a real run


def test_grpo_trains_through_qwen3s_template_forking_every_turn(tokenizer, tmp_path):
    template = trl_template("qwen3")
    thinking_off = {"enable_thinking": False}
    turns = [tool_call("increment", step=3), "Done."]
    demo = qwen3_engine(
        tokenizer, scripted_backend(tokenizer, turns), template, chat_template_kwargs=thinking_off
    )
    [episode] = anyio.run(demo.run, [ROW])
    assert len(episode.rows) == 2
    model = tiny_llama(tokenizer)
    teach(model, [episode], lr=1e-2, steps=300, until_learned=True)  # then greedy forks
    before = [p.detach().clone() for p in model.parameters()]
    args = short_run_config(
        tmp_path, max_completion_length=64, max_turns=3, learning_rate=1e-4,
        top_k=1,  # greedy: every episode calls the tool, then answers
        chat_template=template, chat_template_kwargs=thinking_off,
    )  # fmt: skip

    trainer = GRPOTrainer(
        model,
        rank_in_call,
        args=args,
        train_dataset=Dataset.from_list([ROW] * 8),
        processing_class=tokenizer,
        environment_factory=Counter,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all(entry["episodes/rows_mean"] == 2.0 for entry in logs)
    assert all(entry["turns/fork_frequency"] == 1.0 for entry in logs)
    assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) for entry in logs)
    after = list(model.parameters())
    assert any(not torch.equal(b, a.detach().cpu()) for b, a in zip(before, after, strict=True))
    assert all(torch.isfinite(a).all() for a in after)


def test_a_rollout_func_with_episode_ids_trains_on_every_row(tokenizer, tmp_path):
    def rollout_func(prompts, trainer):
        ids = [tokenizer.encode(p) for p in prompts]  # each row's prompt G times, as TRL's
        eos = tokenizer.eos_token_id
        return {  # each episode: a first row, then a second whose prompt rewrote the first
            "prompt_ids": [p for p in ids for p in (p, p + [42])],
            "completion_ids": [c for _ in ids for c in ([42, 43], [44, eos])],
            "logprobs": [[-1.0, -1.0] for _ in ids for _ in range(2)],
            "episode_ids": [i for i in range(len(ids)) for _ in range(2)],
        }

    def rank_in_call(completion_ids, **kwargs):
        assert all(len(ids) == 4 for ids in completion_ids)  # both rows' completions
        return [float(k) for k in range(len(completion_ids))]

    # GRPOConfig's own learning rate and seed
    args = short_run_config(
        tmp_path, per_device_train_batch_size=8, max_steps=1, learning_rate=1e-6, seed=42
    )
    prompts = Dataset.from_dict({"prompt": ["The sky is", "Hello"] * 4})
    trainer = tiny_trainer(tokenizer, rank_in_call, args, prompts, rollout_func=rollout_func)
    trainer.train()
    [log] = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["episodes/rows_mean"] == 2.0
    assert log["completions/mean_length"] == 4  # model tokens of both rows
    assert math.isfinite(log["loss"])
