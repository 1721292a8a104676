#!/usr/bin/env bash
# Interleaved speed comparison (this machine's speed drifts within minutes, so the headline
# ratios come from runs made back to back): ROUNDS rounds of llama-bench on each GGUF, then
# `forge bench` on each export, prefill / decode tok/s per line.
#   LLAMA_BENCH=path/llama-bench GGUFS="a.gguf b.gguf" EXPORTS="runs/sp-lut4 runs/sp-vec2x64 runs/sp-vec2x64:--no-avx512" \
#     [THREADS=2] [ROUNDS=3] [FORGE=path/forge] bash tools/interleaved_smollm2.sh
# With BASELINE=path/to/an/older/forge (and BASELINE_LABEL, default "baseline"), each round
# ends with that binary on the first export, reported as "<export>-<label>": an older build
# timed in the same rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
th=${THREADS:-2}
forge=${FORGE:-./target/release/forge}
# run_forge BINARY EXPORT FLAG LABEL: one `forge bench` line, "forge LABEL prefill decode".
run_forge() {
  # shellcheck disable=SC2086 # FLAG is one optional word
  "$1" --threads "$th" $3 bench --model "$2" --prompt-tokens 64 --gen-tokens 64 --repeats 3 --json 2>/dev/null |
    python3 -c "
import json, sys
d = json.load(sys.stdin)
print('forge', sys.argv[1], round(d['prefill_tok_s'], 1), round(d['decode_tok_s'], 1))" "$4"
}
for _ in $(seq "${ROUNDS:-3}"); do
  for g in ${GGUFS:?set GGUFS}; do
    "${LLAMA_BENCH:?set LLAMA_BENCH}" -m "$g" -t "$th" -p 64 -n 64 -r 3 -o json 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)
pp = [r['avg_ts'] for r in d if r['n_prompt'] > 0][0]
tg = [r['avg_ts'] for r in d if r['n_gen'] > 0][0]
print('llama.cpp', sys.argv[1], round(pp, 1), round(tg, 1))" "$(basename "$g" .gguf)"
  done
  for e in ${EXPORTS:?set EXPORTS}; do
    # An entry may carry one global flag after a colon: runs/sp-vec2x64:--no-avx512
    m=${e%%:*}; flag=""; [ "$m" != "$e" ] && flag=${e#*:}
    run_forge "$forge" "$m" "$flag" "$(basename "$m")$flag"
  done
  if [ -n "${BASELINE:-}" ]; then
    first=${EXPORTS%% *}; first=${first%%:*}
    run_forge "$BASELINE" "$first" "" "$(basename "$first")-${BASELINE_LABEL:-baseline}"
  fi
done
