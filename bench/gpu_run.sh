#!/usr/bin/env bash
# The GPU checks on a CUDA machine, from the repository root, after bench/gpu_prepare.sh:
#   OUT=<folder> bash bench/gpu_run.sh [tests] [generation] [step] [sharded] [learner]
# tests: the `gpu` tests and the slot decoder's tests; generation: bench/gpu_generation.py
# (the options worth timing: transformers' continuous batching and the CPU path measured 4x and
# 2x slower on an H100); step: bench/gpu_step.py (agentgrpo against TRL 1.16); sharded: the
# `gpu` tests of tests/end_to_end/test_distributed.py (DeepSpeed ZeRO-2/3 and FSDP2 through
# accelerate, one process each, against a plain process) and bench/sharded_memory.py --gpu
# (SmolLM2-135M-shaped, random weights); learner: bench/learner_memory.py, plain and under FSDP2
# (the loss step's peak, whole logits against chunks; about a minute each on an H100). The
# first three run by default (about 8 minutes in all
# on an H100; a lease also spends minutes starting the machine); `sharded` about 4 more. Each
# part has a time box, so one that hangs leaves time for the others; GPU_DEADLINE (seconds since
# the epoch) shortens every box to end by then, GPU_STEP_BOX shortens the step's. Two runs may
# share a machine at once (the wheels install once). Logs and JSON land in $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
parts=" ${*:-tests generation step} "
here=$(pwd)
# A part's time box: its own seconds, or fewer to end by GPU_DEADLINE.
box() {
  local left=$(( ${GPU_DEADLINE:-9999999999} - $(date +%s) - 5 ))
  (( left < 1 )) && left=1
  echo $(( $1 < left ? $1 : left ))
}
if mkdir /tmp/site.lock 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-bench/whl/*.whl 2>&1 | grep -vi warning | tail -3
  touch /tmp/site.lock/done
fi
while [[ ! -e /tmp/site.lock/done ]]; do sleep 1; done
export PYTHONPATH="$here:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 MPLBACKEND=Agg
# The tests' `smollm2_path` fixture reads the tokenizer from agentgrpo's model cache.
export AGENTGRPO_CACHE=/tmp/agcache
mkdir -p "$AGENTGRPO_CACHE/models/SmolLM2-135M-Instruct" && cp .gpu-bench/tokenizer/* "$AGENTGRPO_CACHE/models/SmolLM2-135M-Instruct/"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' | tee -a "$OUT/gpu.txt"
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"

print(*(f"{name} {version(name)}" for name in ("torch", "transformers", "trl", "accelerate", "deepspeed")))
PY
status=0
if [[ $parts == *" tests "* ]]; then
  timeout $(box 180) python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts="" -m "gpu or not slow" \
    tests/end_to_end/test_gpu.py tests/rollout/backends/test_gpu_generation.py \
    tests/rollout/backends/test_slot_batch.py 2>&1 | tee "$OUT/tests.txt" | tail -15 || status=1
fi
if [[ $parts == *" generation "* ]]; then
  timeout $(box 150) python3 bench/gpu_generation.py --tokenizer .gpu-bench/tokenizer \
    --options slots-graphs,slots-graphs-16,slots-eager,hf-generate --json "$OUT/generation.json" \
    2>&1 | tee "$OUT/generation.txt" | tail -12 || status=1
fi
if [[ $parts == *" step "* ]]; then
  timeout $(box ${GPU_STEP_BOX:-420}) python3 bench/gpu_step.py --tokenizer .gpu-bench/tokenizer ${GPU_STEP_ARGS:-} --json "$OUT/step.json" \
    2>&1 | tee "$OUT/step.txt" | grep -v -i warn | tail -30 || status=1
fi
if [[ $parts == *" learner "* ]]; then
  for sharding in "" --fsdp2; do
    timeout $(box 120) python3 bench/learner_memory.py $sharding 2>&1 \
      | tee -a "$OUT/learner.txt" | tail -9 || status=1
  done
fi
if [[ $parts == *" sharded "* ]]; then
  timeout $(box 240) python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts="" -m gpu \
    tests/end_to_end/test_distributed.py 2>&1 | tee "$OUT/sharded-tests.txt" | tail -10 || status=1
  timeout $(box 200) python3 bench/sharded_memory.py --gpu --config .gpu-bench/tokenizer/config.json \
    --tokenizer .gpu-bench/tokenizer --json "$OUT/sharded.json" 2>&1 | tee "$OUT/sharded.txt" \
    | tail -10 || status=1
fi
exit $status
