//! Fast Walsh–Hadamard transform (FWHT) over power-of-two lengths.
//!
//! The Hadamard matrix is Sylvester's, `H[i][j] = (-1)^popcount(i & j)`; it is symmetric and `H·H = n·I`, so the
//! unnormalized transform is its own inverse up to `1/n` and the normalized one (`/√n`) is orthogonal and an
//! involution. Online block-Hadamard rotations apply it to activations on every forward, which is why it must be a
//! butterfly network (`n log n`) and never a dense matmul.
//!
//! Every fast path produces exactly the same bits as the portable butterflies (each output is the same sequence of
//! f32 additions/subtractions); tests compare both against the O(n²) definition.

/// `H[i][j]` of the Sylvester Hadamard matrix of any power-of-two order containing `(i, j)`.
#[inline]
pub fn hadamard_entry(i: usize, j: usize) -> f32 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

fn check_len(n: usize) {
    assert!(n.is_power_of_two(), "FWHT length {n} is not a power of two");
}

fn check_blocks(len: usize, block: usize) {
    assert!(block.is_power_of_two(), "FWHT block {block} is not a power of two");
    assert!(len.is_multiple_of(block), "FWHT: length {len} is not a multiple of the block {block}");
}

/// Reference: `x ← H x` by the O(n²) definition, accumulated in f64. For tests and tiny sizes only.
pub fn fwht_ref(x: &mut [f32]) {
    let n = x.len();
    check_len(n);
    let src: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (i, out) in x.iter_mut().enumerate() {
        let s: f64 = src.iter().enumerate().map(|(j, &v)| hadamard_entry(i, j) as f64 * v).sum();
        *out = s as f32;
    }
}

/// Reference for the block-diagonal transform: [`fwht_ref`] on each consecutive `block` of `x`.
pub fn fwht_blocks_ref(x: &mut [f32], block: usize) {
    check_blocks(x.len(), block);
    x.chunks_exact_mut(block).for_each(fwht_ref);
}

fn butterflies_from(x: &mut [f32], mut h: usize) {
    let n = x.len();
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        h *= 2;
    }
}

fn fwht_portable(x: &mut [f32]) {
    butterflies_from(x, 1);
}

/// AVX2: the first three stages (h = 1, 2, 4) run inside one 8-lane register via permutes; the rest go three at a
/// time through eight registers (stages `h`, `2h`, `4h` pair vectors 1, 2 and 4 apart among eight loaded `h` values
/// apart), so a 512-wide block takes two passes over memory instead of seven. Lane `i` of an in-register stage
/// computes `partner + sign·self` with `sign = -1` on the upper element of each pair, which is `lo + hi` / `lo - hi`
/// — the same operation, in the same order, as the portable code; every later stage is that add and subtract.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fwht_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    if n < 8 {
        fwht_portable(x);
        return;
    }
    if n < 64 {
        for c in x.chunks_exact_mut(8) {
            // SAFETY: `c` is exactly 8 contiguous f32s; unaligned load/store are used.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), within8(_mm256_loadu_ps(c.as_ptr()))) };
        }
        let mut h = 8;
        while h < n {
            // SAFETY: h is a multiple of 8 and 2h divides n.
            unsafe { vector_stages::<2, false>(x, h) };
            h *= 2;
        }
        return;
    }
    // Stages 1–32: eight vectors of one 64-value chunk.
    // SAFETY: n is a multiple of 64 (a power of two ≥ 64).
    unsafe { vector_stages::<8, true>(x, 8) };
    let mut h = 64;
    while h < n {
        // SAFETY: h is a multiple of 8, and 8h, 4h or 2h (as taken) divides n.
        unsafe {
            if 8 * h <= n {
                vector_stages::<8, false>(x, h);
                h *= 8;
            } else if 4 * h <= n {
                vector_stages::<4, false>(x, h);
                h *= 4;
            } else {
                vector_stages::<2, false>(x, h);
                h *= 2;
            }
        }
    }
}

