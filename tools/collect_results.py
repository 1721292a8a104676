#!/usr/bin/env python3
"""Markdown table of SmolLM2 quantization results from a run directory.

    python3 tools/collect_results.py RUN_DIR

RUN_DIR holds, per configuration TAG, TAG.inspect.json (`forge inspect --json`) and TAG.kl.json
(`forge eval kl --full-vocab --json-out`), as written by tools/run_smollm2_formats.sh; times.txt
has the quantization wall times.
"""
import json, os, statistics, sys

run = sys.argv[1]
times = {}
if os.path.exists(os.path.join(run, "times.txt")):
    for line in open(os.path.join(run, "times.txt")):
        tag, t, *rest = line.split()  # optional extra fields, e.g. threads=1
        times[tag] = int(t.split("=")[1])
rows = []
for f in sorted(os.listdir(run)):
    if not f.endswith(".kl.json"):
        continue
    tag = f[: -len(".kl.json")]
    kl = json.load(open(os.path.join(run, f)))
    ins = json.load(open(os.path.join(run, tag + ".inspect.json")))
    snr = [m["snr_db"] for m in ins["matrices"] if m.get("snr_db") is not None and m["format"] not in ("bf16", "f16")]
    rows.append((ins["bits_per_weight_with_embedding"], tag, ins, kl, statistics.mean(snr) if snr else float("nan")))
rows.sort()
print("| configuration | bpw (linear+head) | bpw total | export MiB | mean weight SNR dB | mean KL | median | p99 | top-1 | ppl | quantize s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for total, tag, ins, kl, snr in rows:
    k = kl["kl"]
    print(f"| {tag} | {ins['bits_per_weight']:.3f} | {total:.3f} | {ins['export_bytes'] / 2**20:.1f} | {snr:.2f} | "
          f"{k['mean']:.4f} | {k['median']:.4f} | {k['p99']:.3f} | {100 * kl['top1_agreement']:.1f} % | "
          f"{kl['ppl_candidate']:.2f} | {times.get(tag, '')} |")
if rows:
    print(f"\nteacher perplexity {rows[0][3]['ppl_teacher']:.4f}")
