"""Peak memory per process, train time and equality with one process, for each accelerate engine.

Every engine runs the same two GRPO steps of `tests/scripts/distributed_train.py
--fixed-completions`: 8 episodes a step per process, whose completions are fixed token ids, so
every run trains on the same episodes; a KL term with `sync_ref_model`, so the reference model
takes part; AdamW; float32.
`one` is a plain process playing every row; the others run under `accelerate launch` with
`examples/accelerate/{ddp,deepspeed_zero2,deepspeed_zero3,fsdp2}.yaml`, in float32
(`--mixed_precision no`).

- On the CPU (default): 2 processes, one thread each; FSDP2 through the script's
  `--fsdp-over-gloo` (accelerate picks FSDP only on GPUs). Memory is each process's peak
  resident memory (`ru_maxrss`), Python, torch and transformers included.
- `--gpu`: one process per engine on the first GPU (`--processes` for more); memory is each
  process's peak allocated GPU memory (`torch.cuda.max_memory_allocated`).

It prints, per engine, the largest per-process peak, the time in `trainer.train()` (the slowest
process), how many of the reference model's weights a process holds at the end (ZeRO-3 shards
it), and the largest absolute difference of the trained weights from `one`'s.

    python bench/sharded_memory.py                       # SmolLM2-135M-Instruct, the default model
    python bench/sharded_memory.py --gpu --config bench/configs/qwen2.5-0.5b.json --tokenizer DIR

`--config` builds a model with random weights (seed 0) from a config file and a tokenizer folder
(no weights travel); `--model DIR` trains a saved one. `--json FILE` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = ROOT / "tests" / "scripts" / "distributed_train.py"
CONFIGS = ROOT / "examples" / "accelerate"
ENGINES = ("one", "ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp2")
RUN_ARGS = ("--fixed-completions", "--beta", "0.5", "--sync-ref-model")
# A weight "equals" one process's within this. AdamW's first steps move each weight by about
# the learning rate whatever its gradient's size, so a weight whose gradient is rounding noise
# (e.g. the embedding rows of tokens no episode holds) may move either way: the max difference
# can be 2 x lr while almost every weight agrees.
CLOSE = 1e-5
PER_DEVICE_BATCH = 4  # episodes a micro-batch per process; `one` plays every process's
TIMEOUT_S = 1800


def main() -> None:
    cli = _parse()
    with tempfile.TemporaryDirectory(prefix="sharded-memory-") as work:
        model_dir = cli.model or _random_model(cli.config, cli.tokenizer, Path(work) / "model")
        rows = [_run(engine, model_dir, Path(work) / engine, cli) for engine in cli.engines]
        if "one" in cli.engines:
            alone = Path(work) / "one" / "weights.pt"
            for row in rows:
                row.update(_differences(Path(row["out_dir"]), alone))
    _print(rows, cli)
    if cli.json:
        Path(cli.json).write_text(json.dumps(rows, indent=1))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a saved causal LM with its tokenizer")
    source.add_argument("--config", help="a model config (JSON): random weights, seed 0")
    parser.add_argument("--tokenizer", help="the tokenizer folder for --config")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU(s)")
    parser.add_argument("--processes", type=int, help="default: 2 on the CPU, 1 on a GPU")
    parser.add_argument("--json", help="write the rows to this file")
    cli = parser.parse_args()
    if cli.config and not cli.tokenizer:
        parser.error("--config needs --tokenizer DIR")
    if not cli.model and not cli.config:
        from agentgrpo.models.default_model import default_model_path

        cli.model = str(default_model_path())
    cli.engines = cli.engines.split(",")
    unknown = set(cli.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    cli.processes = cli.processes or (1 if cli.gpu else 2)
    return cli


def _random_model(config: str, tokenizer: str, out: Path) -> str:
    """A model with random weights (seed 0) built from `config`, saved with `tokenizer`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_config = AutoConfig.from_pretrained(config)
    AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return str(out)


def _run(engine: str, model_dir: str, out_dir: Path, cli: argparse.Namespace) -> dict[str, Any]:
    """Run one engine; its row, read from the processes' reports."""
    processes = 1 if engine == "one" else cli.processes
    batch = PER_DEVICE_BATCH * cli.processes // processes
    script_args = [model_dir, str(out_dir), *RUN_ARGS, "--per-device-batch", str(batch)]
    if cli.gpu:
        script_args.append("--gpu")
    elif engine == "fsdp2":
        script_args.append("--fsdp-over-gloo")
    if engine == "one":
        command = [sys.executable, str(SCRIPT), *script_args]
    else:
        command = [
            *(sys.executable, "-m", "accelerate.commands.launch"),
            *("--config_file", str(CONFIGS / f"{engine}.yaml")),
            *("--num_processes", str(processes), "--mixed_precision", "no", str(SCRIPT)),
            *script_args,
        ]
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    if not cli.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"{engine}: {processes} process(es)", flush=True)
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if done.returncode != 0:
        output = done.stdout[-2000:] + done.stderr[-4000:]
        raise SystemExit(f"{engine} failed (exit {done.returncode}):\n{output}")
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("process_*.json"))]
    memory = "max_gpu_mib" if cli.gpu else "max_rss_mib"
    return {
        "engine": engine,
        "processes": processes,
        "distributed_type": reports[0]["distributed_type"],
        "peak_mib_per_process": max(r[memory] for r in reports),
        "memory": memory,
        "train_s": max(r["train_s"] for r in reports),
        "reference_elements_held": max(r["reference_elements_held"] for r in reports),
        "out_dir": str(out_dir),
    }


def _differences(out_dir: Path, alone: Path) -> dict[str, float]:
    """How far the trained weights are from one process's: largest gap, share within CLOSE."""
    import torch

    trained, reference = torch.load(out_dir / "weights.pt"), torch.load(alone)
    gaps = torch.cat([(trained[name] - w).abs().flatten() for name, w in reference.items()])
    return {
        "max_abs_diff_from_one": gaps.max().item(),
        "share_close": (gaps <= CLOSE).float().mean().item(),
    }


def _print(rows: list[dict[str, Any]], cli: argparse.Namespace) -> None:
    where = "GPU" if cli.gpu else "CPU"
    memory = "peak GPU memory allocated" if cli.gpu else "peak resident memory"
    print(
        f"\n| engine ({where}) | processes | {memory} per process | train s "
        f"| reference weights held per process | max abs diff from one "
        f"| weights within {CLOSE:g} of one |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        gib = row["peak_mib_per_process"] / 1024
        difference = f"{row['max_abs_diff_from_one']:.1e}" if "share_close" in row else "-"
        close = f"{100 * row['share_close']:.4f}%" if "share_close" in row else "-"
        print(
            f"| {row['engine']} | {row['processes']} | {gib:.2f} GiB | "
            f"{row['train_s']:.0f} | {row['reference_elements_held'] / 1e6:.1f}M | "
            f"{difference} | {close} |"
        )
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
