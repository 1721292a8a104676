//! Dense `Y = X Wᵀ` for f32/BF16/F16 weights stored row-major `[n_out, n_in]` (the PyTorch
//! `nn.Linear` layout), with f32 accumulation.
//!
//! Few rows (decode, verify): one dot product per (row, weight row), parallel over weight-row
//! blocks so each weight byte is read once. Many rows (prefill): `gemm` on f32 blocks, with
//! BF16/F16 blocks widened to f32 first.

use forge_core::tensor::FloatSlice;

/// Weight rows per parallel task.
const ROW_BLOCK: usize = 64;
/// From this many input rows on, use the blocked GEMM.
const GEMM_MIN_ROWS: usize = 9;

/// A matrix that can hand out rows `r0..r0+n` as f32 (borrowed when stored as f32, else
/// decoded into `buf`). Blocks start at multiples of 64 rows.
pub trait RowSource: Sync {
    fn n_in(&self) -> usize;
    fn n_out(&self) -> usize;
    /// Rows as a borrowed f32 slice, when stored that way.
    fn borrowed(&self, _r0: usize, _n: usize) -> Option<&[f32]> {
        None
    }
    /// Decode rows into `buf` (`n × n_in`).
    fn decode(&self, r0: usize, n: usize, buf: &mut [f32]);
}

/// A dense float matrix (`[n_out, n_in]`, f32/BF16/F16) as a row source.
pub struct DenseRows<'a> {
    pub w: FloatSlice<'a>,
    pub n_out: usize,
    pub n_in: usize,
}

impl RowSource for DenseRows<'_> {
    fn n_in(&self) -> usize {
        self.n_in
    }
    fn n_out(&self) -> usize {
        self.n_out
    }
    fn borrowed(&self, r0: usize, n: usize) -> Option<&[f32]> {
        match self.w {
            FloatSlice::F32(s) => Some(&s[r0 * self.n_in..(r0 + n) * self.n_in]),
            _ => None,
        }
    }
    fn decode(&self, r0: usize, _n: usize, buf: &mut [f32]) {
        self.w.read_into(r0 * self.n_in, buf);
    }
}

/// `y[t, o] = Σ_i x[t, i] · w[o, i]`; `x` is `t × n_in`, `y` is `t × n_out`.
pub fn matmul_xwt(x: &[f32], t: usize, w: FloatSlice, n_out: usize, n_in: usize, y: &mut [f32]) {
    assert_eq!(w.len(), n_out * n_in);
    match w {
        // 16-bit rows (low-rank factors' `B`, a DeltaNet's BF16 `in_proj_a`/`in_proj_b`) at
        // decode sizes: widened in registers, not into a buffer. From memory this reads a BF16
        // 48×5120 about four times as fast as decoding it into f32 blocks in one task for its
        // 48 rows (`examples/lowrank_probe.rs` compares the two).
        FloatSlice::F16(bits) if t < GEMM_MIN_ROWS => gemv_16(x, t, bits, n_out, n_in, y, crate::simd::dot_f16_stream),
        FloatSlice::BF16(bits) if t < GEMM_MIN_ROWS => {
            gemv_16(x, t, bits, n_out, n_in, y, crate::simd::dot_bf16_stream)
        }
        _ => matmul_rows(x, t, &DenseRows { w, n_out, n_in }, y),
    }
}

/// [`matmul_xwt`] for 16-bit rows and a few activation rows, with `dot` for one row.
fn gemv_16(x: &[f32], t: usize, w: &[u16], n_out: usize, n_in: usize, y: &mut [f32], dot: fn(&[f32], &[u16]) -> f32) {
    assert_eq!(x.len(), t * n_in, "x has {} values, expected {t}×{n_in}", x.len());
    assert_eq!(y.len(), t * n_out);
    if t == 0 || n_out == 0 {
        return;
    }
    let block = task_rows(n_out);
    let mut yt = crate::scratch::Buf::for_overwrite(n_out * t);
    crate::team::par_chunks_mut(&mut yt, block * t, &|b, out| {
        let r0 = b * block;
        for (r, o) in out.chunks_mut(t).enumerate() {
            let wr = &w[(r0 + r) * n_in..(r0 + r + 1) * n_in];
            for (tt, v) in o.iter_mut().enumerate() {
                *v = dot(&x[tt * n_in..(tt + 1) * n_in], wr);
            }
        }
    });
    untranspose(&yt, t, n_out, y);
}

