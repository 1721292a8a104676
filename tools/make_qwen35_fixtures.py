#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_qwen35_fixtures.py
# (any Python with torch + transformers 5.x + numpy + safetensors works; generated with
#  transformers 5.24.0, torch 2.15.0 CPU, numpy 2.4.6)
#
# Writes two tiny random-weight hybrid Qwen3.5 ("qwen3_5") oracle fixtures:
#   tests/fixtures/qwen35_tiny/     Qwen3_5ForCausalLM (model_type qwen3_5_text), f32, single model.safetensors
#   tests/fixtures/qwen35_tiny_mm/  Qwen3_5ForConditionalGeneration (model_type qwen3_5), bf16 (+ f32 A_log and
#                                   linear_attn.norm.weight), sharded with model.safetensors.index.json, tied lm_head
# Each directory gets: the HF checkpoint (config.json, safetensors), tokens.txt, logits.npy, logits_decode.npy,
# conv_state_{i}.npy / recurrent_state_{i}.npy (linear-attention layers), k_cache_{i}.npy / v_cache_{i}.npy
# (full-attention layers). See tests/fixtures/README.md.
#
# Everything is deterministic: fixed seeds below, CPU only, single thread.

import json
import os
import shutil
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")

SEED_A = 35001  # weights of fixture A
SEED_B = 35002  # weights of fixture B
SEED_TOK_A = 35101  # token ids of fixture A
SEED_TOK_B = 35102  # token ids of fixture B
T = 80  # sequence length (> 64: the chunked gated-delta path pads to 128)
T_PREFILL = 70  # prefill length for the prefill+decode comparison


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)


def rerandomise(model, embed_std, lm_head_std):
    """Re-draw EVERY parameter so that nothing is left at its (often trivial) init value.

    Linear weights ~ N(0, 1/fan_in) (unit-gain), so activations stay O(1).
    Zero-centred RMSNorm weights (used as 1+w) and the plain gated RMSNorm weight ~ N(0, 0.3).
    A_log ~ U(log 0.5, log 8), dt_bias ~ N(0, 1), conv1d weights ~ N(0, 0.3).
    """
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:  # tied parameters appear once
                continue
            seen.add(id(p))
            if name.endswith("A_log"):
                p.data.uniform_(np.log(0.5), np.log(8.0))
            elif name.endswith("dt_bias"):
                p.data.normal_(0.0, 1.0)
            elif "conv1d" in name:
                p.data.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.data.normal_(0.0, embed_std)
            elif name.startswith("lm_head"):
                p.data.normal_(0.0, lm_head_std)
            elif p.dim() == 1 and ("norm" in name):
                # language-model RMSNorms, q_norm/k_norm, gated norm, and vision LayerNorm weights/biases
                p.data.normal_(0.0, 0.3)
            elif p.dim() == 1:  # biases (vision tower only)
                p.data.normal_(0.0, 0.02)
            elif "visual" in name:
                fan_in = int(np.prod(p.shape[1:]))
                p.data.normal_(0.0, 1.0 / np.sqrt(fan_in))
            elif p.dim() == 2:
                fan_in = p.shape[1]
                p.data.normal_(0.0, 1.0 / np.sqrt(fan_in))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")


def text_cfg_of(model):
    c = model.config
    return c.text_config if hasattr(c, "text_config") and c.text_config is not None else c


def prefill(model, ids):
    out = model(input_ids=ids, use_cache=True)
    return out.logits[0].float(), out.cache


def decode_logits(model, ids, n_prefill):
    out = model(input_ids=ids[:, :n_prefill], use_cache=True)
    cache = out.cache
    rows = [out.logits[0].float()]
    for t in range(n_prefill, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0].float())
    return torch.cat(rows, 0)


def save_npy(d, name, t):
    arr = np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy()).astype("<f4")
    np.save(os.path.join(d, name), arr)


