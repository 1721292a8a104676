#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_upstream_export.py
#
# Writes tests/fixtures/qwen35_tiny_upstream_export/: an export of tests/fixtures/qwen35_tiny in the seeds' (upstream)
# export layout, produced with plain NumPy and independently of Forge's Rust code, plus `logits.npy`, the logits of the
# quantized model on tokens.txt computed by an independent float64 NumPy forward (the one of
# tools/check_qwen35_fixtures.py, copied below) with every dequantized weight folded back to the original basis.
#
# Layout (seeds 000_… §2, §3, §6, §8, §9; key naming as documented in crates/forge-model/src/export.rs):
#   layer_NN.safetensors        MLP of layer NN: mlp.gate_proj / mlp.up_proj / mlp.down_proj
#   layer_NN_mixer.safetensors  token mixer of layer NN: linear_attn.* (DeltaNet) or self_attn.* (attention)
#   lm_head.safetensors         lm_head
#   forge.json                  manifest; source.path is relative to the export directory
# Tensors per matrix `<key>`:
#   LUT:  <key>.lut F16 (K, d), <key>.idx U8 (Cout/d, Cin), <key>.scale F16 (Cout)
#         Ŵ[d·g+t, j] = s[d·g+t] · L[I[g, j], t]
#   INT8: <key>.int8 I8 (Cout, Cin), <key>.scale F16 (Cout)             Ŵ[o, j] = s[o] · q[o, j]
#   kept: <key>.weight BF16 (Cout, Cin)
#   low-rank residual (original, unrotated input basis): <key>.lr_a F16 (Cout, r), <key>.lr_b F16 (r, Cin)
# File metadata: kind, format, kv_format, <key>.format (long names); MLP files also basis / seed_in / seed_mid / block.
# The MLP files deliberately carry NO per-matrix `<key>.rotation_seed` keys: only the upstream file-level rotation
# metadata, so a reader must reproduce the rotation from `basis`, `seed_in` (gate/up), `seed_mid` (down) and `block`.
#
# Rotation (seeds §6): row-vector convention, x' = x M, W' = W M, M block-diagonal with blocks D H / sqrt(b)
# (H Sylvester Hadamard, D = diag(signs) over the whole dimension, signs =
# numpy.random.default_rng(seed).choice([-1.0, 1.0], dim)), b = 1024 or the largest power of two dividing dim.
# The quantized weight is stored in the rotated basis; the reference folds it back as Q Mᵀ.
#
# Everything is deterministic (fixed seeds); a rerun on the same machine gives byte-identical files.

import hashlib
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "tests", "fixtures", "qwen35_tiny")
OUT = os.path.join(REPO, "tests", "fixtures", "qwen35_tiny_upstream_export")

LUT4 = "LUT4 per-tensor + pcs"
VEC2X16 = "vector 2x16 + pcs"
INT8 = "INT8 per-channel"
BF16 = "bf16"
RANK = 4
FIT_SEED = 1234


# ----------------------------------------------------------------------------------------------------------------------
# Rounding helpers
# ----------------------------------------------------------------------------------------------------------------------

