#!/usr/bin/env python3
"""Drive a running `forge serve` with the official `openai` Python SDK, and `forge chat` through a pipe.

Starts the server itself on a free loopback port (SmolLM2, the embedded default model), waits for
/health, runs the checks, stops it. Greedy answers are compared with `forge generate --temperature 0`.
Tool calls and reasoning are scripted with the server's test hook (`--test-hooks`, request field
`x_forced_output`), since a 135M model will not reliably produce them.

    python3 tools/test_openai_sdk.py [--forge target/release/forge] [--bench]

`--bench` instead measures time to first token and decode speed through a fresh server against
`forge generate` (2 threads). Ends with a line 'N passed, M failed'; exit code 1 on any failure.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sdk-test-key"
FRANCE = "What is the capital of France?"
PARIS = "The capital of France is Paris."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(base, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"forge serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return json.load(r)
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("forge serve did not become healthy")


def start_server(forge, flags=(), log=subprocess.DEVNULL):
    """`forge serve` on SmolLM2 at a free port with the test key and hooks: (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen([forge, "--threads", "2", "serve", "--model", "smollm2", "--port", str(port),
                             "--ctx", "2048", "--api-key", KEY, "--test-hooks", *flags], stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}"


def forge_generate(forge, prompt, max_tokens):
    out = subprocess.run([forge, "--threads", "2", "generate", "--model", "smollm2", "--chat", "--temperature", "0",
                          "--max-tokens", str(max_tokens), "--prompt", prompt],
                         capture_output=True, text=True, timeout=300, check=True)
    # generate ends its output with one newline.
    return out.stdout[:-1] if out.stdout.endswith("\n") else out.stdout, out.stderr


def extra(obj, name):
    """A field the SDK's models do not declare (e.g. reasoning_content)."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


class Checks:
    def __init__(self, forge, client, base):
        self.forge, self.c, self.base = forge, client, base

    def models(self):
        ids = [m.id for m in self.c.models.list().data]
        assert ids == ["smollm2"], ids

    def greedy_equals_forge_generate(self):
        for prompt, n in [(FRANCE, 64), ("Write a haiku about the sea.", 40)]:
            want, _ = forge_generate(self.forge, prompt, n)
            assert prompt != FRANCE or want == PARIS, want
            r = self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=n)
            got = r.choices[0].message.content
            assert got == want, f"server {got!r} != forge generate {want!r}"
            stream = self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                    temperature=0, max_tokens=n, stream=True)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            assert streamed == want, f"streamed {streamed!r} != {want!r}"

    def streaming_usage_and_cache(self):
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": FRANCE}]
        first = self.c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=24)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Spain?"}]
        stream = self.c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
        assert [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason in ("stop", "length")

    def seeded_sampling(self):
        def once(seed):
            return self.c.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Tell me about cats."}], temperature=1.0,
                seed=seed, max_tokens=20, presence_penalty=0.3, frequency_penalty=0.3,
                extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.05, "dry_multiplier": 0.5},
            ).choices[0].message.content
        a = once(42)
        assert a == once(42)
        assert any(once(s) != a for s in (1, 2, 3))

    def stop_sequences(self):
        r = self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": FRANCE}],
                                           temperature=0, stop=["Paris"])
        assert r.choices[0].message.content == "The capital of France is ", r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"

    def tool_call_round_trip(self):
        forced = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
        msgs = [{"role": "user", "content": "Weather in Paris for two days?"}]
        r = self.c.chat.completions.create(model="smollm2", messages=msgs, tools=TOOLS,
                                           extra_body={"x_forced_output": forced})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
        # Streaming: accumulate the deltas the way clients do.
        stream = self.c.chat.completions.create(model="smollm2", messages=msgs, tools=TOOLS, stream=True,
                                                extra_body={"x_forced_output": forced})
        calls, finish = {}, None
        for chunk in stream:
            if not chunk.choices:
                continue
            for tc in chunk.choices[0].delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                c["id"] = tc.id or c["id"]
                if tc.function and tc.function.name:
                    c["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"]
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}
        # Send the result back with the call replayed.
        msgs += [ch.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
        r = self.c.chat.completions.create(model="smollm2", messages=msgs, tools=TOOLS, temperature=0, max_tokens=16)
        assert isinstance(r.choices[0].message.content, str)

    def reasoning_split(self):
        forced = "<think>\nFrance's capital is Paris.\n</think>\n\nParis."
        r = self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": FRANCE}],
                                           extra_body={"x_forced_output": forced})
        m = r.choices[0].message
        assert extra(m, "reasoning_content") == "France's capital is Paris." and m.content == "Paris.", m
        stream = self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": FRANCE}],
                                                stream=True, extra_body={"x_forced_output": forced})
        reasoning, content = "", ""
        for chunk in stream:
            if chunk.choices:
                reasoning += extra(chunk.choices[0].delta, "reasoning_content") or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == ("France's capital is Paris.", "Paris."), (reasoning, content)

    def text_completions(self):
        r = self.c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens <= 4

    def errors(self):
        try:
            self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], temperature=5)
            raise AssertionError("temperature 5 accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == "temperature", e.body
        try:
            self.c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 5000}])
            raise AssertionError("over-long prompt accepted")
        except openai.BadRequestError as e:
            assert e.body["code"] == "context_length_exceeded", e.body
        bad = openai.OpenAI(base_url=self.base + "/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("wrong key accepted")
        except openai.AuthenticationError:
            pass
        self.models()  # still serving

    def speculative_servers_answer_alike(self):
        """Servers decoding speculatively (prompt lookup; a draft model, here SmolLM2 itself) give
        the SDK the plain server's greedy text, and report accepted and rejected drafts."""
        prompt = "Print the alphabet from A to Z, separated by commas, twice."
        ask = lambda c: c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                  temperature=0, max_tokens=48)
        want = ask(self.c).choices[0].message.content
        for flags in (["--lookup"], ["--draft", "smollm2"]):
            proc, base = start_server(self.forge, flags)
            try:
                wait_health(base, proc)
                c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
                r = ask(c)
                assert r.choices[0].message.content == want, (flags, r.choices[0].message.content, want)
                d = r.usage.completion_tokens_details
                assert d.accepted_prediction_tokens > 0, (flags, d)
                assert d.rejected_prediction_tokens is not None, (flags, d)
            finally:
                proc.terminate()
                proc.wait(timeout=15)

    def forge_chat_pipe(self):
        stdin = f"{FRANCE}\n/think\n/reset\n{FRANCE}\n/quit\n"
        p = subprocess.run([self.forge, "--threads", "2", "chat", "--model", "smollm2", "--temperature", "0"],
                           input=stdin, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert p.stdout == f"{PARIS}\n{PARIS}\n", p.stdout
        stats = [l for l in p.stderr.splitlines() if l.startswith("[prompt ")]
        assert len(stats) == 2 and "tok/s" in stats[0], p.stderr
        assert "(thinking on)" in p.stderr and "(new conversation)" in p.stderr, p.stderr


def bench(forge, client, rounds=3):
    """TTFT and decode tok/s through the server (streamed) vs forge generate, same prompts, 2 threads.

    On a fresh server the first request is fully cold; later ones share the chat template's system
    prompt with earlier ones, and a repeated prompt reuses all but its last token. `forge generate`
    runs are interleaved with the server's so that both see the same machine load."""
    import re
    import statistics
    n = 128
    names = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus"][:rounds]
    prompts = [f"Write a short story about a lighthouse keeper named {name}." for name in names]
    rows = {"generate": [], "server": []}

    def server_run(label, p):
        t0 = time.perf_counter()
        first, usage, timings = None, None, None
        stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                                temperature=0, max_tokens=n, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            if chunk.choices and chunk.choices[0].finish_reason:
                timings = extra(chunk, "timings")
            usage = chunk.usage or usage
        t1 = time.perf_counter()
        toks = usage.completion_tokens
        ttft, dec = 1e3 * (first - t0), (toks - 1) / (t1 - first)
        print(f"bench: server {label}: prompt {usage.prompt_tokens} tokens "
              f"(cached {usage.prompt_tokens_details.cached_tokens}), TTFT {ttft:.0f} ms client / "
              f"{timings['ttft_ms']:.0f} ms engine, {toks} tokens, decode {dec:.1f} tok/s client / "
              f"{timings['predicted_per_second']:.1f} tok/s engine")
        return ttft, dec

    for i, p in enumerate(prompts):
        _, err = forge_generate(forge, p, n)
        m = re.search(r"prompt: (\d+) tokens, ([\d.]+) tok/s \| generated: (\d+) tokens, ([\d.]+) tok/s", err)
        ptoks, ptps, _, dtps = int(m[1]), float(m[2]), int(m[3]), float(m[4])
        # generate's time to first token: its prefill (the first token comes out of it).
        rows["generate"].append((1e3 * ptoks / ptps, dtps))
        print(f"bench: forge generate: {err.strip()}")
        rows["server"].append(server_run("cold" if i == 0 else "shared system prompt", p))
    server_run("repeated prompt", prompts[-1])
    for k, v in rows.items():
        print(f"bench: median {k}: TTFT {statistics.median(x[0] for x in v):.0f} ms, "
              f"decode {statistics.median(x[1] for x in v):.1f} tok/s over {len(v)} runs")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forge", default=os.path.join(ROOT, "target", "release", "forge"))
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    log = open(os.path.join(ROOT, "target", "test_openai_sdk.server.log"), "w")
    proc, base = start_server(args.forge, log=log)
    passed = failed = 0
    try:
        health = wait_health(base, proc)
        assert health["model"] == "smollm2", health
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
        if args.bench:
            bench(args.forge, client, args.rounds)
            return
        checks = Checks(args.forge, client, base)
        names = [n for n in vars(Checks) if not n.startswith("_")]
        for name in names:
            t = time.time()
            try:
                getattr(checks, name)()
                passed += 1
                print(f"ok   {name} ({time.time() - t:.1f} s)")
            except Exception:
                failed += 1
                print(f"FAIL {name}")
                traceback.print_exc()
    except Exception:
        failed += 1
        traceback.print_exc()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    if failed:
        with open(log.name) as f:
            sys.stdout.write("server log:\n" + f.read()[-4000:])
    print(f"openai-sdk: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
