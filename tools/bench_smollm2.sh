#!/usr/bin/env bash
# Speed table for SmolLM2 (issue "Fast CPU kernels"): every export in RUN_DIR/sp-* (and the f32
# teacher) compiled and benchmarked with 1 and 2 threads, two activation planes and one
# (`--act16`), plus llama.cpp's llama-bench on the same machine in the same run when LLAMA_BENCH
# and GGUF files are given. JSON per run in OUT_DIR; tools/collect_bench.py makes the table.
#   LLAMA_BENCH=path/llama-bench GGUFS="a.gguf b.gguf" bash tools/bench_smollm2.sh RUN_DIR OUT_DIR
# THREADS="2" limits the thread counts (default "1 2").
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: bench_smollm2.sh RUN_DIR OUT_DIR}
out=${2:?usage: bench_smollm2.sh RUN_DIR OUT_DIR}
forge=./target/release/forge
mkdir -p "$out"
models=(smollm2)
for d in "$run"/sp-*; do
  [ -f "$d/forge.json" ] || continue
  $forge compile --model "$d" > /dev/null
  models+=("$d")
done
for th in ${THREADS:-1 2}; do
  if [ -n "${LLAMA_BENCH:-}" ]; then
    for g in ${GGUFS:-}; do
      "$LLAMA_BENCH" -m "$g" -t "$th" -p 64 -n 64 -r 5 -o json > "$out/llama-$(basename "$g" .gguf)-t$th.json"
    done
  fi
  for m in "${models[@]}"; do
    tag=$(basename "$m")
    $forge --threads "$th" bench --model "$m" --prompt-tokens 64 --gen-tokens 64 --repeats 5 --json \
      > "$out/forge-$tag-t$th.json"
    [ "$m" = smollm2 ] && continue
    $forge --threads "$th" --act16 bench --model "$m" --prompt-tokens 64 --gen-tokens 64 --repeats 5 --json \
      > "$out/forge-$tag-act16-t$th.json"
  done
done
