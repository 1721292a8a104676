#!/usr/bin/env python3
"""Markdown table from tools/bench_smollm2.sh output.

    python3 tools/collect_bench.py OUT_DIR

Forge rows come from `forge bench --json`, llama.cpp rows from `llama-bench -o json` run in the
same session; decode ratios are against llama.cpp's Q4_0 at the same thread count when present.
"""
import glob, json, os, sys

out = sys.argv[1]
rows = []
llama = {}
for f in sorted(glob.glob(os.path.join(out, "llama-*.json"))):
    name = os.path.basename(f)[len("llama-"):-len(".json")]
    tag, th = name.rsplit("-t", 1)
    pp = tg = None
    for r in json.load(open(f)):
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            pp = r["avg_ts"]
        if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            tg = r["avg_ts"]
            size = r.get("model_size")
    llama[(tag, int(th))] = (pp, tg)
    rows.append((int(th), "llama.cpp " + tag, pp, tg, size / 1e6 if size else None, None, None))
for f in sorted(glob.glob(os.path.join(out, "forge-*.json"))):
    name = os.path.basename(f)[len("forge-"):-len(".json")]
    tag, th = name.rsplit("-t", 1)
    try:
        j = json.load(open(f))
    except json.JSONDecodeError:
        continue  # a run still in progress, or one that failed
    split = j.get("decode_split_ms_per_token", {})
    rows.append((int(th), "forge " + tag, j["prefill_tok_s"], j["decode_tok_s"], j["weight_bytes_per_token"] / 1e6,
                 100 * j["bandwidth_fraction"], split))
rows.sort(key=lambda r: (r[0], r[1]))
print("| threads | model | MB/token | prefill tok/s | decode tok/s | decode ÷ llama.cpp Q4_0 | % of read bandwidth | decode ms/token: attention / mlp / head |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for th, tag, pp, tg, mb, bwf, split in rows:
    base = llama.get(("q4_0", th)) or llama.get(("Q4_0", th)) or next((v for k, v in llama.items() if k[1] == th and "q4_0" in k[0].lower()), None)
    ratio = f"{tg / base[1]:.2f}" if base and base[1] and tg else ""
    sp = f"{split.get('attention', 0):.2f} / {split.get('mlp', 0):.2f} / {split.get('head', 0):.2f}" if split else ""
    mbs = f"{mb:.1f}" if mb else ""
    bw = f"{bwf:.0f} %" if bwf is not None else ""
    print(f"| {th} | {tag} | {mbs} | {pp:.1f} | {tg:.1f} | {ratio} | {bw} | {sp} |")
