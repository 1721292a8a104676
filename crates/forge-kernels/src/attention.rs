//! Causal attention of one query head over a contiguous key/value history.

use crate::act::softmax;
use crate::simd::{axpy, dot};

/// `out = softmax(q·Kᵀ·scale) V` over the first `n` rows of the history.
///
/// `keys`/`values` hold rows of `stride` floats; this head's vector starts at `offset` in each
/// row. `scores` is scratch of at least `n` floats.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    for (j, s) in scores[..n].iter_mut().enumerate() {
        let k = &keys[j * stride + offset..j * stride + offset + d];
        *s = dot(q, k) * scale;
    }
    softmax(&mut scores[..n]);
    out.iter_mut().for_each(|o| *o = 0.0);
    for (j, &p) in scores[..n].iter().enumerate() {
        let v = &values[j * stride + offset..j * stride + offset + out.len()];
        axpy(p, v, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn single_key_returns_its_value_and_uniform_scores_average() {
        let q = [1.0f32, 0.0];
        let keys = [0.5f32, 0.5, 9.0, 9.0];
        let values = [1.0f32, 2.0, 7.0, 7.0];
        let mut s = [0f32; 2];
        let mut out = [0f32; 2];
        attend(&q, &keys, &values, 1, 4, 0, 1.0, &mut s, &mut out);
        assert_eq!(out, [1.0, 2.0]);
        let keys2 = [0.0f32, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0];
        let values2 = [2.0f32, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0];
        attend(&q, &keys2, &values2, 2, 4, 0, 1.0, &mut s, &mut out);
        assert!((out[0] - 3.0).abs() < 1e-6); // q·k = 0 for both: mean of values
    }
}
