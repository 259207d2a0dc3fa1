"""What agent runs leave behind, checked against the episodes the run trained on."""

from __future__ import annotations

import json
from pathlib import Path

from rollout import read_records


def assert_replies_were_trained_on(replies_file: Path, episodes_dir: Path) -> int:
    """Every reply's token ids appear, mask 1 with its logprobs, in some recorded row.

    Episodes that sampled the same tokens (greedy decoding) may differ in their logprobs'
    last digits (batches of other sizes), so a reply need only match one of them exactly.
    """
    replies = [json.loads(line) for line in replies_file.read_text().splitlines()]
    rows = [
        row for path in episodes_dir.glob("*.jsonl") for r in read_records(path)
        for row in r.episode.rows
    ]  # fmt: skip
    for reply in replies:
        ids = reply["choices"][0]["token_ids"]
        prompt = reply["prompt_token_ids"]
        logprobs = reply["choices"][0].get("logprobs")
        sent = [t["logprob"] for t in logprobs["content"]] if logprobs else None
        matches = [
            row for row in rows
            if (row.prompt_ids + row.completion_ids)[len(prompt) : len(prompt) + len(ids)] == ids
            and (row.prompt_ids + row.completion_ids)[: len(prompt)] == prompt
        ]  # fmt: skip
        assert matches, f"reply {reply['choices'][0]['message']} is in no recorded row"
        for row in matches:
            start = len(prompt) - len(row.prompt_ids)
            assert row.loss_mask[start : start + len(ids)] == [1] * len(ids)
        assert sent is None or any(
            row.sampler_logprobs[start : start + len(ids)] == sent
            for row in matches
            if (start := len(prompt) - len(row.prompt_ids)) >= 0
        ), f"reply {reply['choices'][0]['message']} was recorded with other logprobs"
    return len(replies)
