#!/usr/bin/env bash
# Everything issue 16 wants run on the lent GPU machine, in one go; results under one directory.
#
#   benchmarks/gpu_machine.sh [OUT_DIR]           # on the GPU machine (torch 2.11 with CUDA installed)
#   TINY=1 benchmarks/gpu_machine.sh /tmp/smoke   # smoke test anywhere: tiny sizes, CPU, seconds
#
# a) benchmarks/gpu_single.py: Trainer("single") vs a raw loop, GPT-2 small, bf16, one GPU (+ checkpointing);
# b) the multi-rank CPU benchmarks at 8 ranks (`shardwise bench`, gloo; 16 cores there: 2 per rank);
# c) tests/gpu (what `make test-gpu` runs; called directly: the Makefile's venv rule pins the CPU torch).
# A failing part is recorded in status.txt and the next part still runs. See docs/gpu.md.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu-$(date +%Y%m%d-%H%M%S)}
PY=${PY:-python}
mkdir -p "$OUT"
: > "$OUT/status.txt"

step() {  # step NAME LOGFILE COMMAND...: run, keep the output, note the exit status
    local name=$1 log=$2; shift 2
    echo "== $name: $*" | tee -a "$OUT/status.txt"
    local start=$SECONDS
    "$@" > "$OUT/$log" 2>&1
    local rc=$?
    echo "   rc=$rc after $((SECONDS - start)) s (log: $log)" | tee -a "$OUT/status.txt"
}

{ nvidia-smi || true; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"; nproc; } > "$OUT/machine.txt" 2>&1

if [ -n "${TINY:-}" ]; then
    step gpu_single gpu_single.txt $PY benchmarks/gpu_single.py --tiny --device cpu --out "$OUT/gpu_single.json"
    step bench_cpu bench_cpu.txt $PY -m shardwise bench --pairs allreduce --nproc 2 --reps 1 --steps 2 \
        --plot "$OUT/bench_plots"
    step test_gpu test_gpu.txt $PY -m pytest -q tests/gpu -rs
else
    step gpu_single gpu_single.txt $PY benchmarks/gpu_single.py --out "$OUT/gpu_single.json"
    step bench_cpu8 bench_cpu8.txt $PY -m shardwise bench --pairs all --nproc 8 --accelerator cpu \
        --plot "$OUT/bench_plots"
    step test_gpu test_gpu.txt $PY -m pytest -q tests/gpu -rs
fi
echo "results in $OUT"