/// Stages 1, 2 and 4 inside one register.
///
/// # Safety
/// AVX2 and FMA must be present.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn within8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
    let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
    let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
    // Multiplying by ±1 is exact, so the fused multiply-add is exactly the add/subtract of the portable path.
    let v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps::<0b1011_0001>(v));
    let v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps::<0b0100_1110>(v));
    _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps::<0x01>(v, v))
}

/// Stages `h, 2h, …, (V/2)·h` of the butterflies: for each `V·h` values, `V` vectors `h` apart at a time, paired 1,
/// 2, … apart (`lo + hi`, `lo − hi`), with `FIRST` each first put through [`within8`].
///
/// # Safety
/// AVX2 and FMA must be present; `h` a multiple of 8 and `V·h` a divisor of `x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn vector_stages<const V: usize, const FIRST: bool>(x: &mut [f32], h: usize) {
    use std::arch::x86_64::*;
    debug_assert!(h.is_multiple_of(8) && x.len().is_multiple_of(V * h));
    let p = x.as_mut_ptr();
    for base in (0..x.len()).step_by(V * h) {
        for c in (0..h).step_by(8) {
            let at = |j: usize| p.add(base + c + j * h);
            let mut v: [__m256; V] = std::array::from_fn(|j| _mm256_loadu_ps(at(j)));
            if FIRST {
                v.iter_mut().for_each(|r| *r = within8(*r));
            }
            let mut d = 1;
            while d < V {
                for j in 0..V {
                    if j & d == 0 {
                        let (lo, hi) = (v[j], v[j | d]);
                        v[j] = _mm256_add_ps(lo, hi);
                        v[j | d] = _mm256_sub_ps(lo, hi);
                    }
                }
                d *= 2;
            }
            for (j, &r) in v.iter().enumerate() {
                _mm256_storeu_ps(at(j), r);
            }
        }
    }
}

/// In-place unnormalized FWHT: `x ← H x`. Panics unless `x.len()` is a power of two.
#[inline]
pub fn fwht(x: &mut [f32]) {
    check_len(x.len());
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        unsafe { fwht_avx2(x) };
        return;
    }
    fwht_portable(x);
}

/// In-place orthonormal FWHT: `x ← H x / √n`.
pub fn fwht_normalized(x: &mut [f32]) {
    check_len(x.len());
    let k = headroom(x, x.len() as f32);
    scale_pow2(x, -k);
    fwht(x);
    scale(x, 1.0 / (x.len() as f32).sqrt());
    scale_pow2(x, k);
}

/// Block-diagonal FWHT: [`fwht`] on each consecutive `block` of `x` (`x.len() = n_blocks · block`).
pub fn fwht_blocks(x: &mut [f32], block: usize) {
    check_blocks(x.len(), block);
    x.chunks_exact_mut(block).for_each(fwht);
}

/// Block-diagonal orthonormal FWHT: each block ← `H x / √block`.
pub fn fwht_blocks_normalized(x: &mut [f32], block: usize) {
    check_blocks(x.len(), block);
    let k = headroom(x, block as f32);
    scale_pow2(x, -k);
    fwht_blocks(x, block);
    scale(x, 1.0 / (block as f32).sqrt());
    scale_pow2(x, k);
}

/// Largest magnitude of `x` (NaN skipped), in eight lanes so that it vectorizes.
fn absmax(x: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let a = c[k].abs();
            m[k] = if a > m[k] { a } else { m[k] };
        }
    }
    for &v in it.remainder() {
        let a = v.abs();
        m[0] = if a > m[0] { a } else { m[0] };
    }
    m.iter().fold(0f32, |a, &b| if b > a { b } else { a })
}

/// The exponent `k` to take out of `x` (as `x · 2⁻ᵏ`, [`scale_pow2`]) before butterflies whose
/// sums grow a value up to `growth` times, so that none overflows where the normalized result
/// would not: 0 wherever every `|x| ≤ f32::MAX / growth`, which is every ordinary input. Since
/// the butterflies only add and subtract, the scaled transform is the unscaled one times `2⁻ᵏ`,
/// exactly (but for values that leave the normal range), and so is the result once `2ᵏ` is put
/// back.
pub(crate) fn headroom(x: &[f32], growth: f32) -> i32 {
    if absmax(x) > f32::MAX / growth {
        growth.log2().ceil() as i32
    } else {
        0
    }
}

