//! `Linear`: the one abstraction every projection goes through, so the reference, calibration and
//! quantized runtimes share the model code.

use anyhow::Result;
use forge_core::tensor::HostTensor;
use forge_kernels::matmul::matmul_xwt;

/// Stored weight of a linear layer.
#[derive(Clone)]
pub enum Weight {
    /// Row-major `[out, in]` f32/BF16/F16 (possibly memory-mapped).
    Dense(HostTensor),
}

#[derive(Clone)]
pub struct Linear {
    /// Canonical name without `.weight`, e.g. `layers.3.mlp.down_proj`.
    pub name: String,
    pub out_f: usize,
    pub in_f: usize,
    pub weight: Weight,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn dense(name: impl Into<String>, w: HostTensor, bias: Option<Vec<f32>>) -> Self {
        let (out_f, in_f) = (w.shape[0], w.shape[1]);
        Linear { name: name.into(), out_f, in_f, weight: Weight::Dense(w), bias }
    }

    /// `y = x Wᵀ + b` for `t` rows of `x`.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let mut y = vec![0f32; t * self.out_f];
        match &self.weight {
            Weight::Dense(w) => matmul_xwt(x, t, w.floats()?, self.out_f, self.in_f, &mut y),
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

    /// Number of weights (for bits/weight accounting).
    pub fn numel(&self) -> usize {
        self.out_f * self.in_f
    }
}
