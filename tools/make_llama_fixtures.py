#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_llama_fixtures.py
# (any Python with torch + transformers 5.x + numpy + safetensors works; generated with
#  transformers 5.24.0, torch 2.15.0 CPU, numpy 2.4.6)
#
# Writes tiny random-weight Llama-family oracle fixtures (HF checkpoint as written by save_pretrained, f32, single
# model.safetensors; tokens.txt; logits.npy [70, vocab] float32 from one full forward pass):
#   tests/fixtures/llama_tiny/   LlamaForCausalLM, GQA 4 q heads / 2 kv heads, rope_theta 1e4, untied lm_head
#   tests/fixtures/qwen2_tiny/   Qwen2ForCausalLM, q/k/v biases, tied embeddings
#   tests/fixtures/qwen3_tiny/   Qwen3ForCausalLM, q_norm/k_norm, head_dim (16) != hidden/heads (12), rope_theta 1e6
#   tests/fixtures/llama3_tiny/  LlamaForCausalLM with rope_parameters rope_type "llama3" (factor 8, low 1, high 4,
#                                original_max_position_embeddings 64), rope_theta 5e5
# See tests/fixtures/README.md. Deterministic: fixed seeds below, CPU only, single thread.

import json
import os
import shutil
import sys

import numpy as np
import torch

import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")
T = 70

SEEDS = {  # name -> (weight seed, token seed)
    "llama_tiny": (1001, 1101),
    "qwen2_tiny": (1002, 1102),
    "qwen3_tiny": (1003, 1103),
    "llama3_tiny": (1004, 1104),
}

COMMON = dict(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def rerandomise(model, embed_std, lm_head_std):
    """Re-draw every parameter. Linear weights ~ N(0, 1/fan_in); biases ~ N(0, 0.3);
    RMSNorm weights (plain `x_hat * w` convention in these models) ~ N(1, 0.3)."""
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if "embed_tokens" in name:
                p.data.normal_(0.0, embed_std)
            elif name.startswith("lm_head"):
                p.data.normal_(0.0, lm_head_std)
            elif "norm" in name:
                p.data.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.data.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.data.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")


def build(name, cls, cfg, tied):
    wseed, tseed = SEEDS[name]
    outdir = os.path.join(FIX, name)
    if os.path.isdir(outdir):
        shutil.rmtree(outdir)
    os.makedirs(outdir)
    torch.manual_seed(wseed)
    np.random.seed(wseed)
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    h = cfg.hidden_size
    if tied:
        rerandomise(model, embed_std=0.4, lm_head_std=None)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        rerandomise(model, embed_std=1.0, lm_head_std=2.5 / np.sqrt(h))
    model.eval()
    model.save_pretrained(outdir)
    for fn in os.listdir(outdir):
        os.chmod(os.path.join(outdir, fn), 0o644)
    model = cls.from_pretrained(outdir, dtype=torch.float32, attn_implementation="eager").eval()

    toks = np.random.default_rng(tseed).integers(0, cfg.vocab_size, size=T)
    with open(os.path.join(outdir, "tokens.txt"), "w") as f:
        f.write(" ".join(str(int(t)) for t in toks) + "\n")
    ids = torch.tensor(toks, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True).logits[0].float()
    std = logits.std().item()
    nd = len(set(logits.argmax(-1).tolist()))
    print(f"[{name}] logits {tuple(logits.shape)} std {std:.4f} max|logit| {logits.abs().max().item():.3f} "
          f"distinct argmax {nd}/{T}")
    assert std > 0.5 and nd >= 10, "degenerate logits"
    np.save(os.path.join(outdir, "logits.npy"), logits.numpy().astype("<f4"))
    cj = json.load(open(os.path.join(outdir, "config.json")))
    print(f"  config.json: {json.dumps(cj, sort_keys=True)}")
    size = sum(os.path.getsize(os.path.join(outdir, f)) for f in os.listdir(outdir))
    print(f"  dir size {size} bytes")
    assert size < 400 * 1024
    return model, ids, logits


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__, "numpy", np.__version__)

    build("llama_tiny", LlamaForCausalLM, LlamaConfig(
        **COMMON,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ), tied=False)

    build("qwen2_tiny", Qwen2ForCausalLM, Qwen2Config(
        **COMMON,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
    ), tied=True)

    build("qwen3_tiny", Qwen3ForCausalLM, Qwen3Config(
        **COMMON,
        head_dim=16,  # 4 heads * 16 = 64 != hidden 48
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
    ), tied=False)

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model, ids, logits = build("llama3_tiny", LlamaForCausalLM, LlamaConfig(
        **COMMON,
        rope_parameters=llama3_rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ), tied=False)
    # Show that the llama3 scaling matters: same weights with plain RoPE (same theta) give different logits.
    cfg_plain = LlamaConfig.from_pretrained(os.path.join(FIX, "llama3_tiny"))
    cfg_plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    plain = LlamaForCausalLM.from_pretrained(os.path.join(FIX, "llama3_tiny"), config=cfg_plain,
                                             dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = plain(input_ids=ids).logits[0]
    print(f"[llama3_tiny] inv_freq llama3 {model.model.rotary_emb.inv_freq.tolist()}")
    print(f"[llama3_tiny] inv_freq plain  {plain.model.rotary_emb.inv_freq.tolist()}")
    print(f"[llama3_tiny] max |logits(llama3 rope) - logits(plain rope)| = {(lp - logits).abs().max().item():.4f}")


if __name__ == "__main__":
    sys.exit(main())
