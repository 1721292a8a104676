//! One matrix through one format: per-row scales, codebook fit, round-to-nearest, and the
//! error figures. GPTQ reuses the scales, codebook and `Rounder` from here.

use crate::fit::{f16_round, fit_scalar, fit_vector, Centers};
use anyhow::{bail, Result};
use forge_kernels::lut::{Format, Int8Matrix, LutMatrix};
use rayon::prelude::*;

/// A quantized matrix in any format.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantMatrix {
    Lut(LutMatrix),
    Int8(Int8Matrix),
    /// F16/BF16: values already rounded to the format.
    Float {
        format: Format,
        cout: usize,
        cin: usize,
        data: Vec<f32>,
    },
}

impl QuantMatrix {
    pub fn format(&self) -> Format {
        match self {
            QuantMatrix::Lut(m) => m.format,
            QuantMatrix::Int8(_) => Format::Int8,
            QuantMatrix::Float { format, .. } => *format,
        }
    }
    pub fn shape(&self) -> (usize, usize) {
        match self {
            QuantMatrix::Lut(m) => (m.cout, m.cin),
            QuantMatrix::Int8(m) => (m.cout, m.cin),
            QuantMatrix::Float { cout, cin, .. } => (*cout, *cin),
        }
    }
    pub fn reconstruct(&self) -> Vec<f32> {
        match self {
            QuantMatrix::Lut(m) => m.reconstruct(),
            QuantMatrix::Int8(m) => m.reconstruct(),
            QuantMatrix::Float { data, .. } => data.clone(),
        }
    }
    pub fn packed_bytes(&self) -> usize {
        let (o, i) = self.shape();
        self.format().packed_bytes(o, i)
    }
}

/// Per-output-row scale `sqrt(mean_j W²)`, rounded through FP16; zero rows get 1.
pub fn row_scales(w: &[f32], cout: usize, cin: usize) -> Vec<f32> {
    (0..cout)
        .map(|r| {
            let row = &w[r * cin..(r + 1) * cin];
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cin as f64;
            let s = f16_round(ms.sqrt() as f32);
            if s == 0.0 || !s.is_finite() {
                1.0
            } else {
                s
            }
        })
        .collect()
}

/// Row-normalized weights `W/s`.
pub fn normalize(w: &[f32], cin: usize, scale: &[f32]) -> Vec<f32> {
    w.par_chunks(cin).zip(scale).flat_map_iter(|(row, &s)| row.iter().map(move |&v| v / s)).collect()
}

/// Gather the `d`-vectors (consecutive rows at one column) of a normalized matrix, with their
/// per-column weights.
fn vectors(wn: &[f32], cout: usize, cin: usize, d: usize, col_w: Option<&[f32]>) -> (Vec<f32>, Option<Vec<f32>>) {
    let groups = cout / d;
    let mut v = Vec::with_capacity(cout * cin);
    for g in 0..groups {
        for j in 0..cin {
            for t in 0..d {
                v.push(wn[(g * d + t) * cin + j]);
            }
        }
    }
    let w = col_w.map(|cw| (0..groups).flat_map(|_| cw.iter().copied()).collect());
    (v, w)
}

/// Fit the format's codebook (`K × d`, FP16-exact, on the 8-bit grid of
/// [`crate::fit::snap_codebook`]) to normalized weights.
pub fn fit_codebook(wn: &[f32], cout: usize, cin: usize, format: Format, col_w: Option<&[f32]>, seed: u64) -> Vec<f32> {
    let (d, k) = (format.vec_dim(), format.entries());
    let (v, w) = vectors(wn, cout, cin, d, col_w);
    let mut cb = if d == 1 { fit_scalar(&v, w.as_deref(), k, seed) } else { fit_vector(&v, d, w.as_deref(), k, seed) };
    crate::fit::snap_codebook(&mut cb);
    cb
}

/// Chooses the representable value for a group of `d` normalized weights (GPTQ's rounder).
pub struct Rounder<'a> {
    /// The sorted scalar codebook (`d = 1`).
    codebook: &'a [f32],
    /// Vector codebooks, laid out for the nearest-centroid scan.
    centers: Option<Centers>,
}

