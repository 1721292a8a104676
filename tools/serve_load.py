#!/usr/bin/env python3
"""Concurrent streaming clients against a running `forge serve`: aggregate decode throughput,
time to first token and inter-token gaps, as JSON on stdout.

    python3 tools/serve_load.py --url http://127.0.0.1:8765 --clients 4 --requests 3 --max-tokens 64

Every client sends `--requests` greedy chat requests one after the other (prompts from a fixed
list, rotated by client), streamed with usage (`--no-stream`: whole answers), each decoding
`--max-tokens` tokens (`ignore_eos`). Standard library only.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear system works.",
    "List ten facts about the Moon.",
    "Describe a walk through a busy market.",
    "What makes a good cup of tea? Explain in detail.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain the water cycle to a child.",
    "Describe how bread is made, step by step.",
]


def one(url, prompt, max_tokens, stream):
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        # Every request decodes its full length, so runs compare equal work.
        "ignore_eos": True,
    }
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, stamps, tokens = None, [], 0
    if stream:
        body["stream_options"] = {"include_usage": True}
        req.data = json.dumps(body).encode()
    with urllib.request.urlopen(req, timeout=600) as r:
        if not stream:
            c = json.loads(r.read())
            return {"ttft_s": None, "tokens": c["usage"]["completion_tokens"], "gaps": []}
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c.get("usage"):
                tokens = c["usage"]["completion_tokens"]
            for ch in c.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft_s": (first or time.perf_counter()) - t0, "tokens": tokens, "gaps": gaps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-stream", action="store_true", help="whole answers (no time to first token or gaps)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first (a fresh server maps its weights)")
    a = ap.parse_args()
    results, errors = [], []
    lock = threading.Lock()

    def client(i):
        for k in range(a.requests):
            try:
                r = one(a.url, PROMPTS[(i + k) % len(PROMPTS)], a.max_tokens, not a.no_stream)
                with lock:
                    results.append(r)
            except Exception as e:  # reported, not raised: the other clients go on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    for k in range(a.warmup):
        one(a.url, PROMPTS[-1 - k % len(PROMPTS)], 8, not a.no_stream)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    pick = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else None
    print(json.dumps({
        "clients": a.clients,
        "requests": len(results),
        "errors": errors,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 1),
        "ttft_s_mean": round(statistics.mean(ttfts), 3) if ttfts else None,
        "gap_s_p50": pick(0.5),
        "gap_s_p99": pick(0.99),
    }, indent=1))


if __name__ == "__main__":
    main()
