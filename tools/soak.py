#!/usr/bin/env python3
"""Soak test: `forge serve` under many concurrent clients with faults, every answer checked.

    python3 tools/soak.py --forge target/release/forge --model out/q4 --clients 16 --seconds 1800

Starts the server (`--parallel`, an API key, the test hooks), records each greedy prompt's answer
served alone (cold and from the prompt cache), then runs `--clients` clients for `--seconds`, each looping over a seeded mix:
greedy chats (streamed or not; the answer must equal the solo one exactly), sampled chats,
scripted tool calls (the parsed call must match), prompts longer than the context (400
`context_length_exceeded`), malformed JSON (400), a wrong API key (401) and streams dropped
mid-answer. It samples the server's RSS and open file descriptors every second and prints a
JSON report: requests and errors by kind, wrong answers, whether the server died, RSS after
warm-up (the first fifth) against the end, and the descriptors' range. Exit status 1 when the
server crashed, an answer was wrong or malformed, or an error of an unexpected kind occurred.
Standard library only.
"""
import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

KEY = "soak-key"
GREEDY = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give me a word that rhymes with cat.",
    "Say hello in Spanish.",
]
TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
TOOL_OUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
MAX_TOKENS = 24


class Server:
    def __init__(self, a):
        self.port = a.port
        cmd = [a.forge, "--threads", str(a.threads), "serve", "--model", a.model, "--ctx", str(a.ctx),
               "--port", str(a.port), "--api-key", KEY, "--test-hooks"]
        if a.parallel:
            cmd += ["--parallel", str(a.parallel)]
        self.log = open(a.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"forge serve exited with {self.proc.returncode} while starting (log: {a.log})")
            try:
                if request(self.port, "GET", "/health", None)[0] == 200:
                    return
            except OSError:
                pass
            if time.time() - t0 > 600:
                sys.exit("forge serve did not start within 600 s")
            time.sleep(0.5)

    def sample(self):
        """(RSS in KiB, open descriptors), or None once the process is gone."""
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
            return rss, len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return None


def request(port, method, path, body, key=KEY, raw=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, data, headers)
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, text


def chat_body(content, **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, **kw}


