"""Generation backends: token ids in, token ids and sampler logprobs out (`GenerationBackend`).

- `transformers`: a transformers model, batched continuously on this process (`dynamic_batch`,
  `slot_batch`, `generation_rows`, `generation_settings`, `sampling`, `kv_cache`);
- `vllm_colocate` and `vllm_server`: vLLM in this process or behind an OpenAI-compatible server,
  with weight pushes (`vllm_worker`, `weight_transport`); only the `vllm_*` modules import vllm;
- `scripted`: the test double that replays token ids.

Nothing is imported here, so importing one backend never loads another's dependencies.
"""
