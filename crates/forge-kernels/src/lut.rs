//! Weight formats, described once: name, index width, codebook shape, reconstruction and packed
//! size (the ANEMLL Forge quantization guide, §2–3). Fitting and rounding live in `forge-quant`, the fast packed
//! kernels in `lutmm`; the reference decoder is here.
//!
//! A LUT matrix `W (cout × cin)` with vector length `d` stores a codebook `L (K × d)`, indices
//! `I (cout/d × cin)` and one scale per output row; `Ŵ[d·g + t, j] = s[d·g + t] · L[I[g, j], t]`.
//! A vector centroid spans `d` consecutive *output* rows at one input column.

use crate::matmul::RowSource;
use anyhow::{bail, Result};
pub use forge_core::tensor::Bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Scalar 4-bit LUT (16 entries) + per-row scale: "LUT4 per-tensor + pcs".
    Lut4,
    Lut3,
    Lut2,
    /// 16 two-component centroids, one 4-bit index per row pair: 2 bits/weight.
    Vec2x16,
    /// 64 two-component centroids, one 6-bit index per row pair: 3 bits/weight.
    Vec2x64,
    /// Symmetric per-row INT8, `s = max|w| / 127`.
    Int8,
    F16,
    Bf16,
}

pub const ALL_FORMATS: [Format; 8] = [
    Format::Lut4,
    Format::Lut3,
    Format::Lut2,
    Format::Vec2x16,
    Format::Vec2x64,
    Format::Int8,
    Format::F16,
    Format::Bf16,
];

impl Format {
    /// Accepts short names (`lut4`, `vec2x16`, `int8`, `bf16`) and ANEMLL Forge's long ones
    /// ("LUT4 per-tensor + pcs", "vector 2x16 + pcs", "INT8 per-channel").
    pub fn parse(s: &str) -> Result<Format> {
        let k: String = s.to_ascii_lowercase().chars().filter(|c| !c.is_whitespace()).collect();
        let k = k.trim_end_matches("+pcs").trim_end_matches("per-tensor").trim_end_matches("per-channel");
        Ok(match k {
            "lut4" => Format::Lut4,
            "lut3" => Format::Lut3,
            "lut2" => Format::Lut2,
            "vec2x16" | "vector2x16" => Format::Vec2x16,
            "vec2x64" | "vector2x64" => Format::Vec2x64,
            "int8" => Format::Int8,
            "f16" | "fp16" => Format::F16,
            "bf16" => Format::Bf16,
            _ => bail!(
                "unknown weight format '{s}' (known: lut4, lut3, lut2, vec2x16, vec2x64, int8, f16, bf16, or the long names \
                 \"LUT4 per-tensor + pcs\", \"vector 2x16 + pcs\", \"vector 2x64 + pcs\", \"INT8 per-channel\")"
            ),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Lut4 => "lut4",
            Format::Lut3 => "lut3",
            Format::Lut2 => "lut2",
            Format::Vec2x16 => "vec2x16",
            Format::Vec2x64 => "vec2x64",
            Format::Int8 => "int8",
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
        }
    }

    /// ANEMLL Forge's name, written into export metadata.
    pub fn long_name(self) -> &'static str {
        match self {
            Format::Lut4 => "LUT4 per-tensor + pcs",
            Format::Lut3 => "LUT3 per-tensor + pcs",
            Format::Lut2 => "LUT2 per-tensor + pcs",
            Format::Vec2x16 => "vector 2x16 + pcs",
            Format::Vec2x64 => "vector 2x64 + pcs",
            Format::Int8 => "INT8 per-channel",
            Format::F16 => "fp16",
            Format::Bf16 => "bf16",
        }
    }

    pub fn is_lut(self) -> bool {
        matches!(self, Format::Lut4 | Format::Lut3 | Format::Lut2 | Format::Vec2x16 | Format::Vec2x64)
    }

    /// Codebook vector length `d` (rows covered by one index).
    pub fn vec_dim(self) -> usize {
        match self {
            Format::Vec2x16 | Format::Vec2x64 => 2,
            _ => 1,
        }
    }

    /// Codebook entries `K`.
    pub fn entries(self) -> usize {
        match self {
            Format::Lut4 | Format::Vec2x16 => 16,
            Format::Lut3 => 8,
            Format::Lut2 => 4,
            Format::Vec2x64 => 64,
            _ => 0,
        }
    }

