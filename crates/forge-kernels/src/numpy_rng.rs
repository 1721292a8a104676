//! A bit-exact reimplementation of `numpy.random.default_rng(seed)` for non-negative integer seeds.
//!
//! Exports written by the upstream Python tools record only rotation *seeds*; the signs themselves were drawn with
//! `numpy.random.default_rng(seed).choice([-1.0, 1.0], n)`. To load such an export, Forge must draw the very same
//! signs, so this module follows numpy (2.x) step by step:
//!
//! - `SeedSequence(seed)`: the integer is split into little-endian 32-bit words, mixed into a 4-word pool with
//!   `hashmix`/`mix`, and `generate_state` expands the pool by cycling it through a second hash.
//! - `PCG64(seed)`: `generate_state(4, uint64)` gives `[s0, s1, i0, i1]`; the 128-bit seed is `s0·2⁶⁴ + s1`, the
//!   stream `i0·2⁶⁴ + i1`, and seeding is PCG's `srandom_r` (state 0, inc = 2·seq + 1, step, add seed, step).
//!   `next_uint64` steps the LCG first and then applies the XSL-RR output; `next_uint32` returns the low half of a
//!   fresh `next_uint64` and keeps the high half for the next call (the buffer persists across `Generator` calls,
//!   and `next_uint64`/`next_double` neither use nor clear it).
//! - `Generator.integers(low, high)` (int64, high exclusive) is `random_bounded_uint64_fill` with `use_masked=False`:
//!   ranges that fit 32 bits use Lemire's multiply-shift on `next_uint32`, wider ones on `next_uint64`, with numpy's
//!   rejection threshold.
//! - `Generator.choice(a, n)` with `replace=True, p=None` is `a[integers(0, len(a), n)]`.
//!
//! The values are pinned against numpy by `tests/fixtures/rotation_signs.json` (`tools/make_rotation_fixtures.py`).

use anyhow::{bail, Result};

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
const POOL_SIZE: usize = 4;

/// numpy's `SeedSequence` for an integer entropy value (no spawn key, default pool size 4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L.wrapping_mul(x).wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

impl SeedSequence {
    /// `numpy.random.SeedSequence(seed)`.
    pub fn new(seed: u64) -> Self {
        Self::from_u128(seed as u128)
    }

    /// `numpy.random.SeedSequence(seed)` for seeds up to 2¹²⁸ − 1.
    pub fn from_u128(seed: u128) -> Self {
        // numpy's `_int_to_uint32_array`: little-endian 32-bit words, and `[0]` (not `[]`) for zero.
        let mut words = Vec::new();
        let mut n = seed;
        if n == 0 {
            words.push(0);
        }
        while n > 0 {
            words.push(n as u32);
            n >>= 32;
        }
        Self::from_entropy_words(&words)
    }

    /// `SeedSequence(np.array(words, dtype=np.uint32))`: the entropy given directly as 32-bit words.
    pub fn from_entropy_words(entropy: &[u32]) -> Self {
        let mut pool = [0u32; POOL_SIZE];
        let mut hash_const = INIT_A;
        for (i, p) in pool.iter_mut().enumerate() {
            *p = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hash_const);
        }
        for src in 0..POOL_SIZE {
            for dst in 0..POOL_SIZE {
                if src != dst {
                    pool[dst] = mix(pool[dst], hashmix(pool[src], &mut hash_const));
                }
            }
        }
        for &e in entropy.iter().skip(POOL_SIZE) {
            for p in pool.iter_mut() {
                *p = mix(*p, hashmix(e, &mut hash_const));
            }
        }
        Self { pool }
    }

    /// The mixed entropy pool (`SeedSequence.pool`).
    pub fn pool(&self) -> [u32; POOL_SIZE] {
        self.pool
    }

    /// `generate_state(n, np.uint32)`.
    pub fn generate_state_u32(&self, n: usize) -> Vec<u32> {
        let mut hash_const = INIT_B;
        self.pool
            .iter()
            .cycle()
            .take(n)
            .map(|&p| {
                let mut v = p ^ hash_const;
                hash_const = hash_const.wrapping_mul(MULT_B);
                v = v.wrapping_mul(hash_const);
                v ^ (v >> XSHIFT)
            })
            .collect()
    }

    /// `generate_state(n, np.uint64)`: twice as many 32-bit words, read as little-endian pairs.
    pub fn generate_state_u64(&self, n: usize) -> Vec<u64> {
        self.generate_state_u32(2 * n).chunks_exact(2).map(|w| w[0] as u64 | (w[1] as u64) << 32).collect()
    }
}

