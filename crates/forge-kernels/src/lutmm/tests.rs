use super::*;
use crate::matmul::matmul_ref;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn f(&mut self) -> f32 {
        (self.next() as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
}

fn fp16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

fn random_lut(format: Format, cout: usize, cin: usize, rng: &mut Rng) -> LutMatrix {
    let (d, k) = (format.vec_dim(), format.entries());
    LutMatrix {
        format,
        cout,
        cin,
        codebook: (0..k * d).map(|_| fp16(rng.f())).collect(),
        idx: (0..cout / d * cin).map(|_| (rng.next() % k as u64) as u8).collect(),
        scale: (0..cout).map(|_| fp16(0.1 + rng.f().abs())).collect(),
    }
}

fn random_int8(cout: usize, cin: usize, rng: &mut Rng) -> Int8Matrix {
    Int8Matrix {
        cout,
        cin,
        q: (0..cout * cin).map(|_| (rng.next() % 256) as u8 as i8).collect(),
        scale: (0..cout).map(|_| fp16(0.01 + rng.f().abs() * 0.01)).collect(),
    }
}

#[allow(clippy::too_many_arguments)]
/// `|a − b| ≤ 1e-5 · (Σ|terms| + |b|)`, the terms being `x·ŵ` of each output.
fn check(label: &str, y: &[f32], r: &[f32], x: &[f32], w: &[f32], t: usize, cout: usize, cin: usize) {
    for tt in 0..t {
        for o in 0..cout {
            let l1: f32 = (0..cin).map(|j| (x[tt * cin + j] * w[o * cin + j]).abs()).sum();
            let (a, b) = (y[tt * cout + o], r[tt * cout + o]);
            assert!((a - b).abs() <= 1e-5 * (l1 + b.abs()) + 1e-30, "{label} t={tt} o={o}: {a} vs {b} (l1 {l1})");
        }
    }
}

const SHAPES: [(usize, usize); 8] = [(2, 1), (8, 8), (14, 5), (30, 37), (64, 64), (130, 70), (262, 129), (516, 33)];

fn run_all(label: &str, p: &PackedMatrix, w: &[f32], rng: &mut Rng) {
    let (cout, cin) = (p.cout, p.cin);
    for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17] {
        let x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
        let r = matmul_ref(&x, t, w, cout, cin);
        let mut ys = vec![f32::NAN; t * cout];
        p.matmul_with(Backend::Scalar, &x, t, &mut ys);
        check(&format!("{label} scalar vs dense"), &ys, &r, &x, w, t, cout, cin);
        if crate::simd::has_avx2_fma() {
            let mut ya = vec![f32::NAN; t * cout];
            p.matmul_with(Backend::Avx2, &x, t, &mut ya);
            check(&format!("{label} avx2 vs scalar"), &ya, &ys, &x, w, t, cout, cin);
        }
    }
}

#[test]
fn lut_kernels_match_scalar_reference_and_dense() {
    let mut rng = Rng(42);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        for (cout, cin) in SHAPES {
            let m = random_lut(format, cout, cin, &mut rng);
            m.validate().unwrap();
            let p = PackedMatrix::from_lut(&m);
            run_all(&format!("{format:?} {cout}x{cin}"), &p, &m.reconstruct(), &mut rng);
        }
    }
}

#[test]
fn int8_kernels_match_scalar_reference_and_dense() {
    let mut rng = Rng(7);
    for (cout, cin) in SHAPES.into_iter().chain([(3, 11), (1, 1)]) {
        let m = random_int8(cout, cin, &mut rng);
        let p = PackedMatrix::from_int8(&m);
        run_all(&format!("int8 {cout}x{cin}"), &p, &m.reconstruct(), &mut rng);
    }
}

#[test]
fn extreme_indices_and_int8_values_decode() {
    // Every index value (incl. the top entry whose bit 3 drives the blend) and ±127/-128.
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        let (d, k) = (format.vec_dim(), format.entries());
        let (cout, cin) = (16 * d, 2 * k);
        let m = LutMatrix {
            format,
            cout,
            cin,
            codebook: (0..k * d).map(|i| i as f32 + 1.0).collect(),
            idx: (0..cout / d * cin).map(|i| ((i * 5 + i / cin) % k) as u8).collect(),
            scale: vec![1.0; cout],
        };
        let p = PackedMatrix::from_lut(&m);
        let w = m.reconstruct();
        for j in 0..cin {
            let mut x = vec![0f32; cin];
            x[j] = 1.0;
            for backend in [Backend::Scalar, Backend::Avx2] {
                let mut y = vec![0f32; cout];
                p.matmul_with(backend, &x, 1, &mut y);
                let col: Vec<f32> = (0..cout).map(|o| w[o * cin + j]).collect();
                assert_eq!(y, col, "{format:?} {backend:?} column {j}");
            }
        }
    }
    let q: Vec<i8> = (0..8 * 4).map(|i| [-128i8, -127, 127, -1, 0, 1][i % 6]).collect();
    let m = Int8Matrix { cout: 8, cin: 4, q, scale: vec![1.0; 8] };
    let p = PackedMatrix::from_int8(&m);
    let w = m.reconstruct();
    for j in 0..4 {
        let mut x = vec![0f32; 4];
        x[j] = 1.0;
        for backend in [Backend::Scalar, Backend::Avx2] {
            let mut y = vec![0f32; 8];
            p.matmul_with(backend, &x, 1, &mut y);
            assert_eq!(y, (0..8).map(|o| w[o * 4 + j]).collect::<Vec<_>>(), "int8 {backend:?}");
        }
    }
}

#[test]
fn large_matrix_parallel_path() {
    // Big enough for the rayon split; the result must not depend on the thread count.
    let mut rng = Rng(3);
    let m = random_lut(Format::Lut4, 1000, 1030, &mut rng);
    let p = PackedMatrix::from_lut(&m);
    let x: Vec<f32> = (0..2 * 1030).map(|_| rng.f()).collect();
    let mut y1 = vec![0f32; 2 * 1000];
    p.matmul(&x, 2, &mut y1);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let mut y2 = vec![0f32; 2 * 1000];
    pool.install(|| p.matmul(&x, 2, &mut y2));
    assert_eq!(y1, y2);
    check("lut4 1000x1030", &y1, &matmul_ref(&x, 2, &m.reconstruct(), 1000, 1030), &x, &m.reconstruct(), 2, 1000, 1030);
}
