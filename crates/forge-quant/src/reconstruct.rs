//! Block reconstruction: with every index frozen, refit a LUT matrix's codebook values and
//! per-row scales to the calibration stream (ANEMLL Forge's research notes, block
//! reconstruction).
//!
//! A row of the quantized matrix is `q_r = s_r · u_r`, where `u_r[j]` is component `r mod d` of
//! the codebook entry at row group `r / d`, column `j`. The output error of the layer over the
//! calibration inputs `X` is `Σ_r (q_r − w_r)ᵀ H (q_r − w_r)` with `H = XᵀX/N`: quadratic in
//! the scales for a fixed codebook (one division per row) and quadratic in the codebook values
//! for fixed scales (a `K × K` linear system per vector component). Each round solves the
//! codebook's system, puts the values back on the integer kernels' grid, then solves every
//! scale and rounds it to FP16; the round with the lowest error is kept, and the matrix is left
//! unchanged if none beats it.

use crate::fit::{f16_round, snap_codebook};
use forge_kernels::lut::LutMatrix;
use rayon::prelude::*;

/// Rows per unit of parallel work; partial sums are added in row order, so results do not
/// depend on the thread count.
const ROW_CHUNK: usize = 16;

/// What a refit did, as calibration losses `Σ_r (q_r − w_r)ᵀ H (q_r − w_r)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refit {
    pub before: f64,
    pub after: f64,
    /// Rounds run; the kept result is the best of them (or the input).
    pub rounds: usize,
}

impl Refit {
    pub fn improved(&self) -> bool {
        self.after < self.before
    }
    /// Gain in dB (positive: lower error).
    pub fn gain_db(&self) -> f64 {
        10.0 * (self.before / self.after.max(1e-300)).log10()
    }
}

/// Per-row quadratic terms for a codebook: `uᵀHu`, `uᵀHw`.
struct RowTerms {
    uhu: Vec<f64>,
    uhw: Vec<f64>,
}

struct Problem<'a> {
    /// `H` in f32, `cin × cin`.
    h: &'a [f32],
    /// `H w_r` per row.
    hw: Vec<f32>,
    /// `w_rᵀ H w_r` per row.
    whw: Vec<f64>,
    m: &'a LutMatrix,
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    // Eight partial sums keep the loop vectorized; f64 at the end.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] = x[k].mul_add(y[k], acc[k]);
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().map(|&v| v as f64).sum::<f64>() + tail as f64
}

fn mat_vec(h: &[f32], n: usize, v: &[f32], out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(h.chunks_exact(n)) {
        *o = dot(row, v) as f32;
    }
}