def f16(x):
    """Round to FP16 and back (float64)."""
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def bf16_bits(x):
    """BF16 bit patterns (uint16) of x, rounded to nearest even from float32 (finite values only)."""
    u = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16(x):
    """Round to BF16 and back (float64)."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def row_scales(w):
    """s_o = sqrt(mean_j W²) rounded through FP16; zero → 1 (seeds §3)."""
    s = f16(np.sqrt((w * w).mean(1)))
    s[s == 0] = 1.0
    return s


# ----------------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------------

def quant_lut4(w):
    """Scalar 16-entry codebook (quantile init + 1-D Lloyd), FP16-rounded before nearest indices."""
    s = row_scales(w)
    x = (w / s[:, None]).ravel()
    lut = np.quantile(x, (np.arange(16) + 0.5) / 16)
    for _ in range(30):
        a = np.abs(x[:, None] - lut[None, :]).argmin(1)
        for k in range(16):
            if (a == k).any():
                lut[k] = x[a == k].mean()
    lut = f16(np.sort(lut))
    idx = np.abs(x[:, None] - lut[None, :]).argmin(1).reshape(w.shape).astype(np.uint8)
    return {"lut": lut.reshape(16, 1), "idx": idx, "scale": s}


def quant_vec2x16(w, rng):
    """16 two-component centroids over pairs of consecutive output rows at one input column (seeds §2)."""
    cout, cin = w.shape
    assert cout % 2 == 0
    s = row_scales(w)
    n = w / s[:, None]
    # vector (g, j) = (n[2g, j], n[2g+1, j])
    v = n.reshape(cout // 2, 2, cin).transpose(0, 2, 1).reshape(-1, 2)
    best = None
    for _ in range(3):
        c = v[rng.choice(len(v), 16, replace=False)].copy()
        for _ in range(50):
            a = ((v[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
            for k in range(16):
                if (a == k).any():
                    c[k] = v[a == k].mean(0)
        err = ((v - c[a]) ** 2).sum()
        if best is None or err < best[0]:
            best = (err, c)
    lut = f16(best[1])
    idx = ((v[:, None, :] - lut[None]) ** 2).sum(-1).argmin(1).reshape(cout // 2, cin).astype(np.uint8)
    return {"lut": lut, "idx": idx, "scale": s}


def quant_int8(w):
    """Symmetric per-row INT8: s = max|w| / 127 rounded to FP16 (0 → 1), q = clip(round(w / s), ±127) (seeds §9)."""
    s = f16(np.abs(w).max(1) / 127.0)
    s[s == 0] = 1.0
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return {"int8": q, "scale": s}


def dequant(t):
    """Ŵ in the stored basis, float64, exactly from the stored (FP16/U8/I8) values."""
    if "lut" in t:
        lut, idx, s = t["lut"], t["idx"], t["scale"]
        d = lut.shape[1]
        g, cin = idx.shape
        w = np.empty((g * d, cin))
        for tt in range(d):
            w[tt::d] = lut[idx.astype(np.int64), tt]  # row d·g + t = L[I[g, :], t]
        return w * s[:, None]
    if "int8" in t:
        return t["int8"].astype(np.float64) * t["scale"][:, None]
    return t["weight"]


def lowrank(w_ref, w_q, r):
    """Rank-r factors of E = W − Ŵ: A = U[:, :r]·σ, B = Vᵀ[:r], both FP16 (seeds §8, exact SVD here)."""
    u, sv, vt = np.linalg.svd(w_ref - w_q, full_matrices=False)
    return f16(u[:, :r] * sv[:r]), f16(vt[:r])


# ----------------------------------------------------------------------------------------------------------------------
# Rotation (seeds §6)
# ----------------------------------------------------------------------------------------------------------------------

def block_for(dim):
    """1024 where it divides dim, else the largest power of two dividing dim."""
    b = 1
    while dim % (2 * b) == 0 and 2 * b <= 1024:
        b *= 2
    return b


def hadamard(b):
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation_matrix(dim, seed, block):
    """M = D · blockdiag(H/√b) with signs = default_rng(seed).choice([-1.0, 1.0], dim)."""
    assert dim % block == 0
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], dim)
    hb = hadamard(block) / np.sqrt(block)
    m = np.zeros((dim, dim))
    for k in range(0, dim, block):
        m[k:k + block, k:k + block] = hb
    return signs[:, None] * m


# ----------------------------------------------------------------------------------------------------------------------
# Independent float64 forward (copied from tools/check_qwen35_fixtures.py, weights passed in)
# ----------------------------------------------------------------------------------------------------------------------

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


def forward(w, tc, ids, pre="model."):
    T = len(ids)
    eps = tc["rms_norm_eps"]
    H, KVH, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    K = tc["linear_conv_kernel_dim"]
    rp = tc["rope_parameters"]
    rot = int(hd * rp.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rp["rope_theta"] ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    ang = np.arange(T)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)
    sin = np.concatenate([np.sin(ang)] * 2, -1)

    def rope(x):
        xr, xp = x[..., :rot], x[..., rot:]
        half = rot // 2
        rh = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
        return np.concatenate([xr * cos[:, None] + rh * sin[:, None], xp], -1)

    def zc_norm(x, name):
        return rms(x, eps) * (1.0 + w[name])

    x = w[pre + "embed_tokens.weight"][ids]
    for i, lt in enumerate(layer_types_of(tc)):
        p = f"{pre}layers.{i}."
        h = zc_norm(x, p + "input_layernorm.weight")
        if lt == "full_attention":
            qg = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KVH, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KVH, hd)
            q = rope(zc_norm(q, p + "self_attn.q_norm.weight"))
            k = rope(zc_norm(k, p + "self_attn.k_norm.weight"))
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
            qkv = h @ w[a_ + "in_proj_qkv.weight"].T
            cw = w[a_ + "conv1d.weight"][:, 0, :]
            padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], 0)
            conv = np.stack([(padded[t:t + K] * cw.T).sum(0) for t in range(T)])
            conv = silu(conv)
            q = conv[:, :nk * dk].reshape(T, nk, dk)
            k = conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
            v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
            z = (h @ w[a_ + "in_proj_z.weight"].T).reshape(T, nv, dv)
            beta = sigmoid(h @ w[a_ + "in_proj_b.weight"].T)
            g = -np.exp(w[a_ + "A_log"]) * softplus(h @ w[a_ + "in_proj_a.weight"].T + w[a_ + "dt_bias"])
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            rep = nv // nk
            S = np.zeros((nv, dk, dv))
            o = np.zeros((T, nv, dv))
            for t in range(T):
                for j in range(nv):
                    kj, qj = k[t, j // rep], q[t, j // rep]
                    S[j] *= np.exp(g[t, j])
                    delta = (v[t, j] - kj @ S[j]) * beta[t, j]
                    S[j] += np.outer(kj, delta)
                    o[t, j] = qj @ S[j]
            o = rms(o, eps) * w[a_ + "norm.weight"] * silu(z)
            mix = o.reshape(T, nv * dv) @ w[a_ + "out_proj.weight"].T
        x = x + mix
        h = zc_norm(x, p + "post_attention_layernorm.weight")
        m = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + m @ w[p + "mlp.down_proj.weight"].T
    x = zc_norm(x, pre + "norm.weight")
    lm = w.get("lm_head.weight", w[pre + "embed_tokens.weight"])
    return x @ lm.T


# ----------------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------------

def encode(name, arr):
    """(safetensors dtype, little-endian bytes) of one tensor, by its suffix."""
    if name.endswith((".lut", ".scale", ".lr_a", ".lr_b")):
        return "F16", arr.astype("<f2").tobytes()
    if name.endswith(".idx"):
        return "U8", arr.astype(np.uint8).tobytes()
    if name.endswith(".int8"):
        return "I8", arr.astype(np.int8).tobytes()
    if name.endswith(".weight"):
        return "BF16", bf16_bits(arr).astype("<u2").tobytes()
    raise ValueError(name)


def write(path, mats, meta):
    """mats: {key: {suffix: array}} → tensors `<key>.<suffix>`. A minimal safetensors writer (8-byte LE header
    length, JSON header with `__metadata__`, tensors in name order), so reruns are byte-identical."""
    header = {"__metadata__": {k: str(v) for k, v in sorted(meta.items())}}
    blobs, off = [], 0
    for name in sorted(f"{key}.{suf}" for key, t in mats.items() for suf in t):
        key, suf = name.rsplit(".", 1)
        arr = np.ascontiguousarray(mats[key][suf])
        dtype, data = encode(name, arr)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def main():
    cfg = json.load(open(os.path.join(SRC, "config.json")))
    assert cfg["model_type"] == "qwen3_5_text"
    tc = cfg
    src = {k: v.astype(np.float64) for k, v in load_file(os.path.join(SRC, "model.safetensors")).items()}
    ids = [int(t) for t in open(os.path.join(SRC, "tokens.txt")).read().split()]

    # Sanity: the copied forward on the unquantized checkpoint reproduces the transformers oracle.
    ref = np.load(os.path.join(SRC, "logits.npy"))
    base = forward(src, tc, ids)
    d0 = np.abs(base - ref).max()
    print(f"unquantized numpy forward vs qwen35_tiny/logits.npy: max abs diff {d0:.3e}")
    assert d0 < 1e-4, d0

    rng = np.random.default_rng(FIT_SEED)
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.remove(os.path.join(OUT, f))
    eff = dict(src)  # effective (dequantized, original-basis) weights for the reference forward
    lowrank_at = {"layers.0.linear_attn.in_proj_qkv", "layers.2.self_attn.q_proj"}
    hidden, inter = tc["hidden_size"], tc["intermediate_size"]
    stats = {}

    def record(canon, w, w_eff):
        stats[canon] = {
            "shape": list(w.shape),
            "snr_db": round(float(10 * np.log10((w * w).sum() / ((w - w_eff) ** 2).sum())), 3),
        }

    for l, lt in enumerate(layer_types_of(tc)):
        p = f"model.layers.{l}."
        # ---- MLP: vector 2x16 + pcs, online rotation ----
        b_in, b_mid = block_for(hidden), block_for(inter)
        m_in = rotation_matrix(hidden, 1000 + l, b_in)
        m_mid = rotation_matrix(inter, 2000 + l, b_mid)
        mats = {}
        meta = {"kind": "mlp", "format": VEC2X16, "basis": "online", "seed_in": 1000 + l, "seed_mid": 2000 + l,
                "block": b_in}
        for key, m in (("mlp.gate_proj", m_in), ("mlp.up_proj", m_in), ("mlp.down_proj", m_mid)):
            w = src[p + key + ".weight"]
            t = quant_vec2x16(w @ m, rng)  # W' = W M
            mats[key] = t
            meta[f"{key}.format"] = VEC2X16
            w_eff = dequant(t) @ m.T  # Q_eff = Q' Mᵀ
            eff[p + key + ".weight"] = w_eff
            record(f"layers.{l}.{key}", w, w_eff)
        write(os.path.join(OUT, f"layer_{l:02d}.safetensors"), mats, meta)

        # ---- token mixer ----
        mats = {}
        meta = {"kind": "mixer", "format": LUT4, "kv_format": INT8}
        if lt == "full_attention":
            plan = [("self_attn.q_proj", LUT4), ("self_attn.k_proj", INT8), ("self_attn.v_proj", INT8),
                    ("self_attn.o_proj", LUT4)]
        else:
            plan = [("linear_attn.in_proj_qkv", LUT4), ("linear_attn.in_proj_z", LUT4),
                    ("linear_attn.in_proj_a", BF16), ("linear_attn.in_proj_b", BF16),
                    ("linear_attn.out_proj", LUT4)]
        for key, fmt in plan:
            w = src[p + key + ".weight"]
            if fmt == LUT4:
                t = quant_lut4(w)
            elif fmt == INT8:
                t = quant_int8(w)
            else:
                t = {"weight": bf16(w)}
            w_eff = dequant(t)
            canon = f"layers.{l}.{key}"
            if canon in lowrank_at:
                a, b = lowrank(w, w_eff, RANK)
                t["lr_a"], t["lr_b"] = a, b
                w_eff = w_eff + a @ b  # y = Q x + A(B x), plain basis
            mats[key] = t
            meta[f"{key}.format"] = fmt
            eff[p + key + ".weight"] = w_eff
            record(canon, w, w_eff)
        write(os.path.join(OUT, f"layer_{l:02d}_mixer.safetensors"), mats, meta)

    # ---- head: LUT4 ----
    w = src["lm_head.weight"]
    t = quant_lut4(w)
    eff["lm_head.weight"] = dequant(t)
    record("lm_head", w, eff["lm_head.weight"])
    write(os.path.join(OUT, "lm_head.safetensors"), {"lm_head": t}, {"kind": "head", "format": LUT4, "lm_head.format": LUT4})

    logits = forward(eff, tc, ids)
    np.save(os.path.join(OUT, "logits.npy"), logits.astype("<f4"))
    dq = np.abs(logits - ref).max()
    print(f"quantized numpy forward vs unquantized oracle: max abs diff {dq:.3f}, "
          f"top-1 agreement {(logits.argmax(1) == ref.argmax(1)).mean():.3f}")

    def sha(fn):
        return hashlib.sha256(open(os.path.join(SRC, fn), "rb").read()).hexdigest()

    manifest = {
        "source": {"path": "../qwen35_tiny", "name": None, "model_type": cfg["model_type"],
                   "sha256": {"config.json": sha("config.json"), "model.safetensors": sha("model.safetensors")}},
        "export_format": 1,
        "method": "upstream-python",
        "tool": "tools/make_upstream_export.py",
        "seed": FIT_SEED,
        "plan": {"mlp": VEC2X16, "basis": "online", "mixer": LUT4, "mixer_basis": "plain", "kv": INT8, "head": LUT4},
        "kept_bf16": sorted(c for c in stats if c.endswith(("in_proj_a", "in_proj_b"))),
        "rotation": {"seed_in": "1000 + layer", "seed_mid": "2000 + layer", "block_in": block_for(hidden),
                     "block_mid": block_for(inter)},
        "lowrank": {"rank": RANK, "matrices": sorted(lowrank_at)},
        "tied_embeddings": False,
        "embedding": "from the source checkpoint (F32)",
        "matrices": stats,
    }
    with open(os.path.join(OUT, "forge.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {OUT} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
