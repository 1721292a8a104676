//! Online block-Hadamard rotations (ANEMLL Forge quantization guide, §6).
//!
//! Row-vector convention, as in ANEMLL Forge: an activation row `x` (length `dim`) becomes `x' = x M`, and a weight `W`
//! of shape `(Cout, dim)` whose *input* is rotated becomes `W' = W M`, so `x' W'ᵀ = x M Mᵀ Wᵀ = x Wᵀ`.
//! `M` is block-diagonal; block `k` is `M_k = D_k H / √b`, with `H` the `b × b` Sylvester Hadamard matrix and
//! `D = diag(signs)` over the whole dimension (ANEMLL Forge's "`M = D H / 32`" for `b = 1024`). Because `D` stands on the
//! left, `x M` multiplies `x` by the signs *first*, then transforms each block: `x' = FWHT(x ⊙ s) / √b`. The
//! inverse `x Mᵀ = x H D / √b` transforms first and multiplies by the signs after.
//!
//! The signs are `numpy.random.default_rng(seed).choice([-1.0, 1.0], dim)` — one draw over the whole dimension, so
//! that exports written by the upstream tools (which record only seed and block width) rotate identically here.
//! Seeds: `1000 + layer` for the MLP gate/up input, `2000 + layer` for the down input (and `3000 + layer` /
//! `4000 + layer` for token-mixer inputs / outputs).
//!
//! `M` is never materialised on the hot path: rows are rotated with the fast Walsh–Hadamard transform.

use crate::fwht::{fwht_blocks, hadamard_entry, headroom, scale_pow2};
use anyhow::{bail, Result};

use crate::numpy_rng::rotation_signs;

/// Widest Hadamard block (ANEMLL Forge's 1024, whose normalisation is the exact 1/32).
pub const MAX_BLOCK: usize = 1024;

/// Below this many elements a rotation is not worth a rayon split (one decode row, a few verify rows).
const PAR_MIN_ELEMS: usize = 1 << 15;

/// A seeded block-Hadamard rotation of vectors of length `dim`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rotation {
    pub dim: usize,
    pub block: usize,
    pub seed: u64,
    signs: Vec<f32>,
    /// The signs as bits (bit `k` of byte `i` set where `signs[8i + k]` is −1), applied with
    /// `1/√block` in one pass: a decode rotates each layer's inputs once a token, and the signs,
    /// evicted by the weight stream in between, come from memory on every call; as f32 they
    /// would cost 1–2 % of SmolLM2's decode time, as bits they are 1/32 of the lines.
    sign_bits: Vec<u8>,
    /// `1/√block`.
    norm: f32,
}

impl Rotation {
    /// The rotation ANEMLL Forge uses for `dim`: block from [`Rotation::block_for`], signs from numpy's generator.
    pub fn new(dim: usize, seed: u64) -> Self {
        Self::build(dim, Self::block_for(dim), seed)
    }

    /// A rotation with an explicit block width (as recorded in an export's `block` metadata).
    pub fn with_block(dim: usize, block: usize, seed: u64) -> Result<Self> {
        if block == 0 || !block.is_power_of_two() {
            bail!("rotation block {block} is not a power of two");
        }
        if !dim.is_multiple_of(block) {
            bail!("rotation block {block} does not divide the dimension {dim}");
        }
        Ok(Self::build(dim, block, seed))
    }

    /// 1024 where it divides `dim`, else the largest power of two dividing `dim` (SmolLM2: 576 → 64, 1536 → 512).
    pub fn block_for(dim: usize) -> usize {
        if dim == 0 {
            return 1;
        }
        (1usize << dim.trailing_zeros()).min(MAX_BLOCK)
    }

    fn build(dim: usize, block: usize, seed: u64) -> Self {
        let signs = rotation_signs(seed, dim);
        let norm = 1.0 / (block as f32).sqrt();
        let mut sign_bits = vec![0u8; dim.div_ceil(8)];
        for (i, _) in signs.iter().enumerate().filter(|(_, &s)| s < 0.0) {
            sign_bits[i / 8] |= 1 << (i % 8);
        }
        Self { dim, block, seed, signs, sign_bits, norm }
    }

