#!/usr/bin/env bash
# The GPU checks as one prepared run, for a machine with an NVIDIA GPU and MAX installed
# (on the device tool's machine: after `install.sh`, with PYTHONPATH=/tmp/site:$PWD).
#     bash benchmarks/gpu_check.sh OUT_DIR [SECONDS] [BENCH_ARGS...]
# runs the `gpu` tier, then `bench_gpu.py` (bfloat16, batch 1 and 64, with graph capture,
# warm `max serve` variants below; BENCH_ARGS replace these), all within SECONDS (default
# 3600): each step is interrupted (SIGINT, so pytest still writes its report) when its
# time is up, and every step writes its results into OUT_DIR as it goes. The benchmark's
# share is the last BENCH_SECONDS (default 240).
#
# SIZES: which sizes `tests/gpu/test_sizes.py` serves after the tier (below);
# PRECOMPILED: graphs compiled on another machine (below).
#
# The tier compiles two small graphs (bfloat16 and float32), each for minutes, so its
# float32 test runs in a pytest of its own beside the rest, as do the parity tests at
# the gpt2 and gpt2-xl shapes (four more graphs); meanwhile a throwaway run
# of the benchmark fills MAX's cache with the benchmark's graph, so the timed run that
# follows (with nothing else running) starts warm.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [SECONDS] [BENCH_ARGS...]}
deadline=$((SECONDS + ${2:-3600}))
shift $(($# < 2 ? $# : 2))
bench_args=("$@")
# The served variants, every batch logged: the default (no bursts on a GPU), then
# probes of the gpt2-small server that crashed at its second request on the H200
# (benchmarks/results/2026-11-26-gpu-h200-second-run-the-head-bug.md): MAX's
# device-sync mode (names the failing kernel), prefix caching and chunked prefill off
# (AutoModel's settings, where the same graph ran), MAX's legacy KV cache; last,
# decode bursts of 8 and MAX's device graph capture (which brings its overlap scheduler).
k1="GPT2_MAX_DECODE_STEPS=1 MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S=0"
variants="k1:$k1,device-sync:$k1 MODULAR_DEBUG=device-sync-mode"
variants+=",no-prefix-cache:$k1 --no-enable-prefix-caching --no-enable-chunked-prefill"
variants+=",legacy-kv:$k1 MODULAR_USE_LEGACY_KV_CACHE=1"
variants+=",k8:GPT2_MAX_DECODE_STEPS=8 MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S=0"
variants+=",capture:$k1 --device-graph-capture"
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--dtypes bfloat16 --batch-sizes 1,64 --capture --starts warm \
  --serve-variants "$variants" --repeat 2)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MODULAR_TELEMETRY_ENABLED=${MODULAR_TELEMETRY_ENABLED:-0} \
  MAX_SERVE_DISABLE_TELEMETRY=${MAX_SERVE_DISABLE_TELEMETRY:-1}
bench=(env PYTHONPATH="$PWD/benchmarks:${PYTHONPATH:-}" python3 benchmarks/bench_gpu.py)
left() { local s=$((deadline - SECONDS - ${1:-0})); echo $((s > 1 ? s : 1)); }  # timeout 0: none

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|Model:|CPU family|Flags'; \
  python3 -c 'from importlib.metadata import version as v; print(*(f"{p} {v(p)}" for p in ("max", "torch", "transformers")))'; } >"$out/machine.txt" 2>&1
# What the tier's clients need beyond MAX, checked before minutes of compiling:
# an OpenAI client (its HTTP stack imports `truststore`) and the package itself.
if ! python3 -c 'import openai, gpt2_max.arch; openai.OpenAI(base_url="http://127.0.0.1:9", api_key="-")' \
    >>"$out/machine.txt" 2>&1; then
  echo "preflight failed: $(tail -1 "$out/machine.txt")"; exit 1
fi

# Graphs compiled on another machine for this card (`benchmarks/gpu_precompile.py`), put in
# MAX's cache before the first start (PRECOMPILED=the .tar.xz); the end lists the graphs
# the card compiled itself, each a model whose graph differs from the one built there.
mef=$(python3 -c 'from gpt2_max.max_cache import max_cache_dir; print(max_cache_dir())')
[ -n "$mef" ] || { echo "preflight failed: MAX's cache folder not found"; exit 1; }
mef=$mef/.max_cache/mof/mef
graphs() { ls "$mef"/*/* 2>/dev/null | sort; }  # the compiled graphs in MAX's cache
if [ -n "${PRECOMPILED:-}" ]; then
  mkdir -p "$mef" && tar xJf "$PRECOMPILED" -C "$mef" \
    && echo "precompiled: $(graphs | wc -l) graphs in MAX's cache from $PRECOMPILED" >>"$out/machine.txt"
fi
compiled_here() { graphs | comm -13 "$out/mef-before.txt" - >"$out/mef-compiled-here.txt"; }
graphs >"$out/mef-before.txt"

"${bench[@]}" "${bench_args[@]}" --new-tokens 2 --repeat 1 --peers "" --no-serve >"$out/warm.log" 2>&1 &
warm=$!

start=$SECONDS
tier() {  # tier NAME PYTEST_ARGS...: the tier's tests named, interrupted at the tier's share
  local name=$1; shift
  timeout -s INT -k 30 "$(left "${BENCH_SECONDS:-240}")" python3 -m pytest -m gpu "$@" -v -rA --durations=0 \
    -o tmp_path_retention_count=10 \
    --junitxml="$out/$name.xml" -o junit_logging=all >"$out/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$out/$name.log"
}
tier gpu-tier-float32 tests/gpu/test_parity.py -k "float32 and not family" &
float32=$!
tier gpu-tier-family tests/gpu/test_parity.py -k family &  # the gpt2 and xl shapes
family=$!
tier gpu-tier tests/gpu --ignore=tests/gpu/test_sizes.py -k "not float32 and not family"
wait "$float32" "$family"
# Every size as typed, one server at a time (each takes MAX's share of the card): the
# sizes SIZES names (a `-k` expression, as "distilgpt2 or xl"; "all"), none by default.
if [ -n "${SIZES:-}" ]; then
  pick=(); [ "$SIZES" = all ] || pick=(-k "$SIZES")
  tier gpu-sizes tests/gpu/test_sizes.py ${pick[@]+"${pick[@]}"}
fi
for log in /tmp/pytest-of-*/pytest-*/gpu-serve*/server.log; do  # each tier server's log
  [ -f "$log" ] && cp "$log" "$out/$(basename "$(dirname "$log")").log"
done

compiled_here
wait "$warm"; echo "cache fill: rc=$? at $((SECONDS - start)) s" | tee -a "$out/warm.log"
start=$SECONDS
timeout -s INT -k 20 "$(left 10)" "${bench[@]}" "${bench_args[@]}" --out "$out/bench-gpu.json" \
  >"$out/bench-gpu.log" 2>&1
echo "bench: rc=$? in $((SECONDS - start)) s" | tee -a "$out/bench-gpu.log"
compiled_here