def check_completion(j):
    """The answer text of a chat.completion, or raise on a malformed one."""
    assert j["object"] == "chat.completion", j
    ch = j["choices"][0]
    assert ch["finish_reason"] in ("stop", "length", "tool_calls"), ch
    u = j["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    return ch["message"].get("content") or ""


def stream_text(port, body, drop_after=None):
    """A streamed chat's text (None when dropped on purpose), checking every chunk's shape."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
              {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    if r.status != 200:
        raise AssertionError(f"stream status {r.status}: {r.read()[:200]}")
    text, seen, done = "", 0, False
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        j = json.loads(line[6:])
        assert j["object"] == "chat.completion.chunk", j
        for ch in j["choices"]:
            text += ch["delta"].get("content") or ""
        seen += 1
        if drop_after is not None and seen >= drop_after:
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            return None
    c.close()
    assert done, "stream ended without [DONE]"
    return text


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []

    def add(self, kind, failure=None):
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if failure and len(self.failures) < 50:
                self.failures.append(failure)


def client(a, i, solo, tally, stop):
    rng = random.Random(a.seed * 1000 + i)
    while time.time() < stop:
        kind = rng.choices(["greedy", "greedy_stream", "sampled", "tool", "long", "bad_json", "bad_key", "drop"],
                           [5, 5, 3, 2, 1, 1, 1, 2])[0]
        try:
            if kind in ("greedy", "greedy_stream"):
                q = rng.choice(GREEDY)
                body = chat_body(q, temperature=0)
                if kind == "greedy":
                    st, text = request(a.port, "POST", "/v1/chat/completions", body)
                    assert st == 200, (st, text[:200])
                    got = check_completion(json.loads(text))
                else:
                    got = stream_text(a.port, body)
                if got != solo[q]:
                    tally.add("wrong_answer", f"{kind} {q!r}: {got!r} != {solo[q]!r}")
                    continue
            elif kind == "sampled":
                body = chat_body(rng.choice(GREEDY), temperature=0.9, seed=rng.randrange(1 << 30))
                st, text = request(a.port, "POST", "/v1/chat/completions", body)
                assert st == 200, (st, text[:200])
                check_completion(json.loads(text))
            elif kind == "tool":
                body = chat_body("Weather in Oslo for two days?", tools=TOOL, x_forced_output=TOOL_OUT, max_tokens=200)
                st, text = request(a.port, "POST", "/v1/chat/completions", body)
                assert st == 200, (st, text[:200])
                j = json.loads(text)
                check_completion(j)
                call = j["choices"][0]["message"]["tool_calls"][0]["function"]
                assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo", "days": 2}, call
            elif kind == "long":
                st, text = request(a.port, "POST", "/v1/chat/completions", chat_body("word " * (a.ctx + 64)))
                assert st == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded", (st, text[:200])
            elif kind == "bad_json":
                st, text = request(a.port, "POST", "/v1/chat/completions", None, raw=b'{"messages": [')
                assert st == 400 and "error" in json.loads(text), (st, text[:200])
            elif kind == "bad_key":
                st, text = request(a.port, "POST", "/v1/chat/completions", chat_body("hi"), key="wrong")
                assert st == 401 and "error" in json.loads(text), (st, text[:200])
            else:
                body = chat_body("Count from one to one hundred in words.", max_tokens=200, temperature=0)
                stream_text(a.port, body, drop_after=rng.randint(1, 6))
            tally.add(kind)
        except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
            tally.add("malformed", f"{kind}: {type(e).__name__}: {e}"[:400])
        except OSError as e:
            tally.add("connection_error", f"{kind}: {type(e).__name__}: {e}"[:400])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forge", default="target/release/forge")
    ap.add_argument("--model", default="out/q4")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--parallel", type=int, default=None, help="forge serve --parallel (default: its own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log", default="soak-server.log")
    a = ap.parse_args()
    srv = Server(a)
    try:
        # Each greedy prompt alone, cold and then from the prompt cache: the two must agree (a
        # restored state may differ from a cold one in the last bits).
        solo = {}
        for q in GREEDY:
            answers = []
            for _ in range(2):
                st, text = request(a.port, "POST", "/v1/chat/completions", chat_body(q, temperature=0))
                assert st == 200, text
                answers.append(check_completion(json.loads(text)))
            if answers[0] != answers[1]:
                sys.exit(f"{q!r}: the cached answer {answers[1]!r} differs from the cold one {answers[0]!r}")
            solo[q] = answers[0]
        tally, samples = Tally(), []
        t0 = time.time()
        stop = t0 + a.seconds
        threads = [threading.Thread(target=client, args=(a, i, solo, tally, stop), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        crashed = False
        while any(t.is_alive() for t in threads):
            s = srv.sample()
            if s is None or srv.proc.poll() is not None:
                crashed = True
                break
            samples.append((time.time() - t0, *s))
            time.sleep(1.0)
        for t in threads:
            t.join(timeout=5 if crashed else None)
        warm = [s for s in samples if s[0] >= a.seconds / 5]
        rss0 = warm[0][1] if warm else None
        rss1 = max(s[1] for s in warm[-max(1, len(warm) // 10):]) if warm else None
        fds = [s[2] for s in warm]
        health = json.loads(request(a.port, "GET", "/health", None)[1]) if not crashed else None
        bad = sum(tally.counts.get(k, 0) for k in ("wrong_answer", "malformed", "connection_error"))
        report = {
            "seconds": a.seconds,
            "clients": a.clients,
            "requests": tally.counts,
            "crashed": crashed,
            "wrong_answers": tally.counts.get("wrong_answer", 0),
            "failures": tally.failures,
            "rss_mib_after_warmup": rss0 and round(rss0 / 1024, 1),
            "rss_mib_end": rss1 and round(rss1 / 1024, 1),
            "rss_growth_pct": rss0 and round(100 * (rss1 - rss0) / rss0, 2),
            "fds_min_max": [min(fds), max(fds)] if fds else None,
            # RSS (MiB) at about every twentieth of the run, to show its trend.
            "rss_mib_series": [round(x[1] / 1024, 1) for x in samples[:: max(1, len(samples) // 20)]],
            "batching": health and health.get("batching"),
            "served": health and health.get("served"),
        }
        print(json.dumps(report, indent=1))
        return 1 if crashed or bad else 0
    finally:
        srv.proc.terminate()
        try:
            srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.proc.kill()


if __name__ == "__main__":
    sys.exit(main())