    /// The ±1 diagonal `D` (numpy's `choice([-1.0, 1.0], dim)`).
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    fn check_rows(&self, len: usize, what: &str) {
        assert!(
            self.dim > 0 && len.is_multiple_of(self.dim),
            "rotation: {what} of length {len} is not a whole number of rows of {}",
            self.dim
        );
    }

    fn for_each_row(&self, x: &mut [f32], f: impl Fn(&mut [f32]) + Sync) {
        if x.len() >= PAR_MIN_ELEMS && x.len() > self.dim {
            crate::team::par_rows(x, self.dim, &f);
        } else {
            x.chunks_exact_mut(self.dim).for_each(f);
        }
    }

    /// The signs and `1/√block` first, then the butterflies: a butterfly's larger output is
    /// at least as large as both its inputs (`|p ± q|`), so no sum exceeds the largest result,
    /// and nothing overflows that does not overflow in the result.
    fn forward_row(&self, row: &mut [f32]) {
        sign_scale(SignIo::InPlace(row), &self.sign_bits, self.norm);
        fwht_blocks(row, self.block);
    }

    fn inverse_row(&self, row: &mut [f32]) {
        // The butterflies come first here, their sums up to `block` times the input, which
        // `1/√block` then brings down: room is made where they could overflow.
        let k = headroom(row, self.block as f32);
        scale_pow2(row, -k);
        fwht_blocks(row, self.block);
        sign_scale(SignIo::InPlace(row), &self.sign_bits, self.norm);
        scale_pow2(row, k);
    }

    /// `x ← x M` for `x` holding T rows of `dim` (the online activation rotation).
    pub fn apply_rows(&self, x: &mut [f32]) {
        self.check_rows(x.len(), "activation");
        self.for_each_row(x, |r| self.forward_row(r));
    }

    /// `out = x M` (as [`Rotation::apply_rows`] on a copy, with the same bits, the sign pass
    /// doing the copy).
    pub fn apply_rows_into(&self, x: &[f32], out: &mut [f32]) {
        self.check_rows(x.len(), "activation");
        assert_eq!(x.len(), out.len(), "rotation: {} inputs for {} outputs", x.len(), out.len());
        let n = self.dim;
        let rows = |r0: usize, out: &mut [f32]| {
            for (xr, or) in x[r0 * n..].chunks_exact(n).zip(out.chunks_exact_mut(n)) {
                sign_scale(SignIo::Into(xr, or), &self.sign_bits, self.norm);
                fwht_blocks(or, self.block);
            }
        };
        if x.len() >= PAR_MIN_ELEMS && x.len() > n {
            // Each task reads its own rows of `x` (a copy first, on the calling thread, would
            // cost about 1 % of SmolLM2's prefill time while the other workers wait).
            let per = (x.len() / n).div_ceil(2 * rayon::current_num_threads()).max(1);
            crate::team::par_chunks_mut(out, per * n, &|i, c| rows(i * per, c));
        } else {
            rows(0, out);
        }
    }

    /// `x ← x Mᵀ` (undoes [`Rotation::apply_rows`]).
    pub fn apply_inverse_rows(&self, x: &mut [f32]) {
        self.check_rows(x.len(), "activation");
        self.for_each_row(x, |r| self.inverse_row(r));
    }

    /// `W ← W M` for a row-major `cout × dim` weight whose input this rotation rotates.
    pub fn rotate_weight(&self, w: &mut [f32], cout: usize) {
        assert_eq!(w.len(), cout * self.dim, "rotation: weight is not {cout} × {}", self.dim);
        self.apply_rows(w);
    }

    /// `W ← W Mᵀ` (folds a weight stored in the rotated basis back, as ANEMLL Forge's reference `Q Mᵀ`).
    pub fn unrotate_weight(&self, w: &mut [f32], cout: usize) {
        assert_eq!(w.len(), cout * self.dim, "rotation: weight is not {cout} × {}", self.dim);
        self.apply_inverse_rows(w);
    }

    /// The dense `dim × dim` matrix `M` (row-major), for tests and inspection only — the runtime never builds it.
    pub fn to_dense(&self) -> Vec<f32> {
        let (n, b) = (self.dim, self.block);
        let mut m = vec![0f32; n * n];
        for i in 0..n {
            let blk = i / b * b;
            for j in blk..blk + b {
                m[i * n + j] = self.signs[i] * self.norm * hadamard_entry(i - blk, j - blk);
            }
        }
        m
    }
}