const PCG_MULT: u128 = (2_549_297_995_355_413_924u128 << 64) | 4_865_540_595_714_422_341u128;

/// numpy's `PCG64` bit generator (PCG XSL-RR 128/64), including its 32-bit output buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    has_uint32: bool,
    uinteger: u32,
}

impl Pcg64 {
    /// `numpy.random.PCG64(seed)`.
    pub fn new(seed: u64) -> Self {
        Self::from_seed_sequence(&SeedSequence::new(seed))
    }

    /// `PCG64(seed_sequence)`.
    pub fn from_seed_sequence(ss: &SeedSequence) -> Self {
        let s = ss.generate_state_u64(4);
        let initstate = (s[0] as u128) << 64 | s[1] as u128;
        let initseq = (s[2] as u128) << 64 | s[3] as u128;
        let mut g = Self { state: 0, inc: (initseq << 1) | 1, has_uint32: false, uinteger: 0 };
        g.step();
        g.state = g.state.wrapping_add(initstate);
        g.step();
        g
    }

    /// A generator in the given raw state (`bit_generator.state["state"]`), with an empty 32-bit buffer.
    pub fn from_state(state: u128, inc: u128) -> Self {
        Self { state, inc, has_uint32: false, uinteger: 0 }
    }

    /// `(state, inc)` as numpy reports them in `bit_generator.state["state"]`.
    pub fn state(&self) -> (u128, u128) {
        (self.state, self.inc)
    }

    #[inline]
    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// `next_uint64` (= one value of `random_raw`).
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        ((s >> 64) as u64 ^ s as u64).rotate_right((s >> 122) as u32)
    }

    /// `next_uint32`: the low half of a fresh 64-bit output now, its high half on the next call.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.has_uint32 {
            self.has_uint32 = false;
            return self.uinteger;
        }
        let v = self.next_u64();
        self.has_uint32 = true;
        self.uinteger = (v >> 32) as u32;
        v as u32
    }

    /// `next_double`: a uniform double in [0, 1) from the top 53 bits of `next_uint64`.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }
}

/// `numpy.random.Generator` over [`Pcg64`], for the draws Forge needs to reproduce.
#[derive(Clone, Debug)]
pub struct Generator {
    bit_generator: Pcg64,
}

impl Generator {
    /// `numpy.random.default_rng(seed)`.
    pub fn new(seed: u64) -> Self {
        Self { bit_generator: Pcg64::new(seed) }
    }

    pub fn from_bit_generator(bit_generator: Pcg64) -> Self {
        Self { bit_generator }
    }

    pub fn bit_generator(&mut self) -> &mut Pcg64 {
        &mut self.bit_generator
    }

    /// `Generator.random()`.
    pub fn random(&mut self) -> f64 {
        self.bit_generator.next_f64()
    }

