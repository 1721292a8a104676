#!/usr/bin/env bash
# Two forge binaries (e.g. the last commit's and this tree's) alternated on one export, the order
# flipped every round, so both see the same machine: `old|new prefill decode` per run, then the
# ratio of the mean decode speeds and the median of the paired ratios.
#   bash tools/ab_binaries.sh OLD_FORGE NEW_FORGE EXPORT [ROUNDS] [THREADS]
set -euo pipefail
old=$1 new=$2 model=$3 rounds=${4:-8} th=${5:-2}
out=$(mktemp)
for r in $(seq 1 "$rounds"); do
    if ((r % 2)); then order=("$new" "$old"); else order=("$old" "$new"); fi
    for b in "${order[@]}"; do
        tag=old; [ "$b" = "$new" ] && tag=new
        "$b" --threads "$th" bench --model "$model" --prompt-tokens 64 --gen-tokens 64 --repeats 3 --json 2>/dev/null |
            python3 -c "import json,sys; d=json.load(sys.stdin); print('$tag', round(d['prefill_tok_s'],1), round(d['decode_tok_s'],1))" | tee -a "$out"
    done
done
python3 - "$out" <<'PY'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
old = [float(r[2]) for r in rows if r[0] == 'old']; new = [float(r[2]) for r in rows if r[0] == 'new']
pairs = [n / o for o, n in zip(old, new)]
print(f"decode: old {st.mean(old):.1f}, new {st.mean(new):.1f} tok/s; ratio of means {st.mean(new)/st.mean(old):.3f}, "
      f"median paired {st.median(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f})")
PY
rm -f "$out"
