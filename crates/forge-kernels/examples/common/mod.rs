//! Seeded test data shared by the kernel examples.

use forge_kernels::lut::{Format, Int8Matrix, LutMatrix};
use forge_kernels::lutmm::intdot::DotMatrix;

/// Argument `i` as a `COUTxCIN` shape, or `default`.
#[allow(dead_code)] // each example builds this module; `prefill_gemm` takes no shape
pub fn shape_arg(args: &[String], i: usize, default: (usize, usize)) -> (usize, usize) {
    args.get(i)
        .and_then(|s| s.split_once('x'))
        .map(|(a, b)| (a.parse().expect("cout"), b.parse().expect("cin")))
        .unwrap_or(default)
}

/// Xorshift64 with a fixed seed: every run times the same data.
pub struct Rng(u64);

impl Rng {
    pub fn new() -> Rng {
        Rng(0x9E37_79B9_7F4A_7C15)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// `n` activations in [-1, 1].
    pub fn activations(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// A random `cout × cin` LUT matrix of `format` with a codebook on the 8-bit grid, packed
    /// for the integer-dot kernels.
    pub fn lut_matrix(&mut self, format: Format, cout: usize, cin: usize) -> DotMatrix {
        let (k, dim) = (format.entries(), format.vec_dim());
        let m = LutMatrix {
            format,
            cout,
            cin,
            codebook: (0..k * dim).map(|_| ((self.next() % 256) as i32 - 128) as f32 / 64.0).collect(),
            idx: (0..cout / dim * cin).map(|_| (self.next() % k as u64) as u8).collect(),
            scale: vec![0.01; cout],
        };
        DotMatrix::from_lut(&m).expect("integer codebook")
    }

    /// A random `cout × cin` matrix of any integer-dot format: INT8 bytes, or [`Rng::lut_matrix`].
    #[allow(dead_code)] // not every example times INT8
    pub fn dot_matrix(&mut self, format: Format, cout: usize, cin: usize) -> DotMatrix {
        if format == Format::Int8 {
            let q = (0..cout * cin).map(|_| self.next() as u8 as i8).collect();
            DotMatrix::from_int8(&Int8Matrix { cout, cin, q, scale: vec![0.01; cout] })
        } else {
            self.lut_matrix(format, cout, cin)
        }
    }
}

/// The formats named by `FORMATS` (comma-separated, e.g. `lut3,lut2`), else every format with
/// integer-dot kernels.
#[allow(dead_code)] // read by the A/B examples only
pub fn formats() -> Vec<Format> {
    match std::env::var("FORMATS") {
        Ok(s) => s.split(',').map(|f| Format::parse(f).expect("FORMATS")).collect(),
        Err(_) => vec![Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8],
    }
}

/// Bytes of matrix copies a `cold` run cycles through: four times the largest cache Linux
/// reports for CPU 0, at least 512 MiB, so that each call reads its weights from memory.
#[allow(dead_code)] // read by the examples with a `cold` mode only
pub fn cold_bytes() -> usize {
    let llc = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache")
        .into_iter()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| {
            let s = s.trim();
            let (n, m) = if let Some(k) = s.strip_suffix('K') { (k, 1 << 10) } else { (s.strip_suffix('M')?, 1 << 20) };
            Some(n.parse::<usize>().ok()? * m)
        })
        .max()
        .unwrap_or(0);
    (4 * llc).max(512 << 20)
}