def dump_outputs(model, ids, outdir):
    tc = text_cfg_of(model)
    with torch.no_grad():
        logits, cache = prefill(model, ids)
        logits_dec = decode_logits(model, ids, T_PREFILL)
    std = logits.std().item()
    am = logits.argmax(-1)
    n_distinct = len(set(am.tolist()))
    diff = (logits - logits_dec).abs().max().item()
    print(f"[{os.path.basename(outdir)}] logits shape {tuple(logits.shape)} std {std:.4f} "
          f"max|logit| {logits.abs().max().item():.4f} distinct argmax {n_distinct}/{logits.shape[0]}")
    print(f"[{os.path.basename(outdir)}] prefill vs ({T_PREFILL} prefill + {T - T_PREFILL} decode) max abs diff {diff:.3e}")
    assert std > 0.5, "degenerate logits (std)"
    assert n_distinct >= 10, "degenerate logits (argmax barely varies)"
    assert diff < 1e-3, "prefill/decode disagreement"
    save_npy(outdir, "logits.npy", logits)
    save_npy(outdir, "logits_decode.npy", logits_dec)

    for i, lt in enumerate(tc.layer_types):
        layer = cache.layers[i]
        if lt == "linear_attention":
            conv = layer.conv_states[0][0]  # [conv_dim, kernel]
            rec = layer.recurrent_states[0][0]  # [num_v_heads, k_head_dim, v_head_dim]
            conv_dim = 2 * tc.linear_num_key_heads * tc.linear_key_head_dim + \
                tc.linear_num_value_heads * tc.linear_value_head_dim
            assert tuple(conv.shape) == (conv_dim, tc.linear_conv_kernel_dim), conv.shape
            assert tuple(rec.shape) == (tc.linear_num_value_heads, tc.linear_key_head_dim,
                                        tc.linear_value_head_dim), rec.shape
            save_npy(outdir, f"conv_state_{i}.npy", conv)
            save_npy(outdir, f"recurrent_state_{i}.npy", rec)
            print(f"  layer {i} linear: conv_state {tuple(conv.shape)} recurrent_state {tuple(rec.shape)} "
                  f"|rec|max {rec.abs().max().item():.3f}")
        else:
            k = layer.keys[0]  # [num_kv_heads, T, head_dim] (post-RoPE, post-k_norm)
            v = layer.values[0]
            assert tuple(k.shape) == (tc.num_key_value_heads, T, tc.head_dim), k.shape
            save_npy(outdir, f"k_cache_{i}.npy", k)
            save_npy(outdir, f"v_cache_{i}.npy", v)
            print(f"  layer {i} full: k_cache {tuple(k.shape)} v_cache {tuple(v.shape)}")
    return std, diff


def write_tokens(outdir, toks):
    with open(os.path.join(outdir, "tokens.txt"), "w") as f:
        f.write(" ".join(str(int(t)) for t in toks) + "\n")


def describe_checkpoint(outdir):
    files = sorted(f for f in os.listdir(outdir) if f.endswith(".safetensors"))
    for fn in files:
        with safe_open(os.path.join(outdir, fn), "pt") as f:
            for k in sorted(f.keys()):
                t = f.get_slice(k)
                print(f"    {fn}: {k} {t.get_dtype()} {t.get_shape()}")


def fix_modes(d):
    for fn in os.listdir(d):
        os.chmod(os.path.join(d, fn), 0o644)


def fresh_dir(d):
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)