impl<'a> Rounder<'a> {
    pub fn new(codebook: &'a [f32], d: usize) -> Rounder<'a> {
        Rounder { codebook, centers: (d > 1).then(|| Centers::new(codebook, d)) }
    }

    /// Nearest codebook index for `p` (`d` values; ties → lowest index).
    #[inline]
    pub fn round(&self, p: &[f32]) -> usize {
        match &self.centers {
            Some(c) => c.index(p),
            None => {
                // Sorted scalar codebook: binary search then compare neighbours.
                let c = self.codebook;
                let x = p[0];
                let i = c.partition_point(|&v| v < x);
                if i == 0 {
                    0
                } else if i == c.len() || (x - c[i - 1]).abs() <= (c[i] - x).abs() {
                    i - 1
                } else {
                    i
                }
            }
        }
    }

    /// [`Rounder::round`] of eight scalars (`d = 1`), the same indices: the binary search's
    /// position is the number of entries below each value, counted for the eight together
    /// without a branch.
    pub fn round8(&self, x: &[f32; 8]) -> [usize; 8] {
        debug_assert!(self.centers.is_none());
        let c = self.codebook;
        let mut below = [0u32; 8];
        for &v in c {
            for (n, &xi) in below.iter_mut().zip(x) {
                *n += (v < xi) as u32;
            }
        }
        let last = c.len() - 1;
        std::array::from_fn(|l| {
            // Without branches: with no entry below, `lo = hi = c[0]` and the index stays 0.
            let (i, x) = (below[l] as usize, x[l]);
            let (lo, hi) = (c[i.max(1) - 1], c[i.min(last)]);
            let down = i > last || (i > 0 && (x - lo).abs() <= (hi - x).abs());
            i - down as usize
        })
    }
}

/// Round-to-nearest indices for a normalized matrix given its codebook.
pub fn assign_rtn(wn: &[f32], cout: usize, cin: usize, codebook: &[f32], d: usize) -> Vec<u8> {
    let r = Rounder::new(codebook, d);
    let groups = cout / d;
    let mut idx = vec![0u8; groups * cin];
    idx.par_chunks_mut(cin).enumerate().for_each(|(g, out)| {
        let mut p = [0f32; 2];
        for (j, o) in out.iter_mut().enumerate() {
            for t in 0..d {
                p[t] = wn[(g * d + t) * cin + j];
            }
            *o = r.round(&p[..d]) as u8;
        }
    });
    idx
}

/// Symmetric per-row INT8: `s = max|w|/127` (FP16), `q = clip(round(w/s), −127, 127)`.
pub fn quantize_int8(w: &[f32], cout: usize, cin: usize) -> Int8Matrix {
    let scale: Vec<f32> = (0..cout)
        .map(|r| {
            let m = w[r * cin..(r + 1) * cin].iter().fold(0f32, |a, &v| a.max(v.abs()));
            let s = f16_round(m / 127.0);
            if s == 0.0 {
                1.0
            } else {
                s
            }
        })
        .collect();
    let q = (0..cout)
        .flat_map(|r| {
            let s = scale[r];
            w[r * cin..(r + 1) * cin].iter().map(move |&v| (v / s).round().clamp(-127.0, 127.0) as i8)
        })
        .collect();
    Int8Matrix { cout, cin, q, scale }
}

/// Quantize one matrix with round-to-nearest.
pub fn quantize_rtn(
    w: &[f32],
    cout: usize,
    cin: usize,
    format: Format,
    col_w: Option<&[f32]>,
    seed: u64,
) -> Result<QuantMatrix> {
    if w.len() != cout * cin {
        bail!("weight has {} values, expected {cout}×{cin}", w.len());
    }
    Ok(match format {
        Format::Int8 => QuantMatrix::Int8(quantize_int8(w, cout, cin)),
        Format::F16 => QuantMatrix::Float { format, cout, cin, data: w.iter().map(|&v| f16_round(v)).collect() },
        Format::Bf16 => QuantMatrix::Float {
            format,
            cout,
            cin,
            data: w.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
        },
        _ => {
            let d = format.vec_dim();
            if !cout.is_multiple_of(d) {
                bail!("{} needs an even number of output rows, found {cout}", format.name());
            }
            let scale = row_scales(w, cout, cin);
            let wn = normalize(w, cin, &scale);
            let codebook = fit_codebook(&wn, cout, cin, format, col_w, seed);
            let idx = assign_rtn(&wn, cout, cin, &codebook, d);
            QuantMatrix::Lut(LutMatrix { format, cout, cin, codebook, idx: idx.into(), scale })
        }
    })
}

/// `10·log10(‖W‖² / ‖W − Ŵ‖²)`.
pub fn snr_db(w: &[f32], what: &[f32]) -> f64 {
    let (mut s, mut e) = (0f64, 0f64);
    for (&a, &b) in w.iter().zip(what) {
        s += a as f64 * a as f64;
        e += (a as f64 - b as f64).powi(2);
    }
    if e == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (s / e).log10()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_model::sampling::Rng;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        crate::fit::normal_samples(&mut Rng::new(seed), n)
    }

