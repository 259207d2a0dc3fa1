"""Loading new weights into a running vLLM worker, in process and through a server.

`load_weights` is the one way agentgrpo changes a vLLM model's weights; the colocated backend
calls it directly and `WeightReceiver` (a worker extension: `--worker-extension-cls
rollout.backends.vllm_worker.WeightReceiver`, which `agentgrpo vllm-serve` passes) calls it with
tensors broadcast from the trainer. Both must:

- go through the worker's `reload_weights`: on CPU vLLM packs each linear layer into a oneDNN
  handle and leaves the parameter empty, so a plain `model.load_weights` fails there;
- re-process a tied `lm_head`: on CPU it keeps its own packed copy of the embeddings, which a
  reload without an `lm_head.weight` entry (a saved tied checkpoint has none) leaves stale, and
  the sampled logprobs then drift far from the trainer's (a no-op on GPU);
- treat a failure as fatal: a reload that stops half-way leaves layers on the `meta` device.

The prefix cache is reset by the caller (the engine owns it), after every push.

This module never imports vllm: it only calls methods of the worker vLLM hands it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from rollout.backends.weight_transport import WeightGroup


def load_weights(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Reload `worker`'s model from `(checkpoint name, tensor)` pairs, in place.

    Names are those of the Hugging Face checkpoint (`model.layers.0.self_attn.q_proj.weight`);
    vLLM fuses, shards and packs them itself. The iterator is always exhausted.
    """
    tensors = iter(named_tensors)
    try:
        worker.reload_weights(weights_iterator=tensors)
    finally:
        for _ in tensors:  # names the model skips must still be received
            pass
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    quant_method = getattr(head, "quant_method", None)
    if _ties_embeddings(worker) and quant_method is not None:
        quant_method.process_weights_after_loading(head)


def _ties_embeddings(worker: Any) -> bool:
    config = worker.model_runner.model_config.hf_config
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


class WeightReceiver:
    """vLLM worker extension: receives the trainer's weight broadcasts.

    vLLM mixes this class into each worker. The trainer calls its methods through the server's
    `POST /collective_rpc` (which `VLLM_SERVER_DEV_MODE=1` enables), with JSON-encoded string
    arguments, the only kind that endpoint forwards.
    """

    # The vLLM worker this class is mixed into sets these (`lora_config`: None without LoRA).
    device: torch.device
    rank: int
    lora_config: Any
    _agentgrpo_group: WeightGroup | None

    def agentgrpo_ready(self) -> bool:
        """Answer True: the server was started with this extension."""
        return True

    def agentgrpo_lora_limits(self) -> str:
        """The server's LoRA limits, as JSON.

        `{"max_lora_rank": R, "max_loras": N}`, or `null` when it was started without
        `--enable-lora` (adapter pushes cannot go to it).
        """
        config = getattr(self, "lora_config", None)
        if config is None:
            return "null"
        return json.dumps({"max_lora_rank": config.max_lora_rank, "max_loras": config.max_loras})

    def agentgrpo_join(self, options_json: str) -> None:
        """Join the weight group (blocks until the trainer joins too).

        `options_json` holds `port`, `world_size`, `timeout_s`, the join's `secret` and the
        trainer's `backend`:
        over "nccl" this worker receives on its GPU, over "gloo" on the CPU (vLLM copies the
        tensors to the model's device as it loads them). This worker's rank in the group is its
        rank in vLLM; rank 0 hosts the group's store, which listens on every interface, and the
        other workers (same machine) reach it on the loopback address.
        """
        options = json.loads(options_json)
        device = self.device if options["backend"] == "nccl" else torch.device("cpu")
        self._agentgrpo_group = None  # a trainer that rejoins: free the port first
        self._agentgrpo_group = WeightGroup(
            "127.0.0.1",
            options["port"],
            self.rank,
            options["world_size"],
            device,
            options["timeout_s"],
            options["secret"],
        )

    def agentgrpo_receive(self, specs_json: str) -> None:
        """Receive one push (the trainer broadcasts the tensors `specs_json` lists) and load it."""
        specs = json.loads(specs_json)
        group = getattr(self, "_agentgrpo_group", None)
        if group is None:
            raise RuntimeError("agentgrpo_receive before agentgrpo_join: join the weight group")
        load_weights(self, group.receive(specs))
