//! Microbenchmarks of the integer-dot matrix kernels: each format at decode (T = 1) and verify
//! (T = 8) on SmolLM2's MLP shape and a 27B-sized slice, SIMD against the scalar reference on
//! the same packed data, activations quantized outside the timed loop; and prefill (T = 64,
//! weights decoded to f32 and FMA tiles), counted in multiply-adds per second; and the online
//! rotation of one activation row.
//!
//! `cargo bench -p forge-kernels --bench kernels` (divan prints time and bytes/s per case; the
//! ratio SIMD ÷ scalar is the speedup). `forge bench --kernels` gives the same comparison as one
//! table with the machine's read bandwidth measured next to it.

use divan::counter::{BytesCount, ItemsCount};
use divan::Bencher;
use forge_kernels::lut::{synthetic, Format, Synthetic};
use forge_kernels::lutmm::intdot::{gemm_many, matmul_many, DotMatrix, QuantX};

fn main() {
    divan::main();
}

/// `(cout, cin)`: SmolLM2's MLP up projection, and a 27B-shaped slice (hidden 5120).
const SHAPES: [(usize, usize); 2] = [(1536, 576), (4096, 5120)];
const FORMATS: [&str; 4] = ["lut4", "vec2x16", "vec2x64", "int8"];

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

/// A random matrix of the format, packed, with its codebook on the 8-bit grid.
fn matrix(format: &str, cout: usize, cin: usize) -> DotMatrix {
    match synthetic(Format::parse(format).expect("format"), cout, cin, 0x5eed) {
        Synthetic::Int8(m) => DotMatrix::from_int8(&m),
        Synthetic::Lut(m) => DotMatrix::from_lut(&m).expect("codebook on the 8-bit grid"),
    }
}

fn run(b: Bencher, format: &str, shape: (usize, usize), t: usize, simd: bool) {
    let (cout, cin) = shape;
    let m = matrix(format, cout, cin);
    let mut r = Lcg(7);
    let x: Vec<f32> = (0..t * cin).map(|_| (r.next() % 2000) as f32 / 1000.0 - 1.0).collect();
    let qx = QuantX::new(&x, t, cin);
    let mut y = vec![0f32; t * cout];
    b.counter(BytesCount::new(m.packed_bytes())).bench_local(|| {
        matmul_many(simd, &[&m], &qx, &mut [&mut y]);
        divan::black_box(&y);
    });
}

#[divan::bench(args = FORMATS, consts = [0, 1])]
fn decode_simd<const S: usize>(b: Bencher, format: &str) {
    run(b, format, SHAPES[S], 1, true)
}

#[divan::bench(args = FORMATS, consts = [0, 1], sample_count = 10)]
fn decode_scalar<const S: usize>(b: Bencher, format: &str) {
    run(b, format, SHAPES[S], 1, false)
}

#[divan::bench(args = FORMATS, consts = [0, 1])]
fn verify8_simd<const S: usize>(b: Bencher, format: &str) {
    run(b, format, SHAPES[S], 8, true)
}

/// Prefill: T = 64 rows through the decode-to-f32 and FMA path; items are multiply-adds.
#[divan::bench(args = FORMATS, consts = [0, 1], sample_count = 20)]
fn prefill64_simd<const S: usize>(b: Bencher, format: &str) {
    let ((cout, cin), t) = (SHAPES[S], 64);
    let m = matrix(format, cout, cin);
    let mut r = Lcg(7);
    let x: Vec<f32> = (0..t * cin).map(|_| (r.next() % 2000) as f32 / 1000.0 - 1.0).collect();
    let mut y = vec![0f32; t * cout];
    b.counter(ItemsCount::new(t * cout * cin)).bench_local(|| {
        gemm_many(true, &[&m], &x, t, &mut [&mut y]);
        divan::black_box(&y);
    });
}

/// One activation row through its online rotation (sign pass, block FWHT) at SmolLM2's widths
/// (blocks of 64 and 512) and the 27B's (blocks of 1024).
#[divan::bench(args = [576, 1536, 5120, 17408])]
fn rotate_row(b: Bencher, dim: usize) {
    let rot = forge_kernels::rotation::Rotation::new(dim, 1000);
    let mut r = Lcg(11);
    let x: Vec<f32> = (0..dim).map(|_| (r.next() % 2000) as f32 / 1000.0 - 1.0).collect();
    let mut out = vec![0f32; dim];
    b.counter(BytesCount::new(4 * dim)).bench_local(|| {
        rot.apply_rows_into(&x, &mut out);
        divan::black_box(&out);
    });
}
