#!/usr/bin/env python3
# Command (run from the repository root, after tools/make_qwen35_fixtures.py):
#   /work/pyenv/bin/python tools/check_qwen35_fixtures.py
#
# Independent, deliberately naive NumPy (float64) re-implementation of the Qwen3.5 hybrid text model, written from
# the checkpoint alone (config.json + safetensors) and checked against the oracle outputs produced by transformers
# (logits.npy, conv_state_*.npy, recurrent_state_*.npy, k_cache_*.npy, v_cache_*.npy). It is meant as a readable
# spec of the exact semantics for the Rust engine: token-by-token gated-delta recurrence (no chunking), explicit
# causal conv, zero-centred RMSNorm, gated attention output, partial neox-style RoPE.

import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")


def load_weights(d):
    files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    w, dtypes = {}, {}
    for fn in files:
        for k, v in load_file(os.path.join(d, fn)).items():
            dtypes[k] = str(v.dtype)
            w[k] = v.to(torch.float64).numpy()
    return w, dtypes


def layer_types_of(tc):
    if "layer_types" in tc:
        return tc["layer_types"]
    iv = tc.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % iv == 0 else "linear_attention" for i in range(tc["num_hidden_layers"])]


def rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def run(d):
    cj = json.load(open(os.path.join(d, "config.json")))
    tc = cj.get("text_config", cj)
    w, dtypes = load_weights(d)
    pre = "model.language_model." if any(k.startswith("model.language_model.") for k in w) else "model."
    ids = [int(x) for x in open(os.path.join(d, "tokens.txt")).read().split()]
    T = len(ids)
    eps = tc["rms_norm_eps"]
    H, KVH, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    K = tc["linear_conv_kernel_dim"]
    rp = tc["rope_parameters"]
    rot = int(hd * rp.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rp["rope_theta"] ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    ang = np.arange(T)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)  # [T, rot]
    sin = np.concatenate([np.sin(ang)] * 2, -1)

    def rope(x):  # x [T, heads, hd]; rotate-half over the first `rot` dims, rest passes through
        xr, xp = x[..., :rot], x[..., rot:]
        half = rot // 2
        rh = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
        return np.concatenate([xr * cos[:, None] + rh * sin[:, None], xp], -1)

    def zc_norm(x, name):  # zero-centred RMSNorm: x_hat * (1 + w)
        return rms(x, eps) * (1.0 + w[name])

    x = w[pre + "embed_tokens.weight"][ids]  # [T, hidden]
    states = {}
    for i, lt in enumerate(layer_types_of(tc)):
        p = f"{pre}layers.{i}."
        h = zc_norm(x, p + "input_layernorm.weight")
        if lt == "full_attention":
            qg = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)  # per head: [query | gate]
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KVH, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KVH, hd)
            q = rope(zc_norm(q, p + "self_attn.q_norm.weight"))
            k = rope(zc_norm(k, p + "self_attn.k_norm.weight"))
            states[f"k_cache_{i}"] = k.transpose(1, 0, 2)
            states[f"v_cache_{i}"] = v.transpose(1, 0, 2)
            o = np.zeros((T, H, hd))
            mask = np.triu(np.full((T, T), -np.inf), 1)
            for hh in range(H):
                kv = hh // (H // KVH)
                s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                s /= s.sum(-1, keepdims=True)
                o[:, hh] = s @ v[:, kv]
            o = o.reshape(T, H * hd) * sigmoid(gate)
            mix = o @ w[p + "self_attn.o_proj.weight"].T
        else:
            a_ = p + "linear_attn."
            qkv = h @ w[a_ + "in_proj_qkv.weight"].T  # [T, 2*nk*dk + nv*dv], order [q | k | v]
            cw = w[a_ + "conv1d.weight"][:, 0, :]  # [conv_dim, K]; tap K-1 multiplies the current token
            padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], 0)
            conv = np.stack([(padded[t:t + K] * cw.T).sum(0) for t in range(T)])
            conv = silu(conv)
            # cache conv state = the last K pre-conv inputs, oldest first (zero padded if T < K)
            states[f"conv_state_{i}"] = np.concatenate([np.zeros((K, qkv.shape[1])), qkv], 0)[-K:].T
            q = conv[:, :nk * dk].reshape(T, nk, dk)
            k = conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
            v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
            z = (h @ w[a_ + "in_proj_z.weight"].T).reshape(T, nv, dv)
            beta = sigmoid(h @ w[a_ + "in_proj_b.weight"].T)  # [T, nv]
            g = -np.exp(w[a_ + "A_log"]) * softplus(h @ w[a_ + "in_proj_a.weight"].T + w[a_ + "dt_bias"])
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            rep = nv // nk  # value head j uses key/query head j // rep
            S = np.zeros((nv, dk, dv))
            o = np.zeros((T, nv, dv))
            for t in range(T):
                for j in range(nv):
                    kj, qj = k[t, j // rep], q[t, j // rep]
                    S[j] *= np.exp(g[t, j])
                    delta = (v[t, j] - kj @ S[j]) * beta[t, j]
                    S[j] += np.outer(kj, delta)
                    o[t, j] = qj @ S[j]
            states[f"recurrent_state_{i}"] = S
            o = rms(o, eps) * w[a_ + "norm.weight"] * silu(z)  # plain-weight gated RMSNorm over dv, per head
            mix = o.reshape(T, nv * dv) @ w[a_ + "out_proj.weight"].T
        x = x + mix
        h = zc_norm(x, p + "post_attention_layernorm.weight")
        m = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + m @ w[p + "mlp.down_proj.weight"].T
    x = zc_norm(x, pre + "norm.weight")
    lm = w.get("lm_head.weight", w[pre + "embed_tokens.weight"])
    logits = x @ lm.T

    ok = True
    ref = np.load(os.path.join(d, "logits.npy"))
    diff = np.abs(ref - logits).max()
    print(f"[{os.path.basename(d)}] numpy-f64 vs logits.npy max abs diff {diff:.3e} (max|logit| {np.abs(ref).max():.3f})")
    ok &= diff < 2e-3
    for name, val in sorted(states.items()):
        r = np.load(os.path.join(d, name + ".npy"))
        assert r.shape == val.shape, (name, r.shape, val.shape)
        dd = np.abs(r - val).max()
        print(f"    {name:20s} {str(r.shape):14s} max abs diff {dd:.3e}")
        ok &= dd < 2e-3
    return ok


def main():
    ok = True
    for name in ("qwen35_tiny", "qwen35_tiny_mm"):
        ok &= run(os.path.join(FIX, name))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
