//! FP16 matrices with few columns (a low-rank branch's `A`, `out × rank`) in tiles of 16 rows.
//!
//! A row of `A` is only `rank` (64) values long: a dot product per row spends more on its
//! horizontal sum than on its multiply-adds (in cache, tiles read the 27B's `A` factors more
//! than three times as fast: `examples/lowrank_probe.rs` compares the two). In tiles the 16 rows
//! of a tile are the 16 lanes of a vector: each column is one widening load and one
//! multiply-add with the input broadcast, and no horizontal sum is left.
//!
//! Layout: tile `i` holds rows `16i..16i + 16` as `rank` runs of 16 values (column `k` of the
//! 16 rows at `[i][k][0..16]`); a last tile past `out` is padded with zeros.
//!
//! Every path sums a lane the same way: column `k` into accumulator `k mod 4` by a fused
//! multiply-add, then `(a₀ + a₁) + (a₂ + a₃)` added to `y`. The SIMD kernels therefore equal the
//! scalar reference bit for bit (tested).

/// Rows per tile.
pub const TILE: usize = 16;

/// Values a tiled `out × k` matrix takes (whole tiles).
pub fn tiled_len(out: usize, k: usize) -> usize {
    out.div_ceil(TILE) * TILE * k
}

/// A row-major `out × k` matrix (FP16 bits) in tiles.
pub fn pack(a: &[u16], out: usize, k: usize) -> Vec<u16> {
    assert_eq!(a.len(), out * k, "{} values for a {out}×{k} matrix", a.len());
    let mut t = vec![0u16; tiled_len(out, k)];
    for (r, row) in a.chunks_exact(k.max(1)).enumerate().take(out) {
        let base = r / TILE * TILE * k + r % TILE;
        for (c, &v) in row.iter().enumerate() {
            t[base + c * TILE] = v;
        }
    }
    t
}

/// The row-major `out × k` matrix back from its tiles.
pub fn unpack(tiles: &[u16], out: usize, k: usize) -> Vec<u16> {
    assert_eq!(tiles.len(), tiled_len(out, k), "{} values for a tiled {out}×{k} matrix", tiles.len());
    let mut a = vec![0u16; out * k];
    for (r, row) in a.chunks_exact_mut(k.max(1)).enumerate().take(out) {
        let base = r / TILE * TILE * k + r % TILE;
        for (c, v) in row.iter_mut().enumerate() {
            *v = tiles[base + c * TILE];
        }
    }
    a
}

/// Tiles per task: two tasks per worker, each one long run of the matrix, which the hardware
/// prefetchers follow: from memory long runs read nearly twice as fast as tasks of 8 tiles,
/// and asking for lines 16 KiB ahead, as the integer kernels do, only slows them (about
/// 0.85×; `examples/lowrank_probe.rs` measures both).
fn task_tiles(n_tiles: usize) -> usize {
    n_tiles.div_ceil(2 * rayon::current_num_threads()).max(1)
}

/// `y[tt·out + o] += Σₖ A[o, k] · x[tt·k + k]` for `t` rows of `x`, with `A` in tiles.
pub fn gemm_add(x: &[f32], t: usize, tiles: &[u16], out: usize, k: usize, y: &mut [f32]) {
    assert_eq!(x.len(), t * k, "x has {} values, expected {t}×{k}", x.len());
    assert_eq!(y.len(), t * out, "y has {} values, expected {t}×{out}", y.len());
    assert_eq!(tiles.len(), tiled_len(out, k), "{} values for a tiled {out}×{k} matrix", tiles.len());
    if t == 0 || out == 0 {
        return;
    }
    let n_tiles = out.div_ceil(TILE);
    let per = task_tiles(n_tiles);
    let tile_len = TILE * k;
    if t == 1 {
        // Straight into `y`: a task's tiles are one run of its values.
        crate::team::par_chunks_mut(y, per * TILE, &|i, ys| {
            for (j, yo) in ys.chunks_mut(TILE).enumerate() {
                let tile = &tiles[(i * per + j) * tile_len..][..tile_len];
                add_tile(x, tile, k, yo);
            }
        });
        return;
    }
    // Several rows: per tile the `t` results side by side, then added to `y`'s rows.
    let mut yt = crate::scratch::Buf::zeros(n_tiles * t * TILE);
    crate::team::par_chunks_mut(&mut yt, per * t * TILE, &|i, ys| {
        for (j, yo) in ys.chunks_mut(t * TILE).enumerate() {
            let tile = &tiles[(i * per + j) * tile_len..][..tile_len];
            for (tt, yr) in yo.chunks_mut(TILE).enumerate() {
                add_tile(&x[tt * k..(tt + 1) * k], tile, k, yr);
            }
        }
    });
    for (ti, yo) in yt.chunks(t * TILE).enumerate() {
        let (o0, n) = (ti * TILE, TILE.min(out - ti * TILE));
        for (tt, r) in yo.chunks(TILE).enumerate() {
            for (dst, &v) in y[tt * out + o0..][..n].iter_mut().zip(r) {
                *dst += v;
            }
        }
    }
}