    /// `Generator.random(n)`.
    pub fn random_vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.random()).collect()
    }

    /// `Generator.integers(low, high, size=n)` with the default int64 dtype (high exclusive).
    pub fn integers(&mut self, low: i64, high: i64, n: usize) -> Result<Vec<i64>> {
        if low >= high {
            bail!("integers: low >= high ({low} >= {high})");
        }
        // numpy works with off = low and rng = (high - 1) - low as unsigned 64-bit values.
        let rng = (high as i128 - 1 - low as i128) as u64;
        let off = low as u64;
        Ok(self.bounded_u64_fill(off, rng, n).into_iter().map(|v| v as i64).collect())
    }

    /// The indices `Generator.choice(a, n)` picks for `len(a) == pop_size` with `replace=True, p=None`.
    pub fn choice_indices(&mut self, pop_size: usize, n: usize) -> Result<Vec<usize>> {
        if pop_size == 0 {
            bail!("choice: a cannot be empty unless no samples are taken");
        }
        Ok(self.bounded_u64_fill(0, pop_size as u64 - 1, n).into_iter().map(|v| v as usize).collect())
    }

    /// `Generator.choice([-1.0, 1.0], n)` as f32 (the values are exactly ±1).
    pub fn choice_signs(&mut self, n: usize) -> Vec<f32> {
        self.bounded_u64_fill(0, 1, n).into_iter().map(|i| if i == 1 { 1.0 } else { -1.0 }).collect()
    }

    /// `random_bounded_uint64_fill(state, off, rng, n, use_masked=False)`: values in `off + [0, rng]`.
    fn bounded_u64_fill(&mut self, off: u64, rng: u64, n: usize) -> Vec<u64> {
        let g = &mut self.bit_generator;
        if rng == 0 {
            vec![off; n]
        } else if rng == u32::MAX as u64 {
            (0..n).map(|_| off.wrapping_add(g.next_u32() as u64)).collect()
        } else if rng < u32::MAX as u64 {
            (0..n).map(|_| off.wrapping_add(bounded_lemire_u32(g, rng as u32) as u64)).collect()
        } else if rng == u64::MAX {
            (0..n).map(|_| off.wrapping_add(g.next_u64())).collect()
        } else {
            (0..n).map(|_| off.wrapping_add(bounded_lemire_u64(g, rng))).collect()
        }
    }
}

/// Lemire's bounded draw in `[0, rng]` from 32-bit outputs, with numpy's rejection rule.
fn bounded_lemire_u32(g: &mut Pcg64, rng: u32) -> u32 {
    let rng_excl = rng + 1;
    let mut m = g.next_u32() as u64 * rng_excl as u64;
    let mut leftover = m as u32;
    if leftover < rng_excl {
        let threshold = (u32::MAX - rng) % rng_excl;
        while leftover < threshold {
            m = g.next_u32() as u64 * rng_excl as u64;
            leftover = m as u32;
        }
    }
    (m >> 32) as u32
}

/// Lemire's bounded draw in `[0, rng]` from 64-bit outputs (`rng < u64::MAX`).
fn bounded_lemire_u64(g: &mut Pcg64, rng: u64) -> u64 {
    let rng_excl = rng + 1;
    let mut m = g.next_u64() as u128 * rng_excl as u128;
    let mut leftover = m as u64;
    if leftover < rng_excl {
        let threshold = (u64::MAX - rng) % rng_excl;
        while leftover < threshold {
            m = g.next_u64() as u128 * rng_excl as u128;
            leftover = m as u64;
        }
    }
    (m >> 64) as u64
}

