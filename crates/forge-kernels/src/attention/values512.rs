//! The weighted sum of value rows on 512-bit vectors: [`super::values_avx2`]'s products in the
//! same order per column (each column's sum runs over the rows one after the other from what
//! `out` holds), so the two give the same bits; here 128 columns a sweep in eight registers,
//! and a block of 16 widened rows shared by a group's heads.

use super::{KvElem, STAGE};

/// `out_h += Σ_j p_h[col + j] V_j` over the run's `rn` rows for every head of the group, head
/// `h` stopping before weight `lim[h]` where given, as [`super::values_avx2`].
///
/// # Safety
/// AVX2, FMA, F16C and AVX-512 F present; `dv = out.len() / g` a multiple of 16; `p` holds `g`
/// rows of `n` weights with columns `col..col + rn` inside them; the `rn` value rows (`stride`
/// apart, `dv` values at `offset`) inside `values`.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn values_avx512<T: KvElem>(
    p: &[f32],
    g: usize,
    n: usize,
    col: usize,
    rn: usize,
    values: &[T],
    stride: usize,
    offset: usize,
    out: &mut [f32],
    lim: Option<&[usize]>,
) {
    let dv = out.len() / g.max(1);
    for c0 in (0..dv).step_by(COLS) {
        // A sweep's register count fixed at compile time, so that its accumulators stay in
        // registers.
        // SAFETY: the caller's contract, for columns c0.. of every row and head.
        unsafe {
            match (dv - c0).min(COLS) / 16 {
                8 => sweep::<T, 8>(p, g, n, col, rn, values, stride, offset + c0, out, c0, lim),
                4 => sweep::<T, 4>(p, g, n, col, rn, values, stride, offset + c0, out, c0, lim),
                w => {
                    for k in 0..w {
                        let c = c0 + 16 * k;
                        sweep::<T, 1>(p, g, n, col, rn, values, stride, offset + c, out, c, lim);
                    }
                }
            }
        }
    }
}

/// Columns sweeped at once: eight registers of 16.
const COLS: usize = 128;

/// [`values_avx512`] for the `16 · W` columns from `c0` (of `out`; from `offset` in a value row).
///
/// # Safety
/// As [`values_avx512`], with those columns inside every row and head.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep<T: KvElem, const W: usize>(
    p: &[f32],
    g: usize,
    n: usize,
    col: usize,
    rn: usize,
    values: &[T],
    stride: usize,
    offset: usize,
    out: &mut [f32],
    c0: usize,
    lim: Option<&[usize]>,
) {
    use std::arch::x86_64::*;
    let rows = STAGE / (16 * W);
    let dv = out.len() / g.max(1);
    // SAFETY: `offset` is inside the values (the caller's contract).
    let vp = unsafe { values.as_ptr().add(offset) };
    let block = if g == 1 { rn.max(1) } else { rows };
    let mut staged = [std::mem::MaybeUninit::<f32>::uninit(); STAGE];
    let stage = g > 1 && !T::IS_F32;
    let sp = staged.as_mut_ptr() as *mut f32;
    for j0 in (0..rn).step_by(block) {
        let j1 = (j0 + block).min(rn);
        if stage {
            for j in j0..j1 {
                for k in 0..W {
                    // SAFETY: row j < rn, columns 16k..+16 of the sweep; the stage holds
                    // rows·16W floats and j − j0 < rows.
                    unsafe {
                        _mm512_storeu_ps(sp.add((j - j0) * 16 * W + 16 * k), T::load16(vp.add(j * stride + 16 * k)))
                    };
                }
            }
        }
        for h in 0..g {
            let j1 = j1.min(super::run_end(lim, h, col, rn));
            if j1 <= j0 {
                continue;
            }
            // SAFETY: head h's columns c0.. of `out` (g·dv values).
            let o = unsafe { out.as_mut_ptr().add(h * dv + c0) };
            let mut acc = [_mm512_setzero_ps(); W];
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 values of head h at column c0 + 16k < dv.
                *a = unsafe { _mm512_loadu_ps(o.add(16 * k)) };
            }
            let ph = &p[h * n + col + j0..h * n + col + j1];
            for (jj, &w) in ph.iter().enumerate() {
                let pv = _mm512_set1_ps(w);
                for (k, a) in acc.iter_mut().enumerate() {
                    // SAFETY: as when staged.
                    let v = unsafe {
                        if stage {
                            _mm512_loadu_ps(sp.add(jj * 16 * W + 16 * k))
                        } else {
                            T::load16(vp.add((j0 + jj) * stride + 16 * k))
                        }
                    };
                    *a = _mm512_fmadd_ps(pv, v, *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { _mm512_storeu_ps(o.add(16 * k), *a) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::values_avx2;
    use super::*;
    use crate::testutil::data;
    use half::f16;

    fn check<T: KvElem>(name: &str, to: impl Fn(f32) -> T) {
        // Head sizes of SmolLM2, Qwen3 and qwen3_5 and one past a sweep; groups of one to six
        // heads; runs shorter and longer than a staged block; a head at an offset in wider rows.
        for (dv, g) in [(64usize, 3usize), (128, 2), (256, 6), (144, 1), (16, 2)] {
            for rn in [1usize, 15, 16, 17, 70] {
                // Heads that stop early (prefill's tiles): before, inside and past the run.
                let lims: Vec<usize> = (0..g).map(|h| 4 + (h * 7 + 3) % (rn + 3)).collect();
                for ((stride, offset), lim) in [((dv, 0), None), ((2 * dv, dv), None), ((dv, 0), Some(&lims[..]))] {
                    let values: Vec<T> = data(rn * stride, (dv + rn) as u32).iter().map(|&v| to(v)).collect();
                    let (n, col) = (rn + 9, 4);
                    let p = data(g * n, rn as u32 + 3);
                    let start = data(g * dv, 5);
                    let (mut a, mut b) = (start.clone(), start);
                    // SAFETY: AVX-512 F checked by the caller; p, values and out sized as stated.
                    unsafe {
                        values_avx2(&p, g, n, col, rn, &values, stride, offset, &mut a, lim);
                        values_avx512(&p, g, n, col, rn, &values, stride, offset, &mut b, lim);
                    }
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{name} dv={dv} g={g} rn={rn} offset {offset} lim {lim:?}");
                }
            }
        }
    }

    #[test]
    fn wide_value_sums_give_the_bits_of_the_avx2_ones() {
        if !crate::testutil::avx512f("512-bit value sums") {
            return;
        }
        check("f32", |v| v);
        check("f16", f16::from_f32);
        check("int8", |v| i8::from_f32(v * 127.0));
    }
}
