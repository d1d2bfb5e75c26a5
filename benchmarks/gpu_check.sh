#!/usr/bin/env bash
# The GPU check in one call: the `gpu`-marked tests, then benchmarks/bench_gpu.py within a budget, every result under
# $OUT the moment it exists (a loan that ends early keeps what was measured).
#
# The GPU machine has no network and its own image (python 3.12, a CUDA torch, an older transformers, no TRL or
# datasets; see shared/FACTS.md), so the packages this project needs travel as wheels in .whl/ (git-ignored):
#
#   bash benchmarks/gpu_check.sh download     # here, with network: the wheels into .whl/ (python 3.12, manylinux)
#   bash benchmarks/gpu_check.sh              # there, from the repository root, with $OUT set: install, test, bench
#
# Knobs (environment): TESTS_S (seconds for the gpu tests, 0 skips them; default 150), BENCH_S (the benchmark's
# --budget; default 240, 0 skips it), CASES (bench_gpu.py --cases patterns; default all, in priority order),
# STEPS (timed steps per trainer case; default 5), WORKERS (pytest-xdist processes for the tests; default 8), TESTS
# (pytest's paths and options for the gpu tests, split on spaces; default "tests"), LORA_S (seconds for
# benchmarks/bench_lora.py on 8 layers of Llama-3.1-8B shapes; default 90, 0 skips it), SP_S (seconds for
# benchmarks/bench_sp.py under DeepSpeed Ulysses on every GPU of a machine with two or more; default 180, 0 skips it).
# From a session with the device tool: run `bash benchmarks/gpu_check.sh` with carry [".whl"] and a timeout above
# TESTS_S + BENCH_S + a minute. Files back from $OUT (plain names): environment.txt, install.log, pytest_gpu.txt
# (-rs: every skip's reason), junit_gpu.xml, bench_gpu.md / bench_gpu.json (rewritten after each case),
# bench_gpu.log, bench_lora.md, bench_sp.md (a machine with several GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."

# Only what the GPU image lacks or holds too old (its package list: the device tool's KINDS.md; it has torch 2.11,
# transformers 5.17 -- below our lower bound --, accelerate, peft, pyarrow, pandas, hypothesis, pytest, pytest-xdist,
# einops, tokenizers, safetensors, huggingface-hub, xxhash, fsspec): a call carries at most 64 MiB, and pyarrow alone
# is 55 MB. datasets 4.8.5 (our lower bound) asks pyarrow >= 21 where 5.x asks >= 24; transformers 5.24 asks
# regex >= 2025.10.
WHEELS=(
  "transformers==5.24.0" "trl==1.16.0" "datasets==4.8.5" "peft==0.21.2" "dill==0.4.1" "multiprocess==0.70.19"
  "regex==2026.11.19" "fla-core==0.6.0" "liger-kernel==0.8.5" "pillow==13.0.0"
)

if [[ "${1:-}" == "download" ]]; then
  python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "${WHEELS[@]}" || exit $?
  # DeepSpeed ships source only: its wheel is pure python (the ops compile on first use), built here.
  python -m pip wheel --no-deps -w .whl "deepspeed==0.19.8" "hjson==3.1.0" "ninja==1.13.2" "msgpack==1.2.4"
  exit $?
fi

OUT="${OUT:?set OUT to the folder the results go to}"
TESTS_S="${TESTS_S:-150}"
BENCH_S="${BENCH_S:-240}"
CASES="${CASES:-}"
STEPS="${STEPS:-5}"
WORKERS="${WORKERS:-8}"
LORA_S="${LORA_S:-90}"
SP_S="${SP_S:-180}"
read -r -a TEST_ARGS <<< "${TESTS:-tests}"
mkdir -p "$OUT"
SITE=/tmp/unpack_site
export PYTHONUNBUFFERED=1
{
  nvidia-smi || true
  python -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|accelerate|peft|pyarrow|fsspec|tokenizers|safetensors|huggingface.hub|numpy|pandas|pytest-xdist) "
} > "$OUT/environment.txt" 2>&1

# The carried wheels, without touching the image's own packages (torch stays the image's).
python -m pip install --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH="$SITE:$PWD"
python -c "import transformers, trl, datasets, peft, fla, liger_kernel; print('imports ok', transformers.__version__, trl.__version__)" \
  >> "$OUT/install.log" 2>&1

# 1. Every gpu-marked test (CUDA kernels judged against references built on the GPU), WORKERS processes sharing the
#    GPU (the Triton compiles are what takes the time); -rs names each skip's reason.
if [[ "$TESTS_S" != "0" ]]; then
  parallel=()
  if python -c "import xdist" 2>/dev/null; then parallel=(-n "$WORKERS"); fi
  timeout "$TESTS_S" python -m pytest -p no:cacheprovider -p no:benchmark -m gpu -rs -q --durations=15 --timeout "$TESTS_S" "${parallel[@]}" \
    --junitxml="$OUT/junit_gpu.xml" "${TEST_ARGS[@]}" > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest_gpu.txt"
  tail -n 40 "$OUT/pytest_gpu.txt"
fi

# 2. The benchmark, cases in priority order within BENCH_S seconds; its files are rewritten after each case.
if [[ "$BENCH_S" != "0" ]]; then
  timeout "$((BENCH_S + 30))" python benchmarks/bench_gpu.py --steps "$STEPS" --budget "$BENCH_S" --cases "$CASES" \
    --out "$OUT" > "$OUT/bench_gpu.log" 2>&1
  echo "bench_gpu exit $?" >> "$OUT/bench_gpu.log"
  cat "$OUT/bench_gpu.md" 2>/dev/null || tail -n 40 "$OUT/bench_gpu.log"
fi

# 3. LoRA under autocast, PEFT's casts against ours skipped (8 layers of Llama-3.1-8B shapes, one row of 4,096).
if [[ "$LORA_S" != "0" ]]; then
  timeout "$LORA_S" python benchmarks/bench_lora.py --device cuda --hidden 4096 --intermediate 14336 --layers 8 \
    --vocab 128256 --tokens 4096 --repeats 5 > "$OUT/bench_lora.md" 2>&1
  echo "bench_lora exit $?" >> "$OUT/bench_lora.md"
  tail -n 8 "$OUT/bench_lora.md"
fi

# 4. Sequence parallelism (DeepSpeed Ulysses over NCCL) on every GPU of a machine with two or more: activation memory
#    and step time per GPU for one packed row, ours against stock Ulysses, at sp = 1, 2, ... up to the GPU count.
GPUS="$(nvidia-smi -L 2>/dev/null | wc -l)"
if [[ "$SP_S" != "0" && "$GPUS" -ge 2 ]]; then
  sizes=(1); size=2
  while [[ "$size" -le "$GPUS" ]]; do sizes+=("$size"); size=$((size * 2)); done
  timeout "$SP_S" python benchmarks/bench_sp.py --device cuda --dtype bfloat16 --tokens 32768 --repeats 5 \
    --sp "${sizes[@]}" --out "$OUT/bench_sp.json" > "$OUT/bench_sp.md" 2>&1
  echo "bench_sp exit $?" >> "$OUT/bench_sp.md"
  tail -n 12 "$OUT/bench_sp.md"
fi