/// `x ← x · 2ᵏ` for `|k| ≤ 126` (nothing for 0).
pub(crate) fn scale_pow2(x: &mut [f32], k: i32) {
    if k != 0 {
        scale(x, f32::from_bits(((k + 127) as u32) << 23));
    }
}

/// Rows below this many elements are not worth a rayon split.
const PAR_MIN_ELEMS: usize = 1 << 15;

/// Batched block-diagonal FWHT over `x`, `T` rows of `dim` values each (`dim` a multiple of `block`); rows run in
/// parallel when the batch is large. With `normalize`, each block is scaled by `1/√block`.
pub fn fwht_rows(x: &mut [f32], dim: usize, block: usize, normalize: bool) {
    assert!(dim > 0 && x.len().is_multiple_of(dim), "FWHT rows: length {} is not a multiple of dim {dim}", x.len());
    check_blocks(dim, block);
    let one = |row: &mut [f32]| {
        if normalize {
            fwht_blocks_normalized(row, block)
        } else {
            fwht_blocks(row, block)
        }
    };
    if x.len() >= PAR_MIN_ELEMS && x.len() > dim {
        crate::team::par_rows(x, dim, &one);
    } else {
        x.chunks_exact_mut(dim).for_each(one);
    }
}

fn scale(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::data;

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn fwht_hadamard_matrix_is_sylvester() {
        // H_2n = [[H, H], [H, -H]] and H·Hᵀ = n·I.
        let n = 16;
        for i in 0..n {
            for j in 0..n {
                let (a, b) = (i % 8, j % 8);
                let expect = if i >= 8 && j >= 8 { -hadamard_entry(a, b) } else { hadamard_entry(a, b) };
                assert_eq!(hadamard_entry(i, j), expect);
                let dot: f32 = (0..n).map(|k| hadamard_entry(i, k) * hadamard_entry(j, k)).sum();
                assert_eq!(dot, if i == j { n as f32 } else { 0.0 });
            }
        }
    }

    #[test]
    fn fwht_fast_matches_reference() {
        for n in [1, 2, 4, 8, 16, 32, 64, 128, 512, 1024] {
            let x0 = data(n, n as u32);
            let (mut r, mut f, mut p) = (x0.clone(), x0.clone(), x0.clone());
            fwht_ref(&mut r);
            fwht(&mut f);
            fwht_portable(&mut p);
            let tol = 1e-5 * (n as f32).sqrt() * 4.0;
            assert!(max_abs_diff(&r, &f) <= tol, "n={n}: {}", max_abs_diff(&r, &f));
            // The dispatched path (AVX2 where present) and the portable butterflies are bit-identical.
            assert_eq!(f, p, "n={n}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fwht_avx2_bit_identical_to_portable() {
        if !crate::simd::has_avx2_fma() {
            return;
        }
        for n in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192] {
            let x0 = data(n, 7 + n as u32);
            let (mut a, mut p) = (x0.clone(), x0);
            // SAFETY: AVX2 and FMA are present (checked above).
            unsafe { fwht_avx2(&mut a) };
            fwht_portable(&mut p);
            assert_eq!(a, p, "n={n}");
        }
    }

    #[test]
    fn fwht_normalized_is_an_involution_and_isometry() {
        let x0 = data(1024, 3);
        let mut x = x0.clone();
        fwht_normalized(&mut x);
        let n0: f64 = x0.iter().map(|&v| (v as f64).powi(2)).sum();
        let n1: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!((n0 - n1).abs() <= 1e-5 * n0);
        fwht_normalized(&mut x);
        assert!(max_abs_diff(&x, &x0) <= 1e-5);
    }

    #[test]
    fn fwht_blocks_and_rows_match_reference() {
        for (dim, block) in [(576, 64), (1536, 512), (3072, 1024), (24, 8), (5, 1)] {
            let rows = 3;
            let x0 = data(rows * dim, dim as u32);
            let mut r = x0.clone();
            fwht_blocks_ref(&mut r, block);
            let mut b = x0.clone();
            fwht_blocks(&mut b, block);
            assert!(max_abs_diff(&r, &b) <= 1e-4, "dim={dim} block={block}");
            let mut t = x0.clone();
            fwht_rows(&mut t, dim, block, false);
            assert_eq!(t, b);
            let mut nr = x0.clone();
            fwht_rows(&mut nr, dim, block, true);
            let s = 1.0 / (block as f32).sqrt();
            assert!(nr.iter().zip(&b).all(|(u, v)| (u - v * s).abs() <= 1e-6 * (1.0 + v.abs())));
        }
    }

    #[test]
    fn fwht_rows_parallel_split_matches_serial() {
        // Large enough to take the rayon path, with a row count that does not divide the task size.
        let (dim, block, rows) = (1536, 512, 37);
        let x0 = data(rows * dim, 11);
        let mut par = x0.clone();
        fwht_rows(&mut par, dim, block, true);
        let mut ser = x0;
        ser.chunks_exact_mut(dim).for_each(|r| fwht_blocks_normalized(r, block));
        assert_eq!(par, ser);
    }

    /// Inputs whose butterfly sums leave f32 though the normalized transform does not, and
    /// subnormal ones: within a few roundings of the f64 definition, on every path.
    #[test]
    fn normalized_transforms_are_total_over_finite_inputs() {
        let mut checked = 0;
        for n in [8usize, 64, 1024] {
            let base = data(n, 40 + n as u32);
            let cases: Vec<(&str, Vec<f32>)> = vec![
                // All equal: the first sum is n times the value, the result √n times it.
                ("constant near the limit", vec![f32::MAX / n as f32 * 4.0; n]),
                ("huge", base.iter().map(|v| v * (f32::MAX / 8.0)).collect()),
                ("subnormal", base.iter().map(|v| v * 1e-40).collect()),
                ("mixed", base.iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 77) as i32 - 38)).collect()),
            ];
            for (name, x) in &cases {
                let want: Vec<f64> = (0..n)
                    .map(|i| {
                        let s: f64 = x.iter().enumerate().map(|(j, &v)| hadamard_entry(i, j) as f64 * v as f64).sum();
                        s / (n as f64).sqrt()
                    })
                    .collect();
                if want.iter().any(|v| v.abs() > f32::MAX as f64) {
                    continue; // The result itself leaves f32.
                }
                checked += 1;
                let l1: f64 = x.iter().map(|&v| v.abs() as f64).sum();
                // A rounding per stage of sums of at most Σ|x|, one for the normalization, and
                // one of a subnormal result.
                let tol = (n.trailing_zeros() as f64 + 2.0) * f32::EPSILON as f64 * l1 / (n as f64).sqrt()
                    + 2.0 * f32::from_bits(1) as f64;
                let check = |what: &str, got: &[f32]| {
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        assert!(g.is_finite() && (g as f64 - w).abs() <= tol, "{what} {name} n={n} [{i}]: {g} vs {w}");
                    }
                };
                let mut a = x.clone();
                fwht_normalized(&mut a);
                check("fwht_normalized", &a);
                let mut b = x.clone();
                fwht_blocks_normalized(&mut b, n);
                check("fwht_blocks_normalized", &b);
                let mut r = x.clone();
                fwht_rows(&mut r, n, n, true);
                check("fwht_rows", &r);
                // The portable butterflies on the same scaled input give the same bits.
                let k = headroom(x, n as f32);
                let mut p = x.clone();
                scale_pow2(&mut p, -k);
                fwht_portable(&mut p);
                scale(&mut p, 1.0 / (n as f32).sqrt());
                scale_pow2(&mut p, k);
                assert_eq!(a, p, "{name} n={n}: dispatched and portable butterflies");
            }
        }
        // All but the constant row of 8, whose result leaves f32.
        assert_eq!(checked, 11);
    }

    #[test]
    #[should_panic(expected = "not a power of two")]
    fn fwht_rejects_non_power_of_two() {
        fwht(&mut [0.0; 12]);
    }
}
