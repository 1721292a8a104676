#!/usr/bin/env bash
# One run on a second machine (the 16-core host of a GPU box, lent for minutes): the kernels on
# the 27B MLP matrix at 16 and 2 threads, then the 27B shape synthesized, compiled and
# decoded at 16 threads. Every output goes to $OUT as it is made, so a run cut short keeps what
# it finished. Usage: OUT=dir FORGE=path/to/forge bash device_run.sh
set -uo pipefail
F=${FORGE:-target/release/forge}
O=${OUT:?}
{ lscpu; nproc; free -g; df -h .; } > "$O/machine.txt" 2>&1
grep -m1 "model name" /proc/cpuinfo
"$F" --version || exit 1
for th in 16 2; do
  timeout 120 "$F" --threads $th bench --kernels --shape 17408x5120 > "$O/kernels_17408x5120_t$th.txt" 2>&1
  tail -14 "$O/kernels_17408x5120_t$th.txt"
done
D=$PWD/runs/synth27b
rm -rf "$D"
{ time "$F" synth --shape qwen3.8-27b --output "$D"; } > "$O/synth.txt" 2>&1; tail -3 "$O/synth.txt"
{ time "$F" compile --model "$D"; } > "$O/compile.txt" 2>&1; tail -3 "$O/compile.txt"
timeout 150 "$F" --threads 16 bench --model "$D" --prompt-tokens 8 --gen-tokens 8 --repeats 3 > "$O/synth27b_t16.txt" 2>&1
tail -30 "$O/synth27b_t16.txt"
timeout 120 "$F" --threads 16 bench --model "$D" --prompt-tokens 8 --gen-tokens 8 --repeats 3 --json > "$O/synth27b_t16.json" 2>&1
tail -c 600 "$O/synth27b_t16.json"
