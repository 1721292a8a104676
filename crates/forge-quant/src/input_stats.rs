//! What GPTQ and the error figures know of a linear layer's input: the Hessian `XᵀX/N` of the
//! fitting rows, in the basis of each matrix that reads the input, and the held-out rows
//! themselves.
//!
//! Matrices that share an input usually share its rotation too (gate and up; the token mixer's
//! input projections), so the fitting Hessian is turned into that basis in place: at a 27B
//! model's widths each copy would be 0.1–1.2 GB.

use crate::gptq::{Factor, Hessian};
use anyhow::{bail, Result};
use forge_kernels::rotation::Rotation;

pub struct InputStats {
    pub fit: Hessian,
    pub hold: HeldOut,
    /// The basis `fit` is in once prepared: `Some(None)` plain, `Some(Some(seed))` rotated.
    fit_basis: Option<Option<u64>>,
    /// The fitting Hessian in further rotated bases, by seed, when the matrices differ.
    copies: Vec<(u64, Vec<f32>)>,
    /// GPTQ's factors of the fitting Hessian, by basis, made once for the matrices sharing one.
    factors: Vec<(Option<u64>, Factor)>,
}

impl InputStats {
    pub fn new(dim: usize) -> Self {
        InputStats {
            fit: Hessian::new(dim),
            hold: HeldOut::new(dim),
            fit_basis: None,
            copies: Vec::new(),
            factors: Vec::new(),
        }
    }

    /// Finish the fitting Hessian and make it available in each basis of `bases` (one
    /// entry per matrix that reads this input: its rotation, or `None` for the plain basis).
    /// Prepared once; a second call must ask for the bases of the first.
    pub fn prepare(&mut self, bases: &[Option<&Rotation>]) -> Result<()> {
        let mut seeds: Vec<Option<u64>> = bases.iter().map(|r| r.map(|r| r.seed)).collect();
        seeds.sort();
        seeds.dedup();
        if self.fit_basis.is_some() {
            if seeds.iter().all(|s| self.has(*s)) {
                return Ok(());
            }
            bail!("input statistics prepared for other bases than {seeds:?}");
        }
        self.fit.finish();
        match seeds[..] {
            [single] => {
                if let Some(r) = bases.iter().flatten().next() {
                    self.fit.rotate(r);
                }
                self.fit_basis = Some(single);
            }
            _ => {
                for r in bases.iter().flatten() {
                    if !self.copies.iter().any(|c| c.0 == r.seed) {
                        self.copies.push((r.seed, self.fit.rotated(r)));
                    }
                }
                self.fit_basis = Some(None);
            }
        }
        Ok(())
    }

    /// Make GPTQ's factor of the fitting Hessian in `rot`'s basis (once per basis).
    pub fn make_factor(&mut self, rot: Option<&Rotation>) -> Result<()> {
        let seed = rot.map(|r| r.seed);
        if self.factors.iter().any(|f| f.0 == seed) {
            return Ok(());
        }
        let Some(h) = self.fit_in(rot) else { bail!("input statistics not prepared for basis {seed:?}") };
        let f = Factor::new(h, self.fit.dim)?;
        self.factors.push((seed, f));
        Ok(())
    }

    /// GPTQ's factor in `rot`'s basis, if made.
    pub fn factor(&self, rot: Option<&Rotation>) -> Option<&Factor> {
        let seed = rot.map(|r| r.seed);
        self.factors.iter().find(|f| f.0 == seed).map(|f| &f.1)
    }

    fn has(&self, seed: Option<u64>) -> bool {
        self.fit_basis == Some(seed) || seed.is_some_and(|s| self.copies.iter().any(|c| c.0 == s))
    }

    /// The fitting Hessian in `rot`'s basis (plain for `None`), if prepared for it.
    pub fn fit_in(&self, rot: Option<&Rotation>) -> Option<&[f32]> {
        let seed = rot.map(|r| r.seed);
        if self.fit_basis == Some(seed) {
            return Some(self.fit.matrix());
        }
        let s = seed?;
        self.copies.iter().find(|c| c.0 == s).map(|c| &c.1[..])
    }
}

/// The held-out rows' inputs, kept as they are: the error figures need `‖X(W − Q)ᵀ‖²/N` over a
/// few rows (4 × 512 tokens by default), a tenth of the memory of their Hessian at a 27B model's
/// widths.
#[derive(Clone, Debug)]
pub struct HeldOut {
    pub dim: usize,
    x: Vec<f32>,
    pub rows: usize,
}

/// Output rows of `W` per product in [`HeldOut::loss`].
const LOSS_ROWS: usize = 1024;

impl HeldOut {
    pub fn new(dim: usize) -> Self {
        HeldOut { dim, x: Vec::new(), rows: 0 }
    }

