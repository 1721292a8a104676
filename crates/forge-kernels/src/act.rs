//! Elementwise activations, written as transformers computes them in f32.

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// softplus with PyTorch's threshold (x > 20 returns x), overflow-safe.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.max(0.0) + (-x.abs()).exp().ln_1p()
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place on `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// In-place softmax; returns nothing, handles -inf entries.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// log-softmax into `out` (f64 accumulation of the normalizer for stable KL).
pub fn log_softmax(x: &[f32], out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lse = m as f64 + s.ln();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v as f64 - lse) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn closed_forms() {
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-7);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!(softplus(-100.0) >= 0.0 && softplus(-100.0) < 1e-40);
        let mut v = vec![1.0, 2.0, 3.0, f32::NEG_INFINITY];
        softmax(&mut v);
        let z = 1f32.exp() + 2f32.exp() + 3f32.exp();
        assert!((v[2] - 3f32.exp() / z).abs() < 1e-6 && v[3] == 0.0);
        let mut l = vec![0f32; 3];
        log_softmax(&[1.0, 2.0, 3.0], &mut l);
        assert!((l[0] - (1.0 - z.ln())).abs() < 1e-6);
    }
}
