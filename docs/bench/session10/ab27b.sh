#!/bin/bash
# Alternated 27B decode: previous binary (nibble vec2x64, v2 cache) vs this session's (six-bit, v3 cache).
for r in 1 2 3; do
  /work/runs/forge-a86942f --threads 2 bench --model /work/runs/synth27b --prompt-tokens 8 --gen-tokens 8 --repeats 3 --json > bench27b_ab_prev_$r.json 2>/dev/null
  /work/main/target/release/forge --threads 2 bench --model /work/runs/synth27b_v3 --prompt-tokens 8 --gen-tokens 8 --repeats 3 --json > bench27b_ab_new_$r.json 2>/dev/null
done
