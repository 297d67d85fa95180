#!/usr/bin/env bash
# The GPU numbers, in one run inside 10 minutes on one GPU (see benchmarks/gpu.py for what it measures):
# exactness of the Triton path against PyTorch ops on the device, a saved step under
# torch.cuda.set_sync_debug_mode("error") (the step's one copy excepted), and GPT-2 124M from its
# config in bf16 autocast at a batch that fills the GPU: the plain loop against weights+gradients
# every step and with activations, on each path, interleaved.
#
#   OUT=/some/folder bash benchmarks/gpu.sh            # results: $OUT/gpu.json, gpu.txt, gpu.log, env.txt
#   bash benchmarks/gpu.sh --budget-s 120              # extra arguments go to benchmarks/gpu.py
#   bash benchmarks/gpu.sh --dry-run                   # a tiny GPT-2 on the CPU: checks the script
#
# It needs a Python with torch (CUDA), triton, numpy and transformers, and nothing from the network:
# tensorlens is installed from this checkout without its dependencies (or put on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not found"
    "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
    "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1
} >"$OUT/env.txt" 2>&1

# tensorlens from this checkout: installed (no dependencies, nothing fetched) where it is not importable yet
if ! "$PY" -c "import tensorlens" >/dev/null 2>&1; then
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
        echo "pip install -e . failed (see install.log): using PYTHONPATH" | tee -a "$OUT/install.log"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
"$PY" -c "import tensorlens, tensorlens.stats.path as p, torch; print('tensorlens', tensorlens.__version__, 'from', tensorlens.__file__); print('path on cuda:', p.path_for(torch.device('cuda')))" >>"$OUT/env.txt" 2>&1

# 560 s: the whole run stays inside 10 minutes with the start-up above; gpu.py saves after each part
timeout 560 "$PY" benchmarks/gpu.py --out "$OUT" --budget-s 240 "$@" 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
echo "benchmarks/gpu.py exited with $status; results in $OUT" | tee -a "$OUT/gpu.log"
exit "$status"
