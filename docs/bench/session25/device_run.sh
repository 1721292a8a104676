#!/usr/bin/env bash
# One run on the 16-core Xeon host of a GPU box (lent for minutes): per-core kernel speed in L2
# (one thread, 256x5120) and in L3 (16 threads, 4096x5120), the kernels on the 27B MLP matrix
# from memory at 16 threads (twice), then the 27B shape synthesized, compiled and decoded at 16
# threads. Outputs go to $OUT as they are made, so a run cut short keeps what it finished.
# Usage: OUT=dir FORGE=path/to/forge AB=path/to/kernel_ab bash device_run.sh
set -uo pipefail
F=${FORGE:-target/release/forge}
AB=${AB:-target/release/examples/kernel_ab}
O=${OUT:?}
{ lscpu; nproc; free -g; } > "$O/machine.txt" 2>&1
grep -m1 "model name" /proc/cpuinfo
"$F" --version || exit 1
RAYON_NUM_THREADS=1 timeout 60 "$AB" 256x5120 1 8 > "$O/ab_l2_t1.txt" 2>&1; cat "$O/ab_l2_t1.txt"
RAYON_NUM_THREADS=16 timeout 60 "$AB" 4096x5120 1 8 > "$O/ab_l3_t16.txt" 2>&1; cat "$O/ab_l3_t16.txt"
for r in 1 2; do
  timeout 120 "$F" --threads 16 bench --kernels --shape 17408x5120 > "$O/k16_$r.txt" 2>&1
  tail -8 "$O/k16_$r.txt" | head -7
done
D=$PWD/runs/synth27b
rm -rf "$D"
{ time "$F" synth --shape qwen3.8-27b --output "$D"; } > "$O/synth.txt" 2>&1; tail -3 "$O/synth.txt"
{ time "$F" compile --model "$D"; } > "$O/compile.txt" 2>&1; tail -3 "$O/compile.txt"
timeout 150 "$F" --threads 16 bench --model "$D" --prompt-tokens 8 --gen-tokens 8 --repeats 3 > "$O/synth27b_t16.txt" 2>&1
tail -20 "$O/synth27b_t16.txt"