/// Rows per task of a few-row product: at most ROW_BLOCK, at least two tasks per worker (a
/// rank-64 factor of a low-rank branch in one task would keep one core reading it while the
/// others wait), whole multiples of 8.
fn task_rows(n_out: usize) -> usize {
    n_out.div_ceil(2 * rayon::current_num_threads()).next_multiple_of(8).min(ROW_BLOCK)
}

/// `y[tt·n_out + o] = yt[o·t + tt]`.
fn untranspose(yt: &[f32], t: usize, n_out: usize, y: &mut [f32]) {
    for o in 0..n_out {
        for tt in 0..t {
            y[tt * n_out + o] = yt[o * t + tt];
        }
    }
}

/// `y = x Wᵀ` for any row source.
pub fn matmul_rows(x: &[f32], t: usize, w: &dyn RowSource, y: &mut [f32]) {
    let (n_out, n_in) = (w.n_out(), w.n_in());
    assert_eq!(x.len(), t * n_in, "x has {} values, expected {t}×{n_in}", x.len());
    assert_eq!(y.len(), t * n_out);
    if t == 0 || n_out == 0 {
        return;
    }
    if t >= GEMM_MIN_ROWS {
        return gemm_path(x, t, w, y);
    }
    // Output laid out [n_out][t] per block, transposed afterwards (t is small). Rows stored as
    // f32 go in `task_rows` blocks; decoded sources keep whole 64-row blocks.
    let block = match w.borrowed(0, n_out) {
        Some(_) => task_rows(n_out),
        None => ROW_BLOCK,
    };
    let mut yt = crate::scratch::Buf::for_overwrite(n_out * t);
    crate::team::par_chunks_mut(&mut yt, block * t, &|b, out| {
        let r0 = b * block;
        let rows = out.len() / t;
        let mut buf;
        let block: &[f32] = match w.borrowed(r0, rows) {
            Some(s) => s,
            None => {
                buf = crate::scratch::Buf::for_overwrite(rows * n_in);
                w.decode(r0, rows, &mut buf);
                &buf
            }
        };
        for r in 0..rows {
            let wr = &block[r * n_in..(r + 1) * n_in];
            for tt in 0..t {
                out[r * t + tt] = crate::simd::dot(&x[tt * n_in..(tt + 1) * n_in], wr);
            }
        }
    });
    untranspose(&yt, t, n_out, y);
}

fn gemm_path(x: &[f32], t: usize, w: &dyn RowSource, y: &mut [f32]) {
    let (n_out, n_in) = (w.n_out(), w.n_in());
    // Blocks of weight rows; each task produces a [t × block] tile, scattered into y after.
    const BLOCK: usize = 256;
    let n_blocks = n_out.div_ceil(BLOCK);
    // One tile of t × BLOCK per task, through the spinning team when one runs.
    let mut tiles = vec![0f32; n_blocks * t * BLOCK];
    crate::team::par_chunks_mut(&mut tiles, t * BLOCK, &|b, tile| {
        let r0 = b * BLOCK;
        let rows = BLOCK.min(n_out - r0);
        let mut wbuf = Vec::new();
        let wb: &[f32] = match w.borrowed(r0, rows) {
            Some(s) => s,
            None => {
                wbuf.resize(rows * n_in, 0.0);
                w.decode(r0, rows, &mut wbuf);
                &wbuf
            }
        };
        gemm_f32(x, t, wb, rows, n_in, &mut tile[..t * rows]);
    });
    for (b, tile) in tiles.chunks(t * BLOCK).enumerate() {
        let r0 = b * BLOCK;
        let rows = BLOCK.min(n_out - r0);
        for tt in 0..t {
            y[tt * n_out + r0..tt * n_out + r0 + rows].copy_from_slice(&tile[tt * rows..(tt + 1) * rows]);
        }
    }
}

