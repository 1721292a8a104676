//! `Linear`: the one abstraction every projection goes through, so the reference, the
//! calibration pass and the quantized runtime share the model code. A linear layer is dense
//! (f32/BF16/F16), LUT or INT8, and may carry an online rotation of its input and a low-rank
//! branch `A(Bx)`.

use anyhow::Result;
use forge_core::tensor::HostTensor;
use forge_kernels::lut::{Int8Matrix, LutMatrix};
use forge_kernels::matmul::{matmul_rows, matmul_xwt, RowSource};
use std::sync::{Arc, Mutex};

/// Stored weight of a linear layer.
#[derive(Clone)]
pub enum Weight {
    /// Row-major `[out, in]` f32/BF16/F16 (possibly memory-mapped).
    Dense(HostTensor),
    Lut(Arc<LutMatrix>),
    Int8(Arc<Int8Matrix>),
}

/// Low-rank correction `A (out × r)`, `B (r × in)`, applied to the unrotated input.
#[derive(Clone, Debug)]
pub struct LowRank {
    pub rank: usize,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

/// An orthogonal transform of a layer's input, applied online (e.g. block Hadamard).
pub trait InputRotation: Send + Sync {
    /// `x ← x M` for rows of `x`.
    fn apply_rows(&self, x: &mut [f32]);
    /// `W ← W Mᵀ` (back to the original basis) for a `cout × in` weight.
    fn unrotate_weight(&self, w: &mut [f32], cout: usize);
    /// Description recorded in reports, e.g. `hadamard(block=64, seed=1003)`.
    fn describe(&self) -> String;
}

/// Receives the input rows of a linear layer (calibration statistics).
pub trait Observer: Send {
    fn observe(&mut self, name: &str, x: &[f32], t: usize);
}

#[derive(Clone)]
pub struct Linear {
    /// Canonical name without `.weight`, e.g. `layers.3.mlp.down_proj`.
    pub name: String,
    pub out_f: usize,
    pub in_f: usize,
    pub weight: Weight,
    pub bias: Option<Vec<f32>>,
    /// Online input rotation; the stored weight is in the rotated basis.
    pub rotation: Option<Arc<dyn InputRotation>>,
    pub lowrank: Option<LowRank>,
    /// Calibration hook: sees the (unrotated) input of every forward call.
    pub observer: Option<Arc<Mutex<dyn Observer>>>,
}

impl Linear {
    pub fn dense(name: impl Into<String>, w: HostTensor, bias: Option<Vec<f32>>) -> Self {
        let (out_f, in_f) = (w.shape[0], w.shape[1]);
        Linear { name: name.into(), out_f, in_f, weight: Weight::Dense(w), bias, rotation: None, lowrank: None, observer: None }
    }

    pub fn with_weight(name: impl Into<String>, out_f: usize, in_f: usize, weight: Weight) -> Self {
        Linear { name: name.into(), out_f, in_f, weight, bias: None, rotation: None, lowrank: None, observer: None }
    }

    /// `y = rot(x) Wᵀ + A(B x) + b` for `t` rows of `x`.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        if let Some(obs) = &self.observer {
            obs.lock().map_err(|_| anyhow::anyhow!("observer poisoned"))?.observe(&self.name, x, t);
        }
        let mut y = vec![0f32; t * self.out_f];
        let rotated;
        let xin: &[f32] = match &self.rotation {
            Some(r) => {
                let mut v = x.to_vec();
                r.apply_rows(&mut v);
                rotated = v;
                &rotated
            }
            None => x,
        };
        match &self.weight {
            Weight::Dense(w) => matmul_xwt(xin, t, w.floats()?, self.out_f, self.in_f, &mut y),
            Weight::Lut(m) => matmul_rows(xin, t, m.as_ref(), &mut y),
            Weight::Int8(m) => matmul_rows(xin, t, m.as_ref(), &mut y),
        }
        if let Some(lr) = &self.lowrank {
            let mut bx = vec![0f32; t * lr.rank];
            forge_kernels::matmul::matmul_xwt(x, t, forge_core::tensor::FloatSlice::F32(&lr.b), lr.rank, self.in_f, &mut bx);
            let mut abx = vec![0f32; t * self.out_f];
            forge_kernels::matmul::matmul_xwt(
                &bx,
                t,
                forge_core::tensor::FloatSlice::F32(&lr.a),
                self.out_f,
                lr.rank,
                &mut abx,
            );
            y.iter_mut().zip(&abx).for_each(|(a, b)| *a += b);
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(self.out_f) {
                for (o, &bb) in row.iter_mut().zip(b) {
                    *o += bb;
                }
            }
        }
        Ok(y)
    }

    /// Decode weight rows `r0..r0+n` in the stored basis (`n × in`), e.g. for embedding lookups
    /// through a tied quantized head.
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) -> Result<()> {
        match &self.weight {
            Weight::Dense(w) => w.floats()?.read_into(r0 * self.in_f, &mut out[..n * self.in_f]),
            Weight::Lut(m) => {
                // LUT decoding works on whole vector groups.
                let d = m.format.vec_dim();
                let g0 = r0 / d * d;
                let g1 = (r0 + n).div_ceil(d) * d;
                let mut buf = vec![0f32; (g1 - g0) * self.in_f];
                m.decode(g0, g1 - g0, &mut buf);
                out[..n * self.in_f].copy_from_slice(&buf[(r0 - g0) * self.in_f..(r0 - g0 + n) * self.in_f]);
            }
            Weight::Int8(m) => m.decode(r0, n, out),
        }
        Ok(())
    }

    /// The effective dense weight in the original (unrotated) basis, low-rank branch included.
    pub fn effective_weight(&self) -> Result<Vec<f32>> {
        let mut w = vec![0f32; self.out_f * self.in_f];
        self.decode_rows(0, self.out_f, &mut w)?;
        if let Some(r) = &self.rotation {
            r.unrotate_weight(&mut w, self.out_f);
        }
        if let Some(lr) = &self.lowrank {
            for o in 0..self.out_f {
                for k in 0..lr.rank {
                    let a = lr.a[o * lr.rank + k];
                    forge_kernels::simd::axpy(a, &lr.b[k * self.in_f..(k + 1) * self.in_f], &mut w[o * self.in_f..(o + 1) * self.in_f]);
                }
            }
        }
        Ok(w)
    }

    /// Number of weights (for bits/weight accounting).
    pub fn numel(&self) -> usize {
        self.out_f * self.in_f
    }
}

impl InputRotation for forge_kernels::rotation::Rotation {
    fn apply_rows(&self, x: &mut [f32]) {
        forge_kernels::rotation::Rotation::apply_rows(self, x)
    }
    fn unrotate_weight(&self, w: &mut [f32], cout: usize) {
        forge_kernels::rotation::Rotation::unrotate_weight(self, w, cout)
    }
    fn describe(&self) -> String {
        format!("hadamard(block={}, seed={})", self.block, self.seed)
    }
}
