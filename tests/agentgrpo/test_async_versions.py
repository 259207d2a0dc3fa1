"""Per-token policy versions: a completion that spans a weight push records both versions."""

from __future__ import annotations

import math
from dataclasses import replace

import anyio
import anyio.lowlevel
import pytest
import torch

from agentgrpo.asynchronous.rounds import episode_version
from agentgrpo.reporting.view_data import episode_view
from rollout import EpisodeRecord, SamplingParams, TransformersBackend
from rollout.record import record_from_dict, record_to_dict
from rollout.tokens import TokenRow
from tests.support.episodes import scripted_episode
from tests.support.tiny_model import tiny_llama

TURNS = ["Hello there.", "Done."]


@pytest.mark.anyio
async def test_tokens_drawn_after_a_push_carry_the_new_version_and_its_logprobs(tokenizer):
    model = tiny_llama(tokenizer)
    vocab = model.config.vocab_size
    never = vocab - 1  # a stop id: the completion runs to max_tokens unless it is drawn
    backend = TransformersBackend(model, {never}, tokenizer.pad_token_id)
    backend.set_weights_version(0)

    def flatten() -> None:  # version 1's weights: every logit 0, so each draw is uniform
        with torch.no_grad():
            model.lm_head.weight.zero_()

    params = SamplingParams(max_tokens=12, seed=3)
    async with anyio.create_task_group() as tasks:
        result = {}

        async def generate() -> None:
            result["completion"] = await backend.generate(tokenizer.encode("Hello"), params)

        tasks.start_soon(generate)
        # the request now holds the step lock: the push waits for one step
        await anyio.lowlevel.checkpoint()
        await backend.between_steps(flatten, version=1)
    completion = result["completion"]
    versions = completion.versions
    assert len(versions) == len(completion.token_ids) == 12
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    uniform = -math.log(vocab)
    for version, logprob in zip(versions, completion.logprobs, strict=True):
        # each token's own sampler logprob is that of the weights that drew it
        assert (abs(logprob - uniform) < 1e-4) == (version == 1), (version, logprob)


@pytest.mark.anyio
async def test_a_backend_that_counts_no_versions_reports_none(tokenizer):
    backend = TransformersBackend(tiny_llama(tokenizer), {0}, tokenizer.pad_token_id)
    completion = await backend.generate([5, 6], SamplingParams(max_tokens=3, seed=0))
    assert completion.versions is None


def test_context_tokens_get_version_minus_one_and_a_versionless_turn_drops_them():
    row = TokenRow([1])
    row.append_sampled([2, 3], [-0.5, -0.5], [4, 5])
    row.append_context([9])
    assert row.versions == [4, 5, -1]
    row.append_sampled([7], [-1.0])  # a generator that counted none
    assert row.versions is None


def versioned(episode, versions):
    (row,) = episode.rows
    per_token = [v if mask else -1 for v, mask in zip(versions, row.loss_mask, strict=False)]
    per_token += [-1] * (len(row.loss_mask) - len(per_token))
    return replace(episode, rows=(replace(row, policy_versions=per_token),))


def test_per_token_versions_round_trip_through_the_record_and_reach_the_view(tokenizer):
    episode = scripted_episode(tokenizer, TURNS)
    sampled = episode.rows[0].loss_mask
    versions = [3 if i < len(sampled) // 2 else 4 for i in range(len(sampled))]
    episode = versioned(episode, versions)
    record = EpisodeRecord(episode, {"r": 1.0}, reward=1.0, advantage=0.0, policy_version=3)
    assert record_from_dict(record_to_dict(record)) == record
    view_row = episode_view(record)["rows"][0]
    assert view_row["versions"] == list(episode.rows[0].policy_versions)
    assert episode_version(episode, default=99) == 3


def test_a_record_without_versions_reads_back_none(tokenizer):
    episode = scripted_episode(tokenizer, TURNS)
    record = EpisodeRecord(episode, {"r": 1.0}, reward=1.0, advantage=0.0, policy_version=0)
    data = record_to_dict(record)
    assert "policy_versions" not in data["rows"][0]  # the format of older records
    back = record_from_dict(data)
    assert back.episode.rows[0].policy_versions is None
    assert episode_version(back.episode, default=7) == 7
    assert episode_view(back)["rows"][0]["versions"] is None


def test_a_row_with_versions_of_the_wrong_length_is_refused():
    from rollout import EpisodeRow

    with pytest.raises(ValueError, match="2 versions"):
        EpisodeRow([1], [2, 3, 4], [1, 1, 1], [0.0, 0.0, 0.0], policy_versions=[0, 0])