/// Single-threaded `y (t×n) = x (t×k) · wᵀ` with `w` row-major `n × k`.
pub fn gemm_f32(x: &[f32], t: usize, w: &[f32], n: usize, k: usize, y: &mut [f32]) {
    gemm_f32_with(x, t, w, n, k, y, gemm::Parallelism::None)
}

/// Multi-threaded (rayon) variant of [`gemm_f32`] for large one-off products.
pub fn gemm_f32_par(x: &[f32], t: usize, w: &[f32], n: usize, k: usize, y: &mut [f32]) {
    gemm_f32_with(x, t, w, n, k, y, gemm::Parallelism::Rayon(0))
}

fn gemm_f32_with(x: &[f32], t: usize, w: &[f32], n: usize, k: usize, y: &mut [f32], par: gemm::Parallelism) {
    assert!(x.len() >= t * k && w.len() >= n * k && y.len() >= t * n);
    // SAFETY: the asserts above bound every access: lhs x is t×k with row stride k, rhs wᵀ is
    // k×n read as w[col*k + row] (column stride k, row stride 1), dst y is t×n with row stride n.
    unsafe {
        gemm::gemm(
            t,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// A row-major matrix operand of [`gemm_strided`]: `data` holds it with row stride `ld`; `t`
/// reads it transposed (`data` then holds the `cols × rows` matrix whose transpose is used).
#[derive(Clone, Copy)]
pub struct Op<'a, T> {
    pub data: &'a [T],
    pub ld: usize,
    pub t: bool,
}

impl<'a, T> Op<'a, T> {
    pub fn n(data: &'a [T], ld: usize) -> Self {
        Op { data, ld, t: false }
    }
    pub fn t(data: &'a [T], ld: usize) -> Self {
        Op { data, ld, t: true }
    }
    /// (row stride, column stride) of the operand as used.
    fn strides(&self) -> (usize, usize) {
        if self.t {
            (1, self.ld)
        } else {
            (self.ld, 1)
        }
    }
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows == 0 || cols == 0 {
            return;
        }
        let (rs, cs) = self.strides();
        assert!(cs == 1 || rs == 1, "{what}: one stride must be 1");
        assert!(self.ld >= if self.t { rows } else { cols }, "{what}: leading dimension too small");
        assert!((rows - 1) * rs + (cols - 1) * cs < self.data.len(), "{what}: {rows}×{cols} out of bounds");
    }
}

/// The element types [`gemm_strided`] takes.
pub trait Float: Copy + Default + PartialEq + 'static {}
impl Float for f32 {}
impl Float for f64 {}

/// `C (m×n, row stride ldc) = alpha·C + beta·op(A)·op(B)` (f32 or f64), with `op(A)` `m×k` and
/// `op(B)` `k×n`; `alpha = 0` ignores C's previous contents. One thread: callers parallelize
/// over blocks of rows.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided<T: Float>(
    c: &mut [T],
    ldc: usize,
    a: Op<T>,
    b: Op<T>,
    m: usize,
    n: usize,
    k: usize,
    alpha: T,
    beta: T,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(ldc >= n && (m - 1) * ldc + n <= c.len(), "gemm_strided: C {m}×{n} out of bounds");
    a.check(m, k, "gemm_strided: A");
    b.check(k, n, "gemm_strided: B");
    let ((ars, acs), (brs, bcs)) = (a.strides(), b.strides());
    // SAFETY: the checks above bound every access: C's element (i, j) is c[i·ldc + j] with
    // i < m, j < n inside c; op(A)'s (i, l) is a.data[i·ars + l·acs] with i < m, l < k inside
    // a.data; op(B)'s (l, j) likewise inside b.data. C is a unique borrow, so it aliases neither.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            alpha != T::default(),
            a.data.as_ptr(),
            acs as isize,
            ars as isize,
            b.data.as_ptr(),
            bcs as isize,
            brs as isize,
            alpha,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Scalar reference: the definition, sequential f32 accumulation.
pub fn matmul_ref(x: &[f32], t: usize, w: &[f32], n_out: usize, n_in: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * n_out];
    for tt in 0..t {
        for o in 0..n_out {
            y[tt * n_out + o] = crate::simd::dot_ref(&x[tt * n_in..(tt + 1) * n_in], &w[o * n_in..(o + 1) * n_in]);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn check(a: &[f32], b: &[f32], n_in: usize) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * (n_in as f32).sqrt() * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn strided_gemm_matches_the_definition_for_every_transpose_and_stride() {
        let (m, n, k) = (37, 29, 45);
        let (lda, ldb, ldc) = (53, 61, 40);
        let a: Vec<f64> = rnd(64 * lda, 3).into_iter().map(f64::from).collect();
        let b: Vec<f64> = rnd(64 * ldb, 4).into_iter().map(f64::from).collect();
        let c0: Vec<f64> = rnd(m * ldc, 5).into_iter().map(f64::from).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let at = |i: usize, l: usize| if ta { a[l * lda + i] } else { a[i * lda + l] };
            let bt = |l: usize, j: usize| if tb { b[j * ldb + l] } else { b[l * ldb + j] };
            let mut c = c0.clone();
            let (opa, opb) = (Op { data: &a, ld: lda, t: ta }, Op { data: &b, ld: ldb, t: tb });
            gemm_strided(&mut c, ldc, opa, opb, m, n, k, 0.5, -2.0);
            for i in 0..m {
                for j in 0..ldc {
                    let want = if j < n {
                        0.5 * c0[i * ldc + j] - 2.0 * (0..k).map(|l| at(i, l) * bt(l, j)).sum::<f64>()
                    } else {
                        c0[i * ldc + j]
                    };
                    let got = c[i * ldc + j];
                    assert!((got - want).abs() <= 1e-12 * (1.0 + want.abs()), "{ta} {tb} ({i},{j}): {got} vs {want}");
                }
            }
            // The same product in f32, against the f64 one.
            let (a32, b32): (Vec<f32>, Vec<f32>) =
                (a.iter().map(|&v| v as f32).collect(), b.iter().map(|&v| v as f32).collect());
            let mut c32: Vec<f32> = c0.iter().map(|&v| v as f32).collect();
            let (opa, opb) = (Op { data: &a32, ld: lda, t: ta }, Op { data: &b32, ld: ldb, t: tb });
            gemm_strided(&mut c32, ldc, opa, opb, m, n, k, 0.5, -2.0);
            for (got, want) in c32.iter().zip(&c) {
                assert!((*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "f32 {ta} {tb}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn all_paths_match_reference_on_ragged_shapes() {
        for &(t, n_out, n_in) in &[(1, 1, 1), (1, 67, 33), (3, 130, 17), (5, 64, 64), (6, 300, 45), (17, 513, 70)] {
            let x = rnd(t * n_in, 1);
            let w = rnd(n_out * n_in, 2);
            let r = matmul_ref(&x, t, &w, n_out, n_in);
            let mut y = vec![0f32; t * n_out];
            matmul_xwt(&x, t, FloatSlice::F32(&w), n_out, n_in, &mut y);
            check(&y, &r, n_in);
            // BF16 / F16 weights: compare against the reference on the rounded weights.
            let wb: Vec<u16> = w.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let wbf: Vec<f32> = wb.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
            matmul_xwt(&x, t, FloatSlice::BF16(&wb), n_out, n_in, &mut y);
            check(&y, &matmul_ref(&x, t, &wbf, n_out, n_in), n_in);
            let wh: Vec<u16> = w.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            let whf: Vec<f32> = wh.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
            matmul_xwt(&x, t, FloatSlice::F16(&wh), n_out, n_in, &mut y);
            check(&y, &matmul_ref(&x, t, &whf, n_out, n_in), n_in);
        }
    }
}