impl<'a> Problem<'a> {
    fn new(target: &[f32], m: &'a LutMatrix, h: &'a [f32]) -> Problem<'a> {
        let n = m.cin;
        let mut hw = vec![0f32; m.cout * n];
        hw.par_chunks_mut(n).zip(target.par_chunks(n)).for_each(|(o, w)| mat_vec(h, n, w, o));
        let whw = target.chunks(n).zip(hw.chunks(n)).map(|(w, y)| dot(w, y)).collect();
        Problem { h, hw, whw, m }
    }

    fn d(&self) -> usize {
        self.m.format.vec_dim()
    }

    fn codes(&self, r: usize) -> &[u8] {
        let (n, d) = (self.m.cin, self.d());
        &self.m.idx[(r / d) * n..(r / d + 1) * n]
    }

    fn row(&self, cb: &[f32], r: usize, u: &mut [f32]) {
        let d = self.d();
        for (x, &c) in u.iter_mut().zip(self.codes(r)) {
            *x = cb[c as usize * d + r % d];
        }
    }

    /// `uᵀHu` and `uᵀHw` of every row under codebook `cb`.
    fn terms(&self, cb: &[f32]) -> RowTerms {
        let n = self.m.cin;
        let pairs: Vec<(f64, f64)> = (0..self.m.cout)
            .into_par_iter()
            .map_init(
                || (vec![0f32; n], vec![0f32; n]),
                |(u, y), r| {
                    self.row(cb, r, u);
                    mat_vec(self.h, n, u, y);
                    (dot(u, y), dot(u, &self.hw[r * n..(r + 1) * n]))
                },
            )
            .collect();
        RowTerms { uhu: pairs.iter().map(|p| p.0).collect(), uhw: pairs.iter().map(|p| p.1).collect() }
    }

    fn loss(&self, t: &RowTerms, scale: &[f32]) -> f64 {
        (0..self.m.cout)
            .map(|r| {
                let s = scale[r] as f64;
                s * s * t.uhu[r] - 2.0 * s * t.uhw[r] + self.whw[r]
            })
            .sum()
    }

    /// The codebook minimizing the loss for fixed scales (before the grid), `K × d`.
    fn solve_codebook(&self, scale: &[f32], old: &[f32]) -> Vec<f32> {
        let (n, d, k) = (self.m.cin, self.d(), self.m.format.entries());
        // Per component t: G_t (K × K) and b_t (K), summed over the rows r ≡ t (mod d).
        let size = d * (k * k + k);
        let chunks: Vec<Vec<f64>> = (0..self.m.cout.div_ceil(ROW_CHUNK))
            .into_par_iter()
            .map_init(
                || vec![0f32; k * n],
                |acc, ci| {
                    let mut part = vec![0f64; size];
                    #[allow(clippy::needless_range_loop)] // r indexes scales, codes and H w rows alike
                    for r in ci * ROW_CHUNK..((ci + 1) * ROW_CHUNK).min(self.m.cout) {
                        let (s, t, codes) = (scale[r] as f64, r % d, self.codes(r));
                        // acc[b] = Σ_{j: code j = b} H[j, ·] (rows of the symmetric H).
                        acc.iter_mut().for_each(|v| *v = 0.0);
                        for (j, &c) in codes.iter().enumerate() {
                            let dst = &mut acc[c as usize * n..(c as usize + 1) * n];
                            for (a, &hv) in dst.iter_mut().zip(&self.h[j * n..(j + 1) * n]) {
                                *a += hv;
                            }
                        }
                        let base = t * (k * k + k);
                        let (g, bv) = part[base..base + k * k + k].split_at_mut(k * k);
                        for b in 0..k {
                            let col = &acc[b * n..(b + 1) * n];
                            // G[a, b] += s² Σ_{i: code i = a} acc[b][i]
                            let mut sums = vec![0f64; k];
                            for (&c, &v) in codes.iter().zip(col) {
                                sums[c as usize] += v as f64;
                            }
                            for (a, v) in sums.iter().enumerate() {
                                g[a * k + b] += s * s * v;
                            }
                        }
                        for (&c, &v) in codes.iter().zip(&self.hw[r * n..(r + 1) * n]) {
                            bv[c as usize] += s * v as f64;
                        }
                    }
                    part
                },
            )
            .collect();
        let mut sys = vec![0f64; size];
        for p in &chunks {
            sys.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        let mut cb = old.to_vec();
        for t in 0..d {
            let base = t * (k * k + k);
            let (g, bv) = sys[base..base + k * k + k].split_at(k * k);
            // A small ridge toward the old values: entries no row uses keep them, and a
            // nearly singular system stays well posed.
            let mean_diag = (0..k).map(|a| g[a * k + a]).sum::<f64>() / k as f64;
            let eps = 1e-9 * mean_diag.max(1e-30);
            let mut a = g.to_vec();
            let mut rhs: Vec<f64> = (0..k).map(|e| bv[e] + eps * old[e * d + t] as f64).collect();
            for e in 0..k {
                a[e * k + e] += eps;
            }
            if cholesky_solve(&mut a, &mut rhs, k) {
                for e in 0..k {
                    cb[e * d + t] = rhs[e] as f32;
                }
            }
        }
        cb
    }
}