    /// Bits of one packed index (or one stored element for int8/f16/bf16).
    pub fn index_bits(self) -> usize {
        match self {
            Format::Lut4 | Format::Vec2x16 => 4,
            Format::Lut3 => 3,
            Format::Lut2 => 2,
            Format::Vec2x64 => 6,
            Format::Int8 => 8,
            Format::F16 | Format::Bf16 => 16,
        }
    }

    /// Nominal packed bits per weight (index bits over vector length).
    pub fn bits_per_weight(self) -> f64 {
        self.index_bits() as f64 / self.vec_dim() as f64
    }

    /// Packed size by ANEMLL Forge's formula: `Cout·Cin·b/8 + codebook + 2·Cout` (FP16 codebook and
    /// row scales); int8 adds its FP16 row scales; f16/bf16 are 2 bytes per weight.
    pub fn packed_bytes(self, cout: usize, cin: usize) -> usize {
        let n = cout * cin;
        match self {
            Format::F16 | Format::Bf16 => 2 * n,
            Format::Int8 => n + 2 * cout,
            _ => (n * self.index_bits()).div_ceil(8 * self.vec_dim()) + 2 * self.entries() * self.vec_dim() + 2 * cout,
        }
    }
}

/// A LUT-quantized matrix in its plain (one byte per index) form.
#[derive(Clone, Debug, PartialEq)]
pub struct LutMatrix {
    pub format: Format,
    pub cout: usize,
    pub cin: usize,
    /// `K × d`, FP16-exact values.
    pub codebook: Vec<f32>,
    /// `cout/d × cin`: owned by a quantizer's result, a view of the mapped file when read from
    /// an export (so a load without the compiled cache holds only the packed copy in memory).
    pub idx: Bytes,
    /// `cout`, FP16-exact.
    pub scale: Vec<f32>,
}

impl LutMatrix {
    /// Check shapes and index range (for data read from files).
    pub fn validate(&self) -> Result<()> {
        let d = self.format.vec_dim();
        if !self.format.is_lut() {
            bail!("{} is not a LUT format", self.format.name());
        }
        if !self.cout.is_multiple_of(d) {
            bail!("{} rows are not a multiple of the vector length {d}", self.cout);
        }
        if self.codebook.len() != self.format.entries() * d {
            bail!(
                "codebook has {} values, {} expects {}×{d}",
                self.codebook.len(),
                self.format.name(),
                self.format.entries()
            );
        }
        if self.idx.len() != self.cout / d * self.cin {
            bail!("index tensor has {} entries, expected {}×{}", self.idx.len(), self.cout / d, self.cin);
        }
        if self.scale.len() != self.cout {
            bail!("scale has {} entries, expected {}", self.scale.len(), self.cout);
        }
        if let Some(&bad) = self.idx.iter().find(|&&i| i as usize >= self.format.entries()) {
            bail!("index {bad} is out of range for a {}-entry codebook", self.format.entries());
        }
        Ok(())
    }

    /// Decode rows `r0..r0+n` (`r0`, `n` multiples of `d`) into `out` (`n × cin`).
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        let (d, cin) = (self.format.vec_dim(), self.cin);
        for gi in 0..n / d {
            let g = r0 / d + gi;
            let idx = &self.idx[g * cin..(g + 1) * cin];
            for t in 0..d {
                let r = g * d + t;
                let s = self.scale[r];
                let row = &mut out[(gi * d + t) * cin..(gi * d + t + 1) * cin];
                for (o, &i) in row.iter_mut().zip(idx) {
                    *o = s * self.codebook[i as usize * d + t];
                }
            }
        }
    }

    /// The dense reconstruction `Ŵ`.
    pub fn reconstruct(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.cout * self.cin];
        self.decode_rows(0, self.cout, &mut w);
        w
    }
}

impl RowSource for LutMatrix {
    fn n_in(&self) -> usize {
        self.cin
    }
    fn n_out(&self) -> usize {
        self.cout
    }
    fn decode(&self, r0: usize, n: usize, buf: &mut [f32]) {
        self.decode_rows(r0, n, buf)
    }
}

/// Symmetric per-row INT8.
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Matrix {
    pub cout: usize,
    pub cin: usize,
    pub q: Vec<i8>,
    /// `cout`, FP16-exact.
    pub scale: Vec<f32>,
}

impl Int8Matrix {
    pub fn reconstruct(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.cout * self.cin];
        self.decode(0, self.cout, &mut w);
        w
    }
}