/// Rotation signs exactly as the upstream tools draw them: `numpy.random.default_rng(seed).choice([-1.0, 1.0], n)`.
pub fn rotation_signs(seed: u64, n: usize) -> Vec<f32> {
    Generator::new(seed).choice_signs(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn fixture() -> Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/rotation_signs.json");
        let text = std::fs::read_to_string(path).expect("read rotation_signs.json (tools/make_rotation_fixtures.py)");
        serde_json::from_str(&text).unwrap()
    }

    fn u64s(v: &Value) -> Vec<u64> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
    }

    fn parse_signs(s: &str) -> Vec<f32> {
        s.chars().map(|c| if c == '+' { 1.0 } else { -1.0 }).collect()
    }

    fn f64_bits(v: &Value) -> Vec<u64> {
        v.as_array().unwrap().iter().map(|x| u64::from_str_radix(x.as_str().unwrap(), 16).unwrap()).collect()
    }

    #[test]
    fn numpy_seed_sequence_matches() {
        let fx = fixture();
        for case in fx["seed_sequence"].as_array().unwrap() {
            let seed = case["seed"].as_u64().unwrap();
            let ss = SeedSequence::new(seed);
            let pool: Vec<u64> = ss.pool().iter().map(|&p| p as u64).collect();
            assert_eq!(pool, u64s(&case["pool"]), "seed {seed}");
            assert_eq!(ss.generate_state_u64(4), u64s(&case["state_u64"]), "seed {seed}");
            let s32: Vec<u64> = ss.generate_state_u32(6).into_iter().map(u64::from).collect();
            assert_eq!(s32, u64s(&case["state_u32"]), "seed {seed}");
        }
    }

    #[test]
    fn numpy_pcg64_state_and_raw_outputs_match() {
        let fx = fixture();
        for case in fx["pcg64"].as_array().unwrap() {
            let seed = case["seed"].as_u64().unwrap();
            let mut g = Pcg64::new(seed);
            let state: u128 = case["state"].as_str().unwrap().parse().unwrap();
            let inc: u128 = case["inc"].as_str().unwrap().parse().unwrap();
            assert_eq!(g.state(), (state, inc), "seed {seed}");
            let raw: Vec<u64> = (0..8).map(|_| g.next_u64()).collect();
            assert_eq!(raw, u64s(&case["raw"]), "seed {seed}");
        }
    }

    #[test]
    fn numpy_random_doubles_match_bitwise() {
        let fx = fixture();
        for case in fx["random"].as_array().unwrap() {
            let seed = case["seed"].as_u64().unwrap();
            let got: Vec<u64> = Generator::new(seed).random_vec(5).into_iter().map(f64::to_bits).collect();
            assert_eq!(got, f64_bits(&case["bits"]), "seed {seed}");
        }
    }

    #[test]
    fn numpy_rotation_signs_match_choice() {
        let fx = fixture();
        let cases = fx["signs"].as_array().unwrap();
        assert!(cases.len() >= 9);
        for case in cases {
            let seed = case["seed"].as_u64().unwrap();
            let full = parse_signs(case["signs"].as_str().unwrap());
            for n in u64s(&case["lengths"]) {
                let n = n as usize;
                // The generator script asserts numpy's choice(n) is this prefix for every listed n.
                assert_eq!(rotation_signs(seed, n), full[..n], "seed {seed} n {n}");
            }
        }
    }

    #[test]
    fn numpy_integers_match_all_bounded_paths() {
        let fx = fixture();
        for case in fx["integers"].as_array().unwrap() {
            let seed = case["seed"].as_u64().unwrap();
            let (low, high) = (case["low"].as_i64().unwrap(), case["high"].as_i64().unwrap());
            let want: Vec<i64> = case["values"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
            let got = Generator::new(seed).integers(low, high, want.len()).unwrap();
            assert_eq!(got, want, "seed {seed} [{low}, {high})");
        }
    }

    #[test]
    fn numpy_mixed_calls_share_the_32_bit_buffer() {
        let fx = fixture();
        for case in fx["mixed"].as_array().unwrap() {
            let mut g = Generator::new(case["seed"].as_u64().unwrap());
            for op in case["ops"].as_array().unwrap() {
                match op["op"].as_str().unwrap() {
                    "integers" => {
                        let want: Vec<i64> =
                            op["values"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
                        let got = g.integers(op["low"].as_i64().unwrap(), op["high"].as_i64().unwrap(), want.len());
                        assert_eq!(got.unwrap(), want);
                    }
                    "random" => {
                        let want = f64_bits(&op["bits"]);
                        let got: Vec<u64> = g.random_vec(want.len()).into_iter().map(f64::to_bits).collect();
                        assert_eq!(got, want);
                    }
                    "choice" => {
                        let want = parse_signs(op["signs"].as_str().unwrap());
                        assert_eq!(g.choice_signs(want.len()), want);
                    }
                    other => panic!("unknown op {other}"),
                }
            }
        }
    }

    #[test]
    fn numpy_integers_rejects_empty_range() {
        assert!(Generator::new(0).integers(3, 3, 1).is_err());
        assert!(Generator::new(0).choice_indices(0, 1).is_err());
        assert_eq!(Generator::new(0).integers(5, 6, 3).unwrap(), vec![5, 5, 5]);
    }
}
