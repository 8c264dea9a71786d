#!/usr/bin/env bash
# The GPU checks as one prepared run, for a machine with an NVIDIA GPU and MAX installed
# (on the device tool's machine: after `install.sh`, with PYTHONPATH=/tmp/site:$PWD).
#     bash benchmarks/gpu_check.sh OUT_DIR            # gpu tier, then the benchmark
#     bash benchmarks/gpu_check.sh OUT_DIR tier       # gpu tier only
# The gpu tier compiles about four graphs (bfloat16 and float32 models, the echo
# server's, the sampler's), a few minutes each the first time.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [tier|bench]}
what=${2:-all}
mkdir -p "$out"
export MODULAR_TELEMETRY_ENABLED=${MODULAR_TELEMETRY_ENABLED:-0} MAX_SERVE_DISABLE_TELEMETRY=${MAX_SERVE_DISABLE_TELEMETRY:-1}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
if [ "$what" != bench ]; then
  start=$SECONDS
  python3 -m pytest -m gpu tests/gpu -q -rA --durations=0 \
    --junitxml="$out/gpu-tier.xml" -o junit_logging=all >"$out/gpu-tier.log" 2>&1
  echo "gpu tier: rc=$? in $((SECONDS - start)) s" | tee -a "$out/gpu-tier.log"
fi
if [ "$what" != tier ]; then
  PYTHONPATH="$PWD/benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_gpu.py \
    --out "$out/bench-gpu.json" >"$out/bench-gpu.log" 2>&1
  echo "bench: rc=$?" | tee -a "$out/bench-gpu.log"
fi