/// Solve `A x = b` in place (`A` symmetric positive definite, `n × n`); false if not.
fn cholesky_solve(a: &mut [f64], b: &mut [f64], n: usize) -> bool {
    for j in 0..n {
        let mut dj = a[j * n + j];
        for p in 0..j {
            dj -= a[j * n + p] * a[j * n + p];
        }
        if dj.is_nan() || dj <= 0.0 || !dj.is_finite() {
            return false;
        }
        let dj = dj.sqrt();
        a[j * n + j] = dj;
        for i in j + 1..n {
            let mut v = a[i * n + j];
            for p in 0..j {
                v -= a[i * n + p] * a[j * n + p];
            }
            a[i * n + j] = v / dj;
        }
    }
    for i in 0..n {
        let mut v = b[i];
        for p in 0..i {
            v -= a[i * n + p] * b[p];
        }
        b[i] = v / a[i * n + i];
    }
    for i in (0..n).rev() {
        let mut v = b[i];
        for p in i + 1..n {
            v -= a[p * n + i] * b[p];
        }
        b[i] = v / a[i * n + i];
    }
    true
}

/// Refit `m`'s codebook and scales to `target` (the matrix it stands for, in its stored basis)
/// under the Hessian `h` (`cin × cin`), in at most `rounds` alternations. Indices never change,
/// and the result's loss is never above the input's.
pub fn refit(target: &[f32], m: &LutMatrix, h: &[f32], rounds: usize) -> (LutMatrix, Refit) {
    refit_on(target, m, h, rounds, true)
}