/// `y[l] += Σₖ tile[k][l] · x[k]` for the first `y.len()` (≤ 16) lanes of one tile.
#[inline]
fn add_tile(x: &[f32], tile: &[u16], k: usize, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_avx512f() && y.len() == TILE {
            // SAFETY: AVX-512 F (with AVX2/FMA) checked at run time; the kernel reads `k` values
            // of `x` and `16·k` of `tile` and writes 16 of `y`, all checked here.
            assert!(x.len() >= k && tile.len() >= TILE * k);
            return unsafe { add_tile_avx512(x, tile, k, y) };
        }
        if crate::simd::has_f16c() && y.len() == TILE {
            assert!(x.len() >= k && tile.len() >= TILE * k);
            // SAFETY: AVX2, FMA and F16C checked at run time; bounds as above.
            return unsafe { add_tile_avx2(x, tile, k, y) };
        }
    }
    add_tile_portable(x, tile, k, y)
}

/// The scalar reference: the kernels' sums, lane by lane.
fn add_tile_portable(x: &[f32], tile: &[u16], k: usize, y: &mut [f32]) {
    for (l, yl) in y.iter_mut().enumerate() {
        let mut acc = [0f32; 4];
        for (c, &xc) in x[..k].iter().enumerate() {
            let w = half::f16::from_bits(tile[c * TILE + l]).to_f32();
            acc[c % 4] = w.mul_add(xc, acc[c % 4]);
        }
        *yl += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn add_tile_avx512(x: &[f32], tile: &[u16], k: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let (px, pt) = (x.as_ptr(), tile.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    // SAFETY (loads): column `c < k` reads `x[c]` and `tile[16c..16c + 16]`, within the
    // lengths the caller checked.
    macro_rules! col {
        ($c:expr, $a:expr) => {{
            let w = _mm512_cvtph_ps(_mm256_loadu_si256(pt.add($c * TILE) as *const __m256i));
            *$a = _mm512_fmadd_ps(w, _mm512_set1_ps(*px.add($c)), *$a);
        }};
    }
    // Four columns a step, one per accumulator, so that the accumulators stay in registers.
    let mut c = 0;
    while c + 4 <= k {
        for (j, a) in acc.iter_mut().enumerate() {
            col!(c + j, a);
        }
        c += 4;
    }
    for (j, a) in acc.iter_mut().enumerate().take(k - c) {
        col!(c + j, a);
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    // SAFETY: `y` holds 16 values (checked by the caller).
    let py = y.as_mut_ptr();
    _mm512_storeu_ps(py, _mm512_add_ps(_mm512_loadu_ps(py), s));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_tile_avx2(x: &[f32], tile: &[u16], k: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let (px, pt) = (x.as_ptr(), tile.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    // SAFETY (loads): as in the AVX-512 kernel, in two halves of 8 lanes.
    macro_rules! step {
        ($c:expr, $a:expr) => {{
            let xc = _mm256_set1_ps(*px.add($c));
            for (h, a) in $a.iter_mut().enumerate() {
                let w = _mm256_cvtph_ps(_mm_loadu_si128(pt.add($c * TILE + 8 * h) as *const __m128i));
                *a = _mm256_fmadd_ps(w, xc, *a);
            }
        }};
    }
    let mut c = 0;
    while c + 4 <= k {
        for (j, a) in acc.iter_mut().enumerate() {
            step!(c + j, a);
        }
        c += 4;
    }
    for (j, a) in acc.iter_mut().enumerate().take(k - c) {
        step!(c + j, a);
    }
    let py = y.as_mut_ptr();
    for h in [0, 1] {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0][h], acc[1][h]), _mm256_add_ps(acc[2][h], acc[3][h]));
        // SAFETY: `y` holds 16 values (checked by the caller).
        _mm256_storeu_ps(py.add(8 * h), _mm256_add_ps(_mm256_loadu_ps(py.add(8 * h)), s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    fn f16_bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()
    }

    #[test]
    fn pack_and_unpack_round_trip_with_a_ragged_last_tile() {
        for (out, k) in [(1, 1), (16, 64), (37, 5), (70, 64)] {
            let a = f16_bits(&data(out * k, 7));
            let t = pack(&a, out, k);
            assert_eq!(t.len(), tiled_len(out, k));
            assert_eq!(unpack(&t, out, k), a);
            // Row 17 column 2 sits in tile 1, run 2, lane 1.
            if out > 17 && k > 2 {
                assert_eq!(t[TILE * k + 2 * TILE + 1], a[17 * k + 2]);
            }
        }
    }

    /// The kernels equal the scalar reference bit for bit, and the product equals a plain f64
    /// matrix product within f32 rounding.
    #[test]
    fn gemm_add_matches_the_reference_and_a_plain_product() {
        for (out, k, t) in [(16, 64, 1), (10240 / 64, 64, 1), (37, 7, 1), (70, 64, 3), (33, 64, 8)] {
            let a = f16_bits(&data(out * k, 11));
            let x = data(t * k, 12);
            let y0 = data(t * out, 13);
            let tiles = pack(&a, out, k);
            let mut y = y0.clone();
            gemm_add(&x, t, &tiles, out, k, &mut y);
            // The reference, tile by tile.
            let mut r = y0.clone();
            for tt in 0..t {
                for ti in 0..out.div_ceil(TILE) {
                    let n = TILE.min(out - ti * TILE);
                    let tile = &tiles[ti * TILE * k..][..TILE * k];
                    add_tile_portable(&x[tt * k..][..k], tile, k, &mut r[tt * out + ti * TILE..][..n]);
                }
            }
            for (i, (p, q)) in y.iter().zip(&r).enumerate() {
                assert_eq!(p.to_bits(), q.to_bits(), "{out}×{k}, {t} rows: value {i}: {p} vs reference {q}");
            }
            for tt in 0..t {
                for o in 0..out {
                    let want: f64 = y0[tt * out + o] as f64
                        + (0..k)
                            .map(|c| half::f16::from_bits(a[o * k + c]).to_f64() * x[tt * k + c] as f64)
                            .sum::<f64>();
                    let got = y[tt * out + o] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{out}×{k}: row {tt}, out {o}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// Each SIMD kernel on its own against the reference (the dispatch above takes only the
    /// widest one the CPU has).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn each_x86_kernel_equals_the_reference() {
        crate::testutil::avx512f("the AVX-512 f16 tile kernel");
        for k in [1, 3, 64, 65] {
            let tile = f16_bits(&data(TILE * k, 21));
            let x = data(k, 22);
            let y0 = data(TILE, 23);
            let mut r = y0.clone();
            add_tile_portable(&x, &tile, k, &mut r);
            if crate::simd::has_avx512f() {
                let mut y = y0.clone();
                // SAFETY: AVX-512 F checked; 16 lanes, `k` columns.
                unsafe { add_tile_avx512(&x, &tile, k, &mut y) };
                assert_eq!(
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "avx512, k={k}"
                );
            }
            if crate::simd::has_f16c() {
                let mut y = y0.clone();
                // SAFETY: AVX2/FMA/F16C checked; 16 lanes, `k` columns.
                unsafe { add_tile_avx2(&x, &tile, k, &mut y) };
                assert_eq!(
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "avx2, k={k}"
                );
            }
        }
    }
}