    /// Add the `t` rows of `x` (`t × dim`).
    pub fn add(&mut self, x: &[f32], t: usize) {
        self.x.extend_from_slice(&x[..t * self.dim]);
        self.rows += t;
    }

    /// `‖X(W − Q)ᵀ‖²/N` for the `out × dim` matrices `w` and `q` (`q = None`: zero, the signal).
    pub fn loss(&self, w: &[f32], q: Option<&[f32]>, out: usize) -> f64 {
        let n = self.dim;
        let mut total = 0f64;
        let (mut e, mut y) = (Vec::new(), Vec::new());
        for r0 in (0..out).step_by(LOSS_ROWS) {
            let m = LOSS_ROWS.min(out - r0);
            let wr = &w[r0 * n..(r0 + m) * n];
            e.clear();
            match q {
                Some(q) => e.extend(wr.iter().zip(&q[r0 * n..(r0 + m) * n]).map(|(a, b)| a - b)),
                None => e.extend_from_slice(wr),
            }
            y.resize(self.rows * m, 0f32);
            forge_kernels::matmul::gemm_f32_par(&self.x, self.rows, &e, m, n, &mut y);
            total += y.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        }
        total / self.rows.max(1) as f64
    }

    /// The rows in a rotation's basis (`X M`, the input the rotated matrix sees).
    pub fn rotated(&self, r: &Rotation) -> HeldOut {
        let mut x = self.x.clone();
        r.rotate_weight(&mut x, self.rows);
        HeldOut { dim: self.dim, x, rows: self.rows }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_model::sampling::Rng;

    fn stats(n: usize) -> InputStats {
        let mut r = Rng::new(4);
        let x = crate::fit::normal_samples(&mut r, 3 * n * n);
        let mut s = InputStats::new(n);
        s.fit.add(&x, 3 * n);
        s
    }

    /// `MᵀHM` by the definition: rotate the rows of the identity to get `M`.
    fn rotated_by_definition(h: &[f32], n: usize, r: &Rotation) -> Vec<f64> {
        let mut m = vec![0f32; n * n];
        for i in 0..n {
            m[i * n + i] = 1.0;
        }
        r.rotate_weight(&mut m, n); // row i is e_i M
        let mut out = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                let mut s = 0f64;
                for a in 0..n {
                    for b in 0..n {
                        s += m[a * n + i] as f64 * h[a * n + b] as f64 * m[b * n + j] as f64;
                    }
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    #[test]
    fn one_basis_is_made_in_place_and_several_as_copies() {
        let n = 32;
        let (r1, r2) = (Rotation::new(n, 7), Rotation::new(n, 8));
        let mut plain = stats(n);
        plain.prepare(&[None]).unwrap();
        let h = plain.fit.matrix().to_vec();
        let mut shared = stats(n);
        shared.prepare(&[Some(&r1), Some(&r1)]).unwrap();
        let mut mixed = stats(n);
        mixed.prepare(&[Some(&r1), None, Some(&r2)]).unwrap();
        for (r, got) in
            [(&r1, shared.fit_in(Some(&r1))), (&r1, mixed.fit_in(Some(&r1))), (&r2, mixed.fit_in(Some(&r2)))]
        {
            let want = rotated_by_definition(&h, n, r);
            for (g, w) in got.unwrap().iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
        assert_eq!(mixed.fit_in(None).unwrap(), &h[..]);
        // Bases it was not prepared for are refused, not guessed.
        assert!(shared.fit_in(None).is_none());
        assert!(shared.prepare(&[Some(&r2)]).is_err());
        assert!(shared.prepare(&[Some(&r1)]).is_ok());
    }

    #[test]
    fn held_out_loss_is_the_hessian_form() {
        let (n, out, t) = (40, 1100, 30);
        let mut r = Rng::new(6);
        let x = crate::fit::normal_samples(&mut r, t * n);
        let w = crate::fit::normal_samples(&mut r, out * n);
        let q: Vec<f32> = w.iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let mut held = HeldOut::new(n);
        held.add(&x[..10 * n], 10);
        held.add(&x[10 * n..], t - 10);
        let mut h = Hessian::new(n);
        h.add(&x, t);
        h.finish();
        for q in [None, Some(&q[..])] {
            let zero = vec![0f32; w.len()];
            let want = crate::gptq::calib_loss(&w, q.unwrap_or(&zero), out, n, h.matrix());
            let got = held.loss(&w, q, out);
            assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
        }
        // In a rotated basis the rotated matrices see the rotated rows: the loss is unchanged.
        let rot = Rotation::new(n, 3);
        let (mut wr, mut qr) = (w.clone(), q.clone());
        rot.rotate_weight(&mut wr, out);
        rot.rotate_weight(&mut qr, out);
        let (a, b) = (held.rotated(&rot).loss(&wr, Some(&qr), out), held.loss(&w, Some(&q), out));
        assert!((a - b).abs() < 1e-4 * b, "{a} vs {b}");
    }
}
