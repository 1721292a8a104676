#!/usr/bin/env python3
# Regenerate the GGUF dequantization fixture (run from the workspace root):
#   /work/pyenv/bin/python tools/make_gguf_quant_fixtures.py
#
# Builds random blocks for each tensor type that forge-core's `gguf::dequantize` supports,
# dequantizes them with gguf-py's numpy reference (`gguf.quants.dequantize`), and writes
# tests/fixtures/gguf_quants.json: raw block bytes and expected f32 values, both as hex so the
# comparison in the Rust test (`gguf::tests::dequantize_matches_gguf_py`) is bit-exact and
# independent of JSON float formatting. Also records gguf-py's (block size, type size) table.
#
# Q8_K and F64 have no gguf-py dequantizer; their expected values are computed here with numpy
# (d * q, and a plain f64 -> f32 cast) and marked with "oracle": "numpy".
import importlib.metadata
import json
import os

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

SEED = 20240607
N_BLOCKS = 2
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf_quants.json")

# Byte offsets of the f16 scale fields inside one block (ggml-common.h). Random bytes are fine
# for the quants, but a random f16 scale could be inf/NaN, which tests nothing useful.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64],
}

rng = np.random.default_rng(SEED)


def small_f16(n):
    # Spread over a few binades and both signs, as real scales/mins are.
    return (rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-10, 2, n)).astype(np.float16)


def random_blocks(name):
    block_size, type_size = GGML_QUANT_SIZES[T[name]]
    data = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        data[:, off:off + 2] = small_f16(N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
    return data.reshape(-1)


def non_nan_u16_bits(n, exp_mask, mant_mask):
    # Every finite, infinite, zero and subnormal pattern is fair game; NaN payload handling
    # differs between conversion routines and is not part of the contract.
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    nan = ((bits & exp_mask) == exp_mask) & ((bits & mant_mask) != 0)
    bits[nan] &= np.uint16(~exp_mask & 0xFFFF)
    return bits


cases = []


def add(name, data, expected, oracle="gguf-py"):
    expected = np.asarray(expected, dtype=np.float32).reshape(-1)
    cases.append({
        "type": name,
        "type_id": int(T[name]),
        "n_elements": int(expected.size),
        "oracle": oracle,
        "data_hex": data.tobytes().hex(),
        "expected_f32_hex": expected.astype("<f4").tobytes().hex(),
    })


# Plain float types.
f32 = np.concatenate([
    rng.standard_normal(56).astype(np.float32) * 10,
    np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-45, 3.4e38, -1.17549435e-38], dtype=np.float32),
])
add("F32", f32.view(np.uint8), dequantize(f32.view(np.uint8), T.F32))
f16 = non_nan_u16_bits(256, 0x7C00, 0x03FF)
add("F16", f16.view(np.uint8), dequantize(f16.view(np.uint8), T.F16))
bf16 = non_nan_u16_bits(256, 0x7F80, 0x007F)
add("BF16", bf16.view(np.uint8), dequantize(bf16.view(np.uint8), T.BF16))
f64 = np.concatenate([rng.standard_normal(30) * 1e3, [1e300, -1e-300]]).astype("<f8")
with np.errstate(over="ignore"):  # 1e300 -> inf on purpose
    add("F64", f64.view(np.uint8), f64.astype(np.float32), oracle="numpy")

# Block types with a gguf-py reference dequantizer.
for name in F16_FIELDS:
    data = random_blocks(name)
    add(name, data, dequantize(data, T[name]))

# Q8_K: f32 d, int8 qs[256], int16 bsums[16] (unused by dequantization).
block_size, type_size = GGML_QUANT_SIZES[T.Q8_K]
q8k = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
d = (rng.uniform(-1, 1, N_BLOCKS) * 1e-2).astype("<f4")
q8k[:, 0:4] = d.view(np.uint8).reshape(N_BLOCKS, 4)
qs = q8k[:, 4:4 + block_size].view(np.int8).astype(np.float32)
add("Q8_K", q8k.reshape(-1), d.reshape(-1, 1) * qs, oracle="numpy")

fixture = {
    "generator": "tools/make_gguf_quant_fixtures.py",
    "seed": SEED,
    "gguf_py_version": importlib.metadata.version("gguf"),
    "numpy_version": np.__version__,
    "quant_sizes": {t.name: [int(t), bs, ts] for t, (bs, ts) in GGML_QUANT_SIZES.items()},
    "cases": cases,
}
os.makedirs(os.path.dirname(OUT), exist_ok=True)
with open(OUT, "w") as f:
    json.dump(fixture, f, indent=1)
    f.write("\n")
print(f"wrote {len(cases)} cases to {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")
