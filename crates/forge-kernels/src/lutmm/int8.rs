//! INT8: 8 rows per tile, the column's 8 bytes sign-extended and converted to f32.

/// # Safety
/// AVX2+FMA must be available; `data` must hold `cin·8 + 8` bytes, `x` `tc·cin` values, `out`
/// `tc·8` values and `1 ≤ tc ≤ 8`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_int8(data: &[u8], cin: usize, x: &[f32], tc: usize, out: &mut [f32]) {
    debug_assert!(data.len() >= cin * 8 + 8 && x.len() >= tc * cin && out.len() >= tc * 8);
    let (d, xp, o) = (data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    super::dispatch_t!(tc, int8_kernel(d, cin, xp, o))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_kernel<const T: usize, const U: usize>(data: *const u8, cin: usize, x: *const f32, out: *mut f32) {
    super::tile_loop!(1, 8, data, cin, x, out, T, U, |p| {
        [_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))]
    })
}