/// [`refit`], with the codebook put back on the kernels' grid after each solve or not (tests).
fn refit_on(target: &[f32], m: &LutMatrix, h: &[f32], rounds: usize, grid: bool) -> (LutMatrix, Refit) {
    let p = Problem::new(target, m, h);
    let start = p.terms(&m.codebook);
    let before = p.loss(&start, &m.scale);
    let (mut best_cb, mut best_s, mut best) = (m.codebook.clone(), m.scale.clone(), before);
    let (mut cb, mut scale) = (m.codebook.clone(), m.scale.clone());
    let mut run = 0;
    for _ in 0..rounds {
        run += 1;
        cb = p.solve_codebook(&scale, &cb);
        if grid {
            snap_codebook(&mut cb);
        }
        let t = p.terms(&cb);
        for (r, s) in scale.iter_mut().enumerate() {
            if t.uhu[r] > 0.0 {
                let v = f16_round((t.uhw[r] / t.uhu[r]) as f32);
                if v != 0.0 && v.is_finite() {
                    *s = v;
                }
            }
        }
        let loss = p.loss(&t, &scale);
        if loss < best {
            // Stop once a round gains less than 0.1 %.
            let small = loss > best * 0.999;
            (best_cb, best_s, best) = (cb.clone(), scale.clone(), loss);
            if small {
                break;
            }
        } else {
            break;
        }
    }
    let out = LutMatrix { codebook: best_cb, scale: best_s, ..m.clone() };
    (out, Refit { before, after: best, rounds: run })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gptq::calib_loss;
    use forge_kernels::lut::Format;
    use forge_model::sampling::Rng;

    fn hessian(n: usize, rows: usize, rng: &mut Rng) -> Vec<f32> {
        // Correlated inputs with uneven channel scales, as activations have.
        let x: Vec<f32> = (0..rows * n)
            .map(|i| (rng.next_f64() as f32 - 0.5) * (1.0 + (i % n) as f32 / 4.0) + if i % 3 == 0 { 0.3 } else { 0.0 })
            .collect();
        let mut h = vec![0f32; n * n];
        for r in x.chunks(n) {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += r[i] * r[j] / rows as f32;
                }
            }
        }
        h
    }

    fn planted(format: Format, cout: usize, cin: usize, rng: &mut Rng) -> LutMatrix {
        let (d, k) = (format.vec_dim(), format.entries());
        let mut codebook: Vec<f32> = (0..k * d).map(|_| (rng.next_f64() as f32 - 0.5) * 4.0).collect();
        snap_codebook(&mut codebook);
        let idx: Vec<u8> = (0..cout / d * cin).map(|_| (rng.next_u64() % k as u64) as u8).collect();
        let scale = (0..cout).map(|_| f16_round(0.5 + rng.next_f64() as f32)).collect();
        LutMatrix { format, cout, cin, codebook, idx: idx.into(), scale }
    }

    /// Relative output error of `m` against `w` under `h`.
    fn rel_error(w: &[f32], m: &LutMatrix, h: &[f32]) -> f64 {
        let zero = vec![0.0; w.len()];
        (calib_loss(w, &m.reconstruct(), m.cout, m.cin, h) / calib_loss(w, &zero, m.cout, m.cin, h)).sqrt()
    }

    #[test]
    fn recovers_a_planted_solution() {
        for (format, seed) in [(Format::Lut4, 1), (Format::Lut2, 2), (Format::Vec2x16, 3), (Format::Vec2x64, 4)] {
            let mut rng = Rng::new(seed);
            let (cout, cin) = (48, 40);
            let truth = planted(format, cout, cin, &mut rng);
            let w = truth.reconstruct();
            let h = hessian(cin, 200, &mut rng);
            // Same indices, wrong values and scales.
            let mut start = truth.clone();
            start.codebook.iter_mut().for_each(|c| *c = *c * 1.3 + 0.05);
            start.scale.iter_mut().enumerate().for_each(|(r, s)| *s = f16_round(*s * (0.7 + 0.01 * r as f32)));
            assert!(rel_error(&w, &start, &h) > 0.2);
            // The closed-form steps alone: exact up to the FP16 scales (measured 2e-4 relative).
            let (free, rf) = refit_on(&w, &start, &h, 20, false);
            assert!(rel_error(&w, &free, &h) < 4e-4, "{format:?}: {} ({rf:?})", rel_error(&w, &free, &h));
            // On the grid: the alternation may settle on a rescaled codebook (s·c is what
            // matters), whose values then round to 1/127 of their range: about 4e-3 relative.
            let (got, rf) = refit(&w, &start, &h, 8);
            assert!(rel_error(&w, &got, &h) < 8e-3, "{format:?}: {} ({rf:?})", rel_error(&w, &got, &h));
            assert_eq!(got.idx, start.idx);
            assert!(got.scale.iter().all(|&s| f16_round(s) == s));
            let mut snapped = got.codebook.clone();
            snap_codebook(&mut snapped);
            assert_eq!(snapped, got.codebook, "{format:?}: codebook off the kernels' grid");
        }
    }

    #[test]
    fn never_increases_the_loss_and_reports_it_exactly() {
        let mut rng = Rng::new(7);
        let (cout, cin) = (32, 24);
        let h = hessian(cin, 60, &mut rng);
        for trial in 0..6 {
            let w: Vec<f32> = (0..cout * cin).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let m = planted(if trial % 2 == 0 { Format::Lut3 } else { Format::Vec2x64 }, cout, cin, &mut rng);
            let (got, rf) = refit(&w, &m, &h, 4);
            assert!(rf.after <= rf.before);
            let exact_before = calib_loss(&w, &m.reconstruct(), cout, cin, &h);
            let exact_after = calib_loss(&w, &got.reconstruct(), cout, cin, &h);
            assert!((exact_before - rf.before).abs() <= 1e-4 * exact_before, "{exact_before} {}", rf.before);
            assert!((exact_after - rf.after).abs() <= 1e-4 * exact_after, "{exact_after} {}", rf.after);
            assert!(exact_after <= exact_before * (1.0 + 1e-6));
        }
    }
}
