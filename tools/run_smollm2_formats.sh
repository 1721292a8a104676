#!/usr/bin/env bash
# Formats table for SmolLM2 (issue "LUT weight formats"): every format as a uniform RTN plan,
# then KL / top-1 / perplexity against the F32 teacher by the llama.cpp protocol.
#   bash tools/run_smollm2_formats.sh OUT_DIR [FORMAT ...]
# The teacher reference is built once in OUT_DIR/ref (forge eval reference --protocol llama-perplexity --full-vocab).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_smollm2_formats.sh OUT_DIR [FORMAT ...]}; shift
formats=${*:-lut4 lut3 lut2 vec2x64 vec2x16 int8}
forge=./target/release/forge
mkdir -p "$out"
[ -d "$out/ref" ] || $forge --threads 2 eval reference --model smollm2 --protocol llama-perplexity --full-vocab --out "$out/ref"
for f in $formats; do
  for rot in ${ROTATIONS:-none mlp,mixer,head}; do
    tag="$f-${rot//,/+}"
    [ -f "$out/$tag.kl.json" ] && continue
    rm -rf "$out/$tag"
    start=$(date +%s)
    $forge --threads 2 quantize --model smollm2 --format "$f" --kv "$f" --head "$f" --rotate "$rot" --output "$out/$tag"
    end=$(date +%s)
    $forge inspect "$out/$tag" --json > "$out/$tag.inspect.json"
    $forge --threads 2 eval kl --ref "$out/ref" --model "$out/$tag" --full-vocab --kl-npy "$out/$tag.kl.npy" --json-out "$out/$tag.kl.json" > /dev/null
    echo "$tag quantize_s=$((end - start))" >> "$out/times.txt"
  done
done