/// Where [`sign_scale`] reads and writes.
enum SignIo<'a> {
    InPlace(&'a mut [f32]),
    /// From the first slice into the second (of the same length).
    Into(&'a [f32], &'a mut [f32]),
}

/// Each value times `±norm`, minus where its bit of `bits` is set: `x · (s · norm)` for
/// `s = ±1` is `(±x) · norm` with the same rounding, so this equals multiplying by
/// `signs / √block` as f32, bit for bit.
fn sign_scale(io: SignIo, bits: &[u8], norm: f32) {
    let (src, dst, n) = match io {
        SignIo::InPlace(x) => (x.as_ptr(), x.as_mut_ptr(), x.len()),
        SignIo::Into(x, out) => {
            assert_eq!(x.len(), out.len(), "sign pass: {} inputs for {} outputs", x.len(), out.len());
            (x.as_ptr(), out.as_mut_ptr(), x.len())
        }
    };
    assert!(bits.len() * 8 >= n, "sign pass: {} bits for {n} values", bits.len() * 8);
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 is present; `src` and `dst` hold `n` values (the same ones in place,
        // each read before it is written) and `bits` at least `n` bits, as asserted above.
        return unsafe { sign_scale_avx2(src, dst, n, bits.as_ptr(), norm) };
    }
    // SAFETY: as above (index `i < n` on both pointers).
    unsafe { sign_scale_scalar(src, dst, 0, n, bits, norm) }
}

/// The portable sign pass over values `i0..n`.
///
/// # Safety
/// `src` and `dst` must hold `n` values (they may be the same), `bits` at least `n` bits.
unsafe fn sign_scale_scalar(src: *const f32, dst: *mut f32, i0: usize, n: usize, bits: &[u8], norm: f32) {
    for i in i0..n {
        let flip = ((bits[i / 8] >> (i % 8)) & 1) as u32;
        *dst.add(i) = f32::from_bits((*src.add(i)).to_bits() ^ (flip << 31)) * norm;
    }
}

