//! Two-component vector formats: a lane is a row pair `(2g, 2g+1)`, 16 rows per tile.

/// vec2x16: nibble `k` indexes pair `k`; each component's 16-entry table lives in two registers.
///
/// # Safety
/// AVX2+FMA must be available; `data` must hold `cin·4 + 8` bytes, `x` `tc·cin` values, `out`
/// `tc·16` values, `table` 32 values and `1 ≤ tc ≤ 8`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_vec2x16(table: &[f32], data: &[u8], cin: usize, x: &[f32], tc: usize, out: &mut [f32]) {
    debug_assert!(table.len() >= 32 && data.len() >= cin * 4 + 8 && x.len() >= tc * cin && out.len() >= tc * 16);
    let mut tmp = [0f32; super::MAX_T * 16];
    let (t, d, xp, o) = (table.as_ptr(), data.as_ptr(), x.as_ptr(), tmp.as_mut_ptr());
    super::dispatch_t!(narrow tc, vec2x16_kernel(t, d, cin, xp, o));
    // Kernel order is [t][component][pair]; rows are [t][2·pair + component].
    for t in 0..tc {
        for k in 0..8 {
            out[t * 16 + 2 * k] = tmp[t * 16 + k];
            out[t * 16 + 2 * k + 1] = tmp[t * 16 + 8 + k];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn vec2x16_kernel<const T: usize, const U: usize>(
    table: *const f32,
    data: *const u8,
    cin: usize,
    x: *const f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let lo0 = _mm256_loadu_ps(table);
    let hi0 = _mm256_loadu_ps(table.add(8));
    let lo1 = _mm256_loadu_ps(table.add(16));
    let hi1 = _mm256_loadu_ps(table.add(24));
    let shr = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let shl = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    super::tile_loop!(2, 4, data, cin, x, out, T, U, |p| {
        let v = _mm256_set1_epi32((p as *const u32).read_unaligned() as i32);
        let idx = _mm256_srlv_epi32(v, shr);
        let sel = _mm256_castsi256_ps(_mm256_sllv_epi32(v, shl));
        [
            _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo0, idx), _mm256_permutevar8x32_ps(hi0, idx), sel),
            _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo1, idx), _mm256_permutevar8x32_ps(hi1, idx), sel),
        ]
    })
}

/// vec2x64: 6-bit indices (8 per 6 bytes) gathered as (component 0, component 1) pairs, which
/// come out in row order: vector 0 holds rows 0–7 of the tile, vector 1 rows 8–15.
///
/// # Safety
/// AVX2+FMA must be available; `data` must hold `cin·6 + 8` bytes, `x` `tc·cin` values, `out`
/// `tc·16` values, `table` 128 values and `1 ≤ tc ≤ 8`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_vec2x64(table: &[f32], data: &[u8], cin: usize, x: &[f32], tc: usize, out: &mut [f32]) {
    debug_assert!(table.len() >= 128 && data.len() >= cin * 6 + 8 && x.len() >= tc * cin && out.len() >= tc * 16);
    let (t, d, xp, o) = (table.as_ptr(), data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    super::dispatch_t!(narrow tc, vec2x64_kernel(t, d, cin, xp, o))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn vec2x64_kernel<const T: usize, const U: usize>(
    table: *const f32,
    data: *const u8,
    cin: usize,
    x: *const f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    // Lane k's index starts at bit 6k: bytes (6k/8, 6k/8 + 1) into the lane, shifted by 6k % 8.
    let m = -128i8; // zero the byte
    #[rustfmt::skip]
    let ctrl = _mm256_setr_epi8(
        0, 1, m, m, 0, 1, m, m, 1, 2, m, m, 2, 3, m, m,
        3, 4, m, m, 3, 4, m, m, 4, 5, m, m, 5, 6, m, m,
    );
    let offs = _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2);
    let mask = _mm256_set1_epi32(63);
    let pairs = table as *const f64;
    super::tile_loop!(2, 6, data, cin, x, out, T, U, |p| {
        let v = _mm256_shuffle_epi8(_mm256_set1_epi64x((p as *const u64).read_unaligned() as i64), ctrl);
        let idx = _mm256_and_si256(_mm256_srlv_epi32(v, offs), mask);
        let g0 = _mm256_i32gather_pd::<8>(pairs, _mm256_castsi256_si128(idx));
        let g1 = _mm256_i32gather_pd::<8>(pairs, _mm256_extracti128_si256::<1>(idx));
        [_mm256_castpd_ps(g0), _mm256_castpd_ps(g1)]
    })
}
