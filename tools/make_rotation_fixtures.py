#!/usr/bin/env python3
# Command (run from the repository root):
#   /work/pyenv/bin/python tools/make_rotation_fixtures.py
# Writes tests/fixtures/rotation_signs.json (numpy 2.4.6 when generated; the output is deterministic).
#
# Oracle for crates/forge-quant/src/numpy_rng.rs. The upstream tools draw block-Hadamard rotation signs as
# `numpy.random.default_rng(seed).choice([-1.0, 1.0], n)`; Forge must reproduce them bit for bit.
#
# Layout:
#   signs[]: {seed, lengths, signs}. `signs` is numpy's choice for the longest length as a '+'/'-' string
#     (+ = +1.0). For every n in `lengths` this script asserts that a fresh default_rng(seed).choice([-1.0, 1.0], n)
#     equals signs[:n], so one string per seed stands for all lengths (keeps the file small).
#   seed_sequence[]: SeedSequence(seed).pool and generate_state(4, uint64) — the PCG64 state words.
#   pcg64[]: np.random.PCG64(seed): state/inc after seeding (decimal strings, they are 128-bit) and random_raw(8).
#   random[]: default_rng(seed).random(5) as values and as IEEE-754 bit patterns (hex), compared by bits.
#   integers[]: default_rng(seed).integers(low, high, size) (int64, high exclusive) across the bounded-integer paths.
#   mixed[]: one Generator making interleaved calls, to pin down the buffered 32-bit half across calls.
import json
import os
import struct

import numpy as np

SEEDS = [0, 1, 1000, 1003, 2000, 3007, 4063, 2**32 + 5, 12345678901]
LENGTHS = [1, 7, 576, 1024, 1536, 5120, 17408]


def bits(x):
    return "%016x" % struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def main():
    out = {
        "about": "numpy.random reference values; written by tools/make_rotation_fixtures.py",
        "numpy": np.__version__,
        "signs": [],
        "seed_sequence": [],
        "pcg64": [],
        "random": [],
        "integers": [],
        "mixed": [],
    }
    longest = max(LENGTHS)
    for seed in SEEDS:
        full = np.random.default_rng(seed).choice([-1.0, 1.0], longest)
        assert full.dtype == np.float64 and set(np.unique(full)) <= {-1.0, 1.0}
        for n in LENGTHS:
            got = np.random.default_rng(seed).choice([-1.0, 1.0], n)
            assert np.array_equal(got, full[:n]), (seed, n)
        out["signs"].append(
            {"seed": seed, "lengths": LENGTHS, "signs": "".join("+" if v > 0 else "-" for v in full)}
        )

        ss = np.random.SeedSequence(seed)
        out["seed_sequence"].append(
            {
                "seed": seed,
                "pool": [int(v) for v in ss.pool],
                "state_u64": [int(v) for v in ss.generate_state(4, np.uint64)],
                "state_u32": [int(v) for v in ss.generate_state(6, np.uint32)],
            }
        )

        bg = np.random.PCG64(seed)
        st = bg.state["state"]
        out["pcg64"].append(
            {
                "seed": seed,
                "state": str(st["state"]),
                "inc": str(st["inc"]),
                "raw": [int(v) for v in bg.random_raw(8)],
            }
        )

        r = np.random.default_rng(seed).random(5)
        out["random"].append({"seed": seed, "values": [float(v) for v in r], "bits": [bits(v) for v in r]})

    for seed, low, high, size in [
        (0, 0, 2, 16),
        (1, 0, 10, 20),
        (2, -5, 5, 20),
        (3, 0, 2**32 - 1, 10),
        (4, 0, 2**32, 10),
        (5, 7, 2**32 + 7 + 12345, 10),
        (6, 0, 2**40 + 3, 10),
        (7, -(2**62), 2**62, 10),
        (8, 0, 3 * 2**30 + 1, 20),
        (9, 42, 43, 5),
    ]:
        v = np.random.default_rng(seed).integers(low, high, size=size)
        assert v.dtype == np.int64
        out["integers"].append({"seed": seed, "low": low, "high": high, "values": [int(x) for x in v]})

    g = np.random.default_rng(77)
    ops = []
    for kind, arg in [("integers", (0, 10, 3)), ("random", 2), ("integers", (0, 10, 1)), ("choice", 5),
                      ("random", 1), ("integers", (0, 2**33, 2))]:
        if kind == "integers":
            lo, hi, n = arg
            ops.append({"op": "integers", "low": lo, "high": hi, "values": [int(x) for x in g.integers(lo, hi, n)]})
        elif kind == "random":
            ops.append({"op": "random", "bits": [bits(x) for x in g.random(arg)]})
        elif kind == "choice":
            ops.append({"op": "choice", "signs": "".join("+" if v > 0 else "-" for v in g.choice([-1.0, 1.0], arg))})
    out["mixed"].append({"seed": 77, "ops": ops})

    path = os.path.join("tests", "fixtures", "rotation_signs.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    size = os.path.getsize(path)
    assert size < 200_000, size
    print(f"wrote {path} ({size} bytes)")


if __name__ == "__main__":
    main()