/// [`sign_scale`] eight values at a time: a byte of bits shifted into the sign positions of
/// eight lanes, XORed in, then one multiply.
///
/// # Safety
/// AVX2 must be present; as [`sign_scale_scalar`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sign_scale_avx2(src: *const f32, dst: *mut f32, n: usize, bits: *const u8, norm: f32) {
    use std::arch::x86_64::*;
    let shifts = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
    let (top, vnorm) = (_mm256_set1_epi32(i32::MIN), _mm256_set1_ps(norm));
    let mut i = 0;
    while i + 8 <= n {
        let b = _mm256_set1_epi32(*bits.add(i / 8) as i32);
        let flip = _mm256_and_si256(_mm256_sllv_epi32(b, shifts), top);
        let v = _mm256_xor_ps(_mm256_loadu_ps(src.add(i)), _mm256_castsi256_ps(flip));
        _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(v, vnorm));
        i += 8;
    }
    sign_scale_scalar(src, dst, i, n, std::slice::from_raw_parts(bits, n.div_ceil(8)), norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::data;

    /// `a (r × k) · b (k × c)` in f64.
    fn matmul(a: &[f32], b: &[f32], r: usize, k: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0f64; r * c];
        for i in 0..r {
            for l in 0..k {
                let av = a[i * k + l] as f64;
                for j in 0..c {
                    out[i * c + j] += av * b[l * c + j] as f64;
                }
            }
        }
        out
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut t = vec![0f32; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = a[i * c + j];
            }
        }
        t
    }

    #[test]
    fn rotation_block_rule() {
        for (dim, b) in [(576, 64), (1536, 512), (1024, 1024), (2048, 1024), (5120, 1024), (17408, 1024), (96, 32)] {
            assert_eq!(Rotation::block_for(dim), b, "dim {dim}");
            assert_eq!(Rotation::new(dim, 1).block, b);
        }
        assert_eq!(Rotation::block_for(7), 1);
        assert!(Rotation::with_block(576, 128, 0).is_err());
        assert!(Rotation::with_block(576, 48, 0).is_err());
        assert!(Rotation::with_block(576, 0, 0).is_err());
        assert_eq!(Rotation::with_block(576, 32, 0).unwrap().block, 32);
    }

    #[test]
    fn rotation_signs_are_numpys() {
        let r = Rotation::new(1536, 2003);
        assert_eq!(r.signs(), rotation_signs(2003, 1536).as_slice());
        assert!(r.signs().iter().all(|&s| s == 1.0 || s == -1.0));
    }

    #[test]
    fn rotation_is_orthogonal_on_basis_vectors() {
        // Row i of the result of rotating e_i…e_n is row i of M; M Mᵀ = I checked by dot products.
        for (dim, seed) in [(576, 1000), (1536, 2000), (96, 7)] {
            let r = Rotation::new(dim, seed);
            let mut m = vec![0f32; dim * dim];
            for i in 0..dim {
                m[i * dim + i] = 1.0;
            }
            r.apply_rows(&mut m);
            let mut worst = 0f64;
            // Every 5th row against all rows keeps the check O(dim³/5) while still crossing every block.
            for i in (0..dim).step_by(5) {
                for j in 0..dim {
                    let dot: f64 = (0..dim).map(|k| m[i * dim + k] as f64 * m[j * dim + k] as f64).sum();
                    worst = worst.max((dot - if i == j { 1.0 } else { 0.0 }).abs());
                }
            }
            assert!(worst < 1e-6, "dim {dim}: |M Mᵀ - I| = {worst}");
            // And the inverse undoes it: applying Mᵀ to the rows of M gives I.
            r.apply_inverse_rows(&mut m);
            for i in 0..dim {
                for j in 0..dim {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((m[i * dim + j] - want).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn sign_pass_equals_multiplying_by_the_scaled_signs() {
        for n in [1, 7, 8, 9, 64, 100, 576, 1541] {
            let signs = rotation_signs(77 + n as u64, n);
            let mut bits = vec![0u8; n.div_ceil(8)];
            for (i, _) in signs.iter().enumerate().filter(|(_, &s)| s < 0.0) {
                bits[i / 8] |= 1 << (i % 8);
            }
            let norm = 1.0 / (64f32).sqrt();
            let mut x = data(n, 9);
            x[0] = -0.0;
            let want: Vec<u32> = x.iter().zip(&signs).map(|(v, s)| (v * (s * norm)).to_bits()).collect();
            let mut into = vec![f32::NAN; n];
            sign_scale(SignIo::Into(&x, &mut into), &bits, norm);
            let mut scalar = vec![f32::NAN; n];
            // SAFETY: both hold n values, `bits` n bits.
            unsafe { sign_scale_scalar(x.as_ptr(), scalar.as_mut_ptr(), 0, n, &bits, norm) };
            sign_scale(SignIo::InPlace(&mut x), &bits, norm);
            for got in [&into, &scalar, &x] {
                assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "n = {n}");
            }
        }
    }

    #[test]
    fn rotation_into_a_buffer_equals_rotation_in_place() {
        for (dim, t) in [(576, 1), (1536, 3), (1024, 40), (576, 61)] {
            let r = Rotation::new(dim, 1001);
            let x = data(dim * t, 5);
            let mut a = x.clone();
            r.apply_rows(&mut a);
            let mut b = vec![f32::NAN; x.len()];
            r.apply_rows_into(&x, &mut b);
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn rotation_fast_path_equals_dense_matrix() {
        for (dim, seed) in [(576, 1003), (1536, 2003), (2048, 4063)] {
            let r = Rotation::new(dim, seed);
            let dense = r.to_dense();
            let t = 3;
            let x0 = data(t * dim, seed as u32);
            let want = matmul(&x0, &dense, t, dim, dim);
            let mut x = x0.clone();
            r.apply_rows(&mut x);
            let err = x.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "dim {dim}: {err}");
            // Inverse: x Mᵀ.
            let want_inv = matmul(&x0, &transpose(&dense, dim, dim), t, dim, dim);
            let mut y = x0.clone();
            r.apply_inverse_rows(&mut y);
            let err = y.iter().zip(&want_inv).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "dim {dim} inverse: {err}");
        }
    }

    #[test]
    fn rotation_dense_block_is_signs_times_hadamard() {
        // M = D H / √b: row i of a block is sign_i · H[i, ·] / √b (signs scale rows, not columns).
        let r = Rotation::with_block(16, 8, 5).unwrap();
        let m = r.to_dense();
        let s = r.signs();
        for i in 0..16 {
            for j in 0..16 {
                let same = i / 8 == j / 8;
                let want = if same { s[i] * hadamard_entry(i % 8, j % 8) / 8f32.sqrt() } else { 0.0 };
                assert_eq!(m[i * 16 + j], want);
            }
        }
    }

    #[test]
    fn rotation_preserves_the_linear_map() {
        // (x M)(W M)ᵀ = x Wᵀ, on SmolLM2's MLP shapes: gate/up input 576, down input 1536.
        for (dim, cout, seed) in [(576, 96, 1000u64), (1536, 40, 2000)] {
            let r = Rotation::new(dim, seed);
            let t = 5;
            let x0 = data(t * dim, 1);
            let w0 = data(cout * dim, 2);
            let want = matmul(&x0, &transpose(&w0, cout, dim), t, dim, cout);
            let (mut x, mut w) = (x0.clone(), w0.clone());
            r.apply_rows(&mut x);
            r.rotate_weight(&mut w, cout);
            let got = matmul(&x, &transpose(&w, cout, dim), t, dim, cout);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "dim {dim}: {err}");
            r.unrotate_weight(&mut w, cout);
            let back = w.iter().zip(&w0).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(back < 1e-6, "dim {dim}: unrotate error {back}");
        }
    }

    /// Rows at the edges of f32 (one whose inverse sums leave f32 though its result does not,
    /// huge, subnormal and mixed magnitudes) through both directions: within a few roundings of
    /// the dense f64 product, and the buffer form equal to the in-place one.
    #[test]
    fn rotations_are_total_over_finite_inputs() {
        for (dim, seed) in [(576, 1003), (1024, 3001)] {
            let r = Rotation::new(dim, seed);
            let (b, dense) = (r.block, r.to_dense());
            let base = data(dim, seed as u32);
            // Constant within each block after the signs: the inverse's first sum is `block`
            // times the value, its result `√block` times.
            let constant: Vec<f32> = (0..dim).map(|i| f32::MAX / b as f32 * 4.0 * r.signs()[i]).collect();
            let cases: Vec<(&str, Vec<f32>)> = vec![
                ("constant near the limit", constant.iter().map(|v| v.abs()).collect()),
                ("huge", base.iter().map(|v| v * (f32::MAX / 8.0)).collect()),
                ("subnormal", base.iter().map(|v| v * 1e-40).collect()),
                ("mixed", base.iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 77) as i32 - 38)).collect()),
            ];
            for (name, x) in &cases {
                let l1: f64 = x.iter().map(|&v| v.abs() as f64).sum();
                // A rounding per stage of sums of at most Σ|x|·(1/√b), one for the scaling, and
                // where values are subnormal one unit per scaled value summed (the forward
                // direction scales before it sums).
                let tol = (b.trailing_zeros() as f64 + 2.0) * f32::EPSILON as f64 * l1 / (b as f64).sqrt()
                    + b as f64 * f32::from_bits(1) as f64;
                let check = |what: &str, got: &[f32], want: &[f64]| {
                    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            g.is_finite() && (g as f64 - w).abs() <= tol,
                            "{what} {name} dim {dim} [{i}]: {g} vs {w}"
                        );
                    }
                };
                let forward = matmul(x, &dense, 1, dim, dim);
                if forward.iter().all(|v| v.abs() <= f32::MAX as f64) {
                    let mut a = x.clone();
                    r.apply_rows(&mut a);
                    check("forward", &a, &forward);
                    let mut into = vec![f32::NAN; dim];
                    r.apply_rows_into(x, &mut into);
                    assert_eq!(a, into, "{name} dim {dim}: into a buffer");
                }
                let inverse = matmul(x, &transpose(&dense, dim, dim), 1, dim, dim);
                assert!(inverse.iter().all(|v| v.abs() <= f32::MAX as f64), "{name}: the test's result leaves f32");
                let mut y = x.clone();
                r.apply_inverse_rows(&mut y);
                check("inverse", &y, &inverse);
            }
        }
    }

    #[test]
    fn rotation_parallel_rows_match_one_at_a_time() {
        let r = Rotation::new(1536, 2011);
        let rows = 29;
        let x0 = data(rows * 1536, 9);
        let mut all = x0.clone();
        r.apply_rows(&mut all);
        let mut single = x0;
        single.chunks_exact_mut(1536).for_each(|row| r.apply_rows(row));
        assert_eq!(all, single);
    }
}
