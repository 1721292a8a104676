//! Matrix transposes for prefill's outer-product tiles: the activations go in transposed (one
//! input's values for all rows side by side) and the tiles' sums come out that way too. On
//! AVX-512 in blocks of 16×16 held in registers; scalar elsewhere.

/// `dst[c·ds + r] = src[r·ss + c]` for `r < rows`, `c < cols`.
///
/// With `pad`, each `dst` row is also written past `rows` up to the next multiple of 16, with
/// zeros, so `ds` must leave room for it (a caller then reads whole 16-wide vectors).
///
/// # Panics
/// If the slices are too short for the shapes and strides.
pub fn transpose(src: &[f32], rows: usize, cols: usize, ss: usize, dst: &mut [f32], ds: usize, pad: bool) {
    if !check(src.len(), rows, cols, ss, dst.len(), ds, pad) {
        return;
    }
    // SAFETY: `check` bounds every read and write; `dst` is borrowed exclusively.
    unsafe { transpose_ptr(src.as_ptr(), rows, cols, ss, dst.as_mut_ptr(), ds, pad) }
}

/// [`transpose`] through raw pointers, for destinations that other threads write elsewhere
/// in (columns of a shared output).
///
/// # Safety
/// `src` must hold `rows` rows of `cols` values `ss` apart, and `dst` `cols` rows `ds` apart
/// of `rows` values (rounded up to 16 with `pad`) that no one else touches during the call.
pub(crate) unsafe fn transpose_ptr(
    src: *const f32,
    rows: usize,
    cols: usize,
    ss: usize,
    dst: *mut f32,
    ds: usize,
    pad: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512f() {
        // SAFETY: AVX-512 F detected; the caller vouches for the ranges.
        return avx512::transpose(src, rows, cols, ss, dst, ds, pad);
    }
    scalar(src, rows, cols, ss, dst, ds, pad)
}

/// Whether there is anything to do; panics if the slices are too short for the shapes.
fn check(src: usize, rows: usize, cols: usize, ss: usize, dst: usize, ds: usize, pad: bool) -> bool {
    if rows == 0 || cols == 0 {
        return false;
    }
    let width = if pad { rows.div_ceil(16) * 16 } else { rows };
    assert!(ss >= cols && src >= (rows - 1) * ss + cols, "transpose: source shorter than {rows}×{cols}");
    assert!(ds >= width && dst >= (cols - 1) * ds + width, "transpose: destination shorter than {cols}×{width}");
    true
}

/// The scalar reference of [`transpose`].
pub fn transpose_scalar(src: &[f32], rows: usize, cols: usize, ss: usize, dst: &mut [f32], ds: usize, pad: bool) {
    if !check(src.len(), rows, cols, ss, dst.len(), ds, pad) {
        return;
    }
    // SAFETY: the asserts above bound every read and write.
    unsafe { scalar(src.as_ptr(), rows, cols, ss, dst.as_mut_ptr(), ds, pad) }
}

/// # Safety
/// As [`transpose_ptr`].
unsafe fn scalar(src: *const f32, rows: usize, cols: usize, ss: usize, dst: *mut f32, ds: usize, pad: bool) {
    let width = if pad { rows.div_ceil(16) * 16 } else { rows };
    for c in 0..cols {
        for r in 0..width {
            *dst.add(c * ds + r) = if r < rows { *src.add(r * ss + c) } else { 0.0 };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F present; `src` holds `rows` rows of `cols` values `ss` apart, `dst` `cols`
    /// rows `ds` apart of `rows` values (rounded up to 16 with `pad`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(
        src: *const f32,
        rows: usize,
        cols: usize,
        ss: usize,
        dst: *mut f32,
        ds: usize,
        pad: bool,
    ) {
        for r0 in (0..rows).step_by(16) {
            for c0 in (0..cols).step_by(16) {
                let (nr, nc) = ((rows - r0).min(16), (cols - c0).min(16));
                block(src.add(r0 * ss + c0), ss, nr, nc, dst.add(c0 * ds + r0), ds, pad);
            }
        }
    }

    /// One block of `nr × nc` (each at most 16): rows past `nr` read as zeros, and are stored
    /// only with `pad`.
    #[inline(always)]
    unsafe fn block(src: *const f32, ss: usize, nr: usize, nc: usize, dst: *mut f32, ds: usize, pad: bool) {
        let cmask: __mmask16 = if nc == 16 { !0 } else { (1u16 << nc) - 1 };
        let r: [__m512; 16] = std::array::from_fn(|i| {
            if i < nr {
                _mm512_maskz_loadu_ps(cmask, src.add(i * ss))
            } else {
                _mm512_setzero_ps()
            }
        });
        // Within each 128-bit lane L: t[2m] holds columns 4L, 4L+1 of rows 2m, 2m+1 interleaved,
        // t[2m+1] columns 4L+2, 4L+3.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // u[4m + c], lane L: column 4L + c of rows 4m..4m+3.
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (m, c) = (i / 4, i % 4);
            let (a, b) = (t[4 * m + c / 2], t[4 * m + 2 + c / 2]);
            if c % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        let rmask: __mmask16 = if pad || nr == 16 { !0 } else { (1u16 << nr) - 1 };
        for c in 0..4 {
            let a01 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
            let a23 = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
            let b01 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
            let b23 = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
            // Output column 4L + c gathers lane L of u[c], u[4+c], u[8+c], u[12+c].
            let out = [
                _mm512_shuffle_f32x4::<0x88>(a01, b01),
                _mm512_shuffle_f32x4::<0xDD>(a01, b01),
                _mm512_shuffle_f32x4::<0x88>(a23, b23),
                _mm512_shuffle_f32x4::<0xDD>(a23, b23),
            ];
            for (l, &o) in out.iter().enumerate() {
                let col = 4 * l + c;
                if col < nc {
                    _mm512_mask_storeu_ps(dst.add(col * ds), rmask, o);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    #[test]
    fn simd_transpose_equals_scalar_on_ragged_shapes() {
        crate::testutil::avx512f("the AVX-512 transpose (the only SIMD one)");
        for &(rows, cols) in &[(1usize, 1usize), (16, 16), (64, 576), (17, 33), (5, 70), (64, 18), (18, 64), (100, 31)]
        {
            for pad in [false, true] {
                let (ss, ds) = (cols + 3, rows.div_ceil(16) * 16 + 5);
                let src = data(rows * ss, (rows * 1000 + cols) as u32);
                // NaN marks what must stay untouched.
                let mut want = vec![f32::NAN; cols * ds];
                let mut got = want.clone();
                transpose_scalar(&src, rows, cols, ss, &mut want, ds, pad);
                transpose(&src, rows, cols, ss, &mut got, ds, pad);
                let same = want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows}×{cols}, pad {pad}");
                for c in 0..cols {
                    for r in 0..rows {
                        assert_eq!(got[c * ds + r], src[r * ss + c], "{rows}×{cols} at ({r}, {c})");
                    }
                    if pad {
                        assert!(got[c * ds + rows..c * ds + rows.div_ceil(16) * 16].iter().all(|&v| v == 0.0));
                    }
                    assert!(got[c * ds + rows.div_ceil(16) * 16..(c + 1) * ds].iter().all(|v| v.is_nan()));
                    if !pad {
                        assert!(got[c * ds + rows..(c + 1) * ds].iter().all(|v| v.is_nan()));
                    }
                }
            }
        }
    }
}
