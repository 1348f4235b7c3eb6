#!/usr/bin/env bash
# The prepared NVIDIA run (one short script; CI never runs it): does the device run DPara's backbone
# pass beside the target's verification forward, and what does that do to a round and to tokens/s?
#
#   1. python -m tools.bench_critical_path (after 2, reading its τ): DSpark vs DPara per stage in jitted loops, including the
#      verification forward and the backbone pass in one program (the overlap the device gives);
#   2. python -m tools.bench: ar / dspark chain=8 / dpara chain=8 greedy rows (τ, tokens/s, greedy check);
#   3. python -m tools.bench_kernels --quick: the Pallas kernels compiled for this GPU (Triton).
#
# Uses the python3 that has JAX with CUDA (the device image's), or $PYTHON. Writes into $OUT (the
# device tool's folder) or bench/gpu. About 4 minutes on an H200 with a warm start.
#
#   bash tools/bench_gpu.sh                    # on the GPU machine, from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-bench/gpu}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
$PY -c 'import jax; d = jax.devices()[0]; print("devices:", jax.devices()); assert d.platform == "gpu", "no GPU: this script measures the overlap on one"'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$DEST/gpu.txt" || true
$PY -m tools.bench --methods "ar,dspark chain=8,dpara chain=8,dpara chain=8 boundaries=2,dpara chain=8 boundaries=4" --prompts 8 --repeats 2 --no-draft-ms \
    --out "$DEST/bench_spec_dpara_gpu" 2>&1 | tail -n 12
$PY -m tools.bench_critical_path --repeats 3 --boundaries 2,4 --bench "$DEST/bench_spec_dpara_gpu.json" \
    --out "$DEST/critical_path_gpu" 2>&1 | tail -n 3
$PY -m tools.bench_kernels --quick --out "$DEST/kernels_gpu" 2>&1 | tail -n 5 || echo "kernels: see above"
cat "$DEST/critical_path_gpu.md"