    #[test]
    fn round8_is_round_at_ties_edges_and_non_finite_values() {
        let cb: Vec<f32> = [-1.0f32, -0.25, 0.0, 0.0, 0.5, 2.0].to_vec();
        let r = Rounder::new(&cb, 1);
        let mut xs: Vec<f32> = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -7.0, 9.0, -0.0];
        // Every entry, every midpoint (exact ties) and the floats either side of them.
        for w in cb.windows(2) {
            for m in [w[0], 0.5 * (w[0] + w[1])] {
                xs.extend([m, f32::from_bits(m.to_bits() + 1), f32::from_bits(m.to_bits().saturating_sub(1))]);
            }
        }
        xs.extend(gaussian(61, 4));
        for chunk in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..chunk.len()].copy_from_slice(chunk);
            let got = r.round8(&x);
            for (l, &v) in x.iter().enumerate() {
                assert_eq!(got[l], r.round(&[v]), "{v}");
            }
        }
    }

    #[test]
    fn gaussian_snr_matches_anemll_forge() {
        // ANEMLL Forge research notes (§2): LUT4 20.1 dB, vector 2x64 15.2, scalar 3-bit 14.5, vector 2x16 9.7,
        // scalar 2-bit 9.3, on large i.i.d. Gaussian matrices (k-means, per-tensor LUT).
        let (cout, cin) = (1024, 1024);
        let w = gaussian(cout * cin, 11);
        for (format, want) in [
            (Format::Lut4, 20.1),
            (Format::Vec2x64, 15.2),
            (Format::Lut3, 14.5),
            (Format::Vec2x16, 9.7),
            (Format::Lut2, 9.3),
        ] {
            let q = quantize_rtn(&w, cout, cin, format, None, 0).unwrap();
            let snr = snr_db(&w, &q.reconstruct());
            assert!((snr - want).abs() <= 0.3, "{}: {snr:.2} dB, ANEMLL Forge {want}", format.name());
        }
    }

    #[test]
    fn reconstruction_is_the_formula() {
        let (cout, cin) = (6, 5);
        let w = gaussian(cout * cin, 2);
        let QuantMatrix::Lut(m) = quantize_rtn(&w, cout, cin, Format::Vec2x16, None, 0).unwrap() else { panic!() };
        let r = m.reconstruct();
        for g in 0..cout / 2 {
            for j in 0..cin {
                for t in 0..2 {
                    let i = m.idx[g * cin + j] as usize;
                    assert_eq!(r[(2 * g + t) * cin + j], m.scale[2 * g + t] * m.codebook[i * 2 + t]);
                }
            }
        }
        // Scales are FP16-exact RMS values; the codebook is FP16-exact.
        for (rr, &s) in m.scale.iter().enumerate() {
            let rms = (w[rr * cin..(rr + 1) * cin].iter().map(|v| v * v).sum::<f32>() / cin as f32).sqrt();
            assert_eq!(s, f16_round(rms));
        }
        assert!(m.codebook.iter().all(|&c| f16_round(c) == c));
        // ... and on the 8-bit grid the integer-dot kernels need.
        assert!(forge_kernels::lutmm::intdot::int8_codebook(&m.codebook).is_some());
    }

    #[test]
    fn int8_closed_form() {
        let w = [1.0f32, -0.5, 0.25, 0.0, 0.0, 0.0];
        let m = quantize_int8(&w, 2, 3);
        assert_eq!(m.scale[1], 1.0); // zero row
        assert_eq!(m.q[..3], [127, -64, 32]); // round(-63.5) = -64 (away from zero)
        assert_eq!(m.scale[0], f16_round(1.0 / 127.0));
    }

    #[test]
    fn rounder_is_nearest() {
        let c = [-1.0f32, -0.25, 0.5, 2.0];
        let r = Rounder::new(&c, 1);
        for x in [-3.0f32, -0.6, -0.2, 0.1, 0.2, 1.24, 1.26, 9.0] {
            let want = c.iter().enumerate().min_by(|a, b| (a.1 - x).abs().total_cmp(&(b.1 - x).abs())).unwrap().0;
            assert_eq!(r.round(&[x]), want, "x={x}");
        }
    }
}
