#!/usr/bin/env bash
# The GPU check of issue 26 in one call: the `gpu`-marked tests and benchmarks/bench_gpu.py, every result under $OUT.
#
# The GPU machine has no network and its own image (python 3.12, a CUDA torch, an older transformers, no TRL or
# datasets; see shared/FACTS.md), so the packages this project needs travel as wheels in .whl/ (git-ignored):
#
#   bash benchmarks/gpu_check.sh download     # here, with network: the wheels into .whl/ (python 3.12, manylinux)
#   bash benchmarks/gpu_check.sh              # there, from the repository root, with $OUT set: install, test, bench
#
# From a session with the device tool: run `bash benchmarks/gpu_check.sh` with carry [".whl"] and a timeout that
# leaves time for a rerun; the files come back from $OUT: pytest_gpu.txt (the gpu tests, -rs: every skip's reason),
# junit_gpu.xml, bench_gpu.md / bench_gpu.json (the tables), environment.txt, and the log of each step.
set -uo pipefail
cd "$(dirname "$0")/.."

# Only what the GPU image lacks or holds too old (its package list: the device tool's KINDS.md; it has torch 2.11,
# transformers 5.17 -- below our lower bound --, accelerate, peft, pyarrow, pandas, hypothesis, pytest, einops,
# tokenizers, safetensors, huggingface-hub, xxhash, fsspec): a call carries at most 64 MiB, and pyarrow alone is 55 MB.
# datasets 4.8.5 (our lower bound) asks pyarrow >= 21 where 5.x asks >= 24; transformers 5.24 asks regex >= 2025.10.
WHEELS=(
  "transformers==5.24.0" "trl==1.16.0" "datasets==4.8.5" "peft==0.21.2" "dill==0.4.1" "multiprocess==0.70.19"
  "regex==2026.11.19" "fla-core==0.6.0" "liger-kernel==0.8.5"
)

if [[ "${1:-}" == "download" ]]; then
  python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "${WHEELS[@]}"
  exit $?
fi

OUT="${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
SITE=/tmp/unpack_site
{
  nvidia-smi || true
  python -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|accelerate|peft|pyarrow|fsspec|tokenizers|safetensors|huggingface.hub|numpy|pandas) "
} > "$OUT/environment.txt" 2>&1

# The carried wheels, without touching the image's own packages (torch stays the image's).
python -m pip install --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH="$SITE:$PWD"
python -c "import transformers, trl, datasets, peft, fla, liger_kernel; print('imports ok', transformers.__version__, trl.__version__)" \
  >> "$OUT/install.log" 2>&1

# 1. Every gpu-marked test (CUDA kernels judged against references built on the GPU); -rs names each skip's reason.
timeout 420 python -m pytest -p no:cacheprovider -m gpu -rs -q --junitxml="$OUT/junit_gpu.xml" tests \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_gpu.txt"

# 2. The benchmark: trainer table (both precision set-ups), attention alone at 8k / 64k, RoPE against Liger.
timeout 420 python benchmarks/bench_gpu.py --steps 5 --out "$OUT" > "$OUT/bench_gpu.log" 2>&1
echo "bench_gpu exit $?" >> "$OUT/bench_gpu.log"
tail -n 80 "$OUT/pytest_gpu.txt"
cat "$OUT/bench_gpu.md" 2>/dev/null || tail -n 40 "$OUT/bench_gpu.log"