# --------------------------------------------------------------------------------------------------------------
# Fixture A: Qwen3_5ForCausalLM, text-only config, f32, single file
# --------------------------------------------------------------------------------------------------------------
def make_a():
    outdir = os.path.join(FIX, "qwen35_tiny")
    fresh_dir(outdir)
    cfg = Qwen3_5TextConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                     "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    seed_all(SEED_A)
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    rerandomise(model, embed_std=1.0, lm_head_std=2.0 / np.sqrt(cfg.hidden_size))
    model.eval()
    model.save_pretrained(outdir)  # single model.safetensors, f32

    # reload from disk exactly like a user would, and produce the oracle outputs from the reloaded model
    model = Qwen3_5ForCausalLM.from_pretrained(outdir, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.layer_types == cfg.layer_types
    g = np.random.default_rng(SEED_TOK_A)
    toks = g.integers(0, cfg.vocab_size, size=T)
    write_tokens(outdir, toks)
    ids = torch.tensor(toks, dtype=torch.long)[None]
    res = dump_outputs(model, ids, outdir)
    fix_modes(outdir)
    print("  config.json keys:", sorted(json.load(open(os.path.join(outdir, "config.json"))).keys()))
    describe_checkpoint(outdir)
    return res


# --------------------------------------------------------------------------------------------------------------
# Fixture B: Qwen3_5ForConditionalGeneration (text_config + vision_config), bf16 sharded, tied embeddings
# --------------------------------------------------------------------------------------------------------------
def make_b():
    outdir = os.path.join(FIX, "qwen35_tiny_mm")
    fresh_dir(outdir)
    vocab = 320
    text_config = dict(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=4,
        full_attention_interval=2,  # -> linear, full, linear, full
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 4, 4], "mrope_interleaved": True},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    vision_config = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=96,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=vocab - 2,
        video_token_id=vocab - 1,
        vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 3,
        tie_word_embeddings=True,
    )
    expected_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert cfg.text_config.layer_types == expected_types, cfg.text_config.layer_types
    seed_all(SEED_B)
    model = Qwen3_5ForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    # tied: embed_tokens is also the lm_head, so choose its std for sensible logits (~3)
    rerandomise(model, embed_std=0.3, lm_head_std=None)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr(), "not tied"
    model.eval()

    # bf16 everywhere except A_log and the gated norm weight (kept f32, like the released Qwen3.5 checkpoints)
    keep_f32 = {}
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight"):
            keep_f32[name] = p.detach().clone()
    model.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in keep_f32:
                p.data = keep_f32[name]
    model.save_pretrained(outdir, max_shard_size="300KB")

    # Make sure the f32 tensors really are f32 on disk (post-process the shards if save_pretrained cast them).
    idx_path = os.path.join(outdir, "model.safetensors.index.json")
    assert os.path.exists(idx_path), "expected a sharded checkpoint"
    index = json.load(open(idx_path))
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(outdir, shard)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        sd = load_file(path)
        changed = False
        for k in list(sd.keys()):
            want_f32 = k.endswith("linear_attn.A_log") or k.endswith("linear_attn.norm.weight")
            if want_f32 and sd[k].dtype != torch.float32:
                src = [v for n, v in keep_f32.items() if k.endswith(n.split("language_model.")[-1])]
                assert len(src) == 1, (k, len(src))
                sd[k] = src[0].contiguous()
                changed = True
        if changed:
            print(f"  post-processed {shard}: restored f32 tensors")
            save_file(sd, path, metadata=meta)

    # config.json: save_pretrained writes the expanded layer_types; real-world configs may instead carry only
    # full_attention_interval. Make this fixture the latter kind.
    cfg_path = os.path.join(outdir, "config.json")
    cj = json.load(open(cfg_path))
    tcj = cj["text_config"]
    print("  text_config as written by save_pretrained has layer_types:", "layer_types" in tcj,
          " full_attention_interval:", "full_attention_interval" in tcj)
    if "layer_types" in tcj:
        del tcj["layer_types"]
    tcj["full_attention_interval"] = 2
    with open(cfg_path, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")

    # Reload (bf16/f32 mixed on disk) as float32 and verify the layer pattern round-trips.
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        outdir, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.text_config.layer_types == expected_types, model.config.text_config.layer_types
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
    g = np.random.default_rng(SEED_TOK_B)
    toks = g.integers(0, vocab - 4, size=T)  # keep clear of the vision special ids (vocab-4 .. vocab-1)
    write_tokens(outdir, toks)
    ids = torch.tensor(toks, dtype=torch.long)[None]
    res = dump_outputs(model, ids, outdir)
    fix_modes(outdir)
    print("  config.json keys:", sorted(cj.keys()))
    print("  text_config keys:", sorted(cj["text_config"].keys()))
    print("  vision_config keys:", sorted(cj["vision_config"].keys()))
    describe_checkpoint(outdir)
    return res


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__, "numpy", np.__version__)
    a = make_a()
    b = make_b()
    print(f"SUMMARY qwen35_tiny    logit std {a[0]:.4f}  prefill-vs-decode max diff {a[1]:.3e}")
    print(f"SUMMARY qwen35_tiny_mm logit std {b[0]:.4f}  prefill-vs-decode max diff {b[1]:.3e}")


if __name__ == "__main__":
    sys.exit(main())
