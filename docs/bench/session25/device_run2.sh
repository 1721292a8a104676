#!/usr/bin/env bash
# Second run on the 16-core Xeon host: which of its 16 vCPUs share a core (one lut2 kernel
# pinned to CPU 0, alone and next to a second copy pinned to each other CPU in turn), how one
# kernel's speed per thread scales with threads when each thread's share stays in its L2
# (256 rows × 5120 a thread), the kernels from memory at 8 threads, and the 27B shape's decode
# split at 16 threads (mixer cores apart from projections). Outputs go to $OUT as they are made.
# Usage: OUT=dir FORGE=path/to/forge AB=path/to/kernel_ab bash device_run2.sh
set -uo pipefail
F=${FORGE:-target/release/forge}
AB=${AB:-target/release/examples/kernel_ab}
O=${OUT:?}
{ lscpu; grep MHz /proc/cpuinfo; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$c $(cat $c/topology/core_id) $(cat $c/topology/thread_siblings_list)"; done; } > "$O/machine.txt" 2>&1
one() { FORMATS=lut2 RAYON_NUM_THREADS=1 taskset -c "$1" "$AB" 256x5120 1 40 | grep -i lut2 | awk '{print $4}'; }
{
  echo "cpu0 alone: $(one 0)"
  for k in $(seq 1 15); do
    one "$k" > /dev/null &
    p=$!
    echo "cpu0 with cpu$k busy: $(one 0)"
    wait $p
  done
} > "$O/siblings.txt" 2>&1
cat "$O/siblings.txt"
for n in 1 2 4 8 16; do
  echo "== $n threads, $((256 * n))x5120"
  FORMATS=lut4,lut2,vec2x16,vec2x64 RAYON_NUM_THREADS=$n "$AB" $((256 * n))x5120 1 8
done > "$O/scaling.txt" 2>&1
cat "$O/scaling.txt"
timeout 120 "$F" --threads 8 bench --kernels --shape 17408x5120 > "$O/k8.txt" 2>&1
head -8 "$O/k8.txt"
D=$PWD/runs/synth27b
rm -rf "$D"
"$F" synth --shape qwen3.8-27b --output "$D" > "$O/synth.txt" 2>&1 && "$F" compile --model "$D" > "$O/compile.txt" 2>&1
timeout 150 "$F" --threads 16 bench --model "$D" --prompt-tokens 8 --gen-tokens 8 --repeats 3 > "$O/synth27b_t16.txt" 2>&1
tail -12 "$O/synth27b_t16.txt"