impl RowSource for Int8Matrix {
    fn n_in(&self) -> usize {
        self.cin
    }
    fn n_out(&self) -> usize {
        self.cout
    }
    fn decode(&self, r0: usize, n: usize, buf: &mut [f32]) {
        for r in 0..n {
            let s = self.scale[r0 + r];
            let q = &self.q[(r0 + r) * self.cin..(r0 + r + 1) * self.cin];
            for (o, &v) in buf[r * self.cin..(r + 1) * self.cin].iter_mut().zip(q) {
                *o = s * v as f32;
            }
        }
    }
}

/// A seeded random matrix of a format, with its codebook on the 8-bit grid the quantizer writes:
/// the input of kernel benchmarks (`forge bench --kernels`, the divan benches).
pub enum Synthetic {
    Lut(LutMatrix),
    Int8(Int8Matrix),
}

/// See [`Synthetic`]; `cout` must be a multiple of the format's vector size.
pub fn synthetic(format: Format, cout: usize, cin: usize, seed: u64) -> Synthetic {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    if format == Format::Int8 {
        let q = (0..cout * cin).map(|_| next() as u8 as i8).collect();
        return Synthetic::Int8(Int8Matrix { cout, cin, q, scale: vec![0.01; cout] });
    }
    let (d, k) = (format.vec_dim(), format.entries());
    Synthetic::Lut(LutMatrix {
        format,
        cout,
        cin,
        codebook: (0..k * d).map(|i| ((i as f32 * 0.37).sin() * 64.0).round() / 64.0).collect(),
        idx: (0..cout / d * cin).map(|_| (next() % k as u32) as u8).collect(),
        scale: vec![0.5; cout],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{matmul_ref, matmul_rows};

    #[test]
    fn names_round_trip_and_long_names_parse() {
        for f in ALL_FORMATS {
            assert_eq!(Format::parse(f.name()).unwrap(), f);
            assert_eq!(Format::parse(f.long_name()).unwrap(), f);
        }
        assert!(Format::parse("lut5").is_err());
    }

    #[test]
    fn packed_size_closed_form() {
        // ANEMLL Forge's example: vec2x16 is Cout·Cin/4 + 64 + 2·Cout bytes.
        assert_eq!(Format::Vec2x16.packed_bytes(17408, 5120), 17408 * 5120 / 4 + 64 + 2 * 17408);
        assert_eq!(Format::Lut4.packed_bytes(10, 6), 30 + 32 + 20);
        assert_eq!(Format::Vec2x64.packed_bytes(4, 8), 12 + 256 + 8);
        assert_eq!(Format::Lut3.packed_bytes(8, 8), 24 + 16 + 16);
        assert_eq!(Format::Int8.packed_bytes(3, 5), 15 + 6);
    }

    #[test]
    fn seeds_worked_example() {
        // L[3] = [-0.25, 0.5], row scales [2, 4] → index 3 reconstructs [-0.5, 2.0].
        let mut codebook = vec![0f32; 32];
        codebook[6] = -0.25;
        codebook[7] = 0.5;
        let m = LutMatrix {
            format: Format::Vec2x16,
            cout: 2,
            cin: 1,
            codebook,
            idx: vec![3].into(),
            scale: vec![2.0, 4.0],
        };
        m.validate().unwrap();
        assert_eq!(m.reconstruct(), vec![-0.5, 2.0]);
    }

    #[test]
    fn lut_matmul_equals_dense_reconstruction() {
        for (format, cout, cin) in [(Format::Vec2x64, 130, 37), (Format::Lut3, 67, 5), (Format::Vec2x16, 300, 64)] {
            let d = format.vec_dim();
            let k = format.entries();
            let codebook: Vec<f32> = (0..k * d).map(|i| (i as f32 * 0.37).sin()).collect();
            let idx: Vec<u8> = (0..cout / d * cin).map(|i| ((i * 7 + 3) % k) as u8).collect();
            let scale: Vec<f32> = (0..cout).map(|r| 0.5 + r as f32 * 0.01).collect();
            let m = LutMatrix { format, cout, cin, codebook, idx: idx.into(), scale };
            m.validate().unwrap();
            let w = m.reconstruct();
            for t in [1, 3, 9] {
                let x: Vec<f32> = (0..t * cin).map(|i| (i as f32 * 0.11).cos()).collect();
                let mut y = vec![0f32; t * cout];
                matmul_rows(&x, t, &m, &mut y);
                let r = matmul_ref(&x, t, &w, cout, cin);
                for (a, b) in y.iter().zip(&r) {
                    assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "{format:?} t={t}: {a} vs {b}");
                }
            }
        }
    }
}
