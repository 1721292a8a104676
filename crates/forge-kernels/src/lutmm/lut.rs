//! Scalar-codebook formats (lut4, lut3, lut2): 8 rows per tile, `bits` bytes per column.

/// lut4 tile: nibble `k` of the column's 32-bit word indexes row `k`; the 16-entry table lives in
/// two registers (`vpermps` uses the low 3 bits, bit 3 selects the half through a blend).
///
/// # Safety
/// AVX2+FMA must be available; `data` must hold `cin·4 + 8` bytes, `x` `tc·cin` values, `out`
/// `tc·8` values, `table` 16 values and `1 ≤ tc ≤ 8`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_lut4(table: &[f32], data: &[u8], cin: usize, x: &[f32], tc: usize, out: &mut [f32]) {
    debug_assert!(table.len() >= 16 && data.len() >= cin * 4 + 8 && x.len() >= tc * cin && out.len() >= tc * 8);
    let (t, d, xp, o) = (table.as_ptr(), data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    super::dispatch_t!(tc, lut4_kernel(t, d, cin, xp, o))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn lut4_kernel<const T: usize, const U: usize>(
    table: *const f32,
    data: *const u8,
    cin: usize,
    x: *const f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let lo = _mm256_loadu_ps(table);
    let hi = _mm256_loadu_ps(table.add(8));
    let shr = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let shl = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    super::tile_loop!(1, 4, data, cin, x, out, T, U, |p| {
        let v = _mm256_set1_epi32((p as *const u32).read_unaligned() as i32);
        let idx = _mm256_srlv_epi32(v, shr);
        // Bit 3 of lane k's nibble moved to the sign bit selects the upper half of the table.
        let sel = _mm256_castsi256_ps(_mm256_sllv_epi32(v, shl));
        [_mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), sel)]
    })
}

/// lut3/lut2 tile: one 8-entry table register (lut2's 4 entries repeated twice so the stray
/// third index bit `vpermps` sees does not matter).
///
/// # Safety
/// As [`tile_lut4`], with `data` holding `cin·bits + 8` bytes and `bits` 2 or 3.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_lut_small(
    table: &[f32],
    bits: u32,
    data: &[u8],
    cin: usize,
    x: &[f32],
    tc: usize,
    out: &mut [f32],
) {
    debug_assert!(bits == 2 || bits == 3);
    debug_assert!(table.len() >= 8 && data.len() >= cin * bits as usize + 8 && x.len() >= tc * cin);
    debug_assert!(out.len() >= tc * 8);
    let (t, d, xp, o) = (table.as_ptr(), data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    if bits == 3 {
        super::dispatch_t!(tc, lut3_kernel(t, d, cin, xp, o))
    } else {
        super::dispatch_t!(tc, lut2_kernel(t, d, cin, xp, o))
    }
}

#[cfg(target_arch = "x86_64")]
macro_rules! small_kernel {
    ($name:ident, $bits:literal) => {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $name<const T: usize, const U: usize>(
            table: *const f32,
            data: *const u8,
            cin: usize,
            x: *const f32,
            out: *mut f32,
        ) {
            use std::arch::x86_64::*;
            let tab = _mm256_loadu_ps(table);
            let b = $bits;
            let shr = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
            super::tile_loop!(1, $bits, data, cin, x, out, T, U, |p| {
                let v = _mm256_set1_epi32((p as *const u32).read_unaligned() as i32);
                [_mm256_permutevar8x32_ps(tab, _mm256_srlv_epi32(v, shr))]
            })
        }
    };
}
#[cfg(target_arch = "x86_64")]
small_kernel!(lut3_kernel, 3);
#[cfg(target_arch = "x86_64")]
small_kernel!(lut2_kernel, 2);
