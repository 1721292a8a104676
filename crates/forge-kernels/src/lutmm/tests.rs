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

/// Some tests flip the process-wide kernel switches (`set_avx512`, `set_wide`, the activation
/// planes, the prefill kernels) and restore them; a test running beside one could pack a
/// matrix under one setting and multiply under the other. Every test here holds this lock.
fn switches() -> std::sync::MutexGuard<'static, ()> {
    static SWITCHES: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SWITCHES.lock().unwrap_or_else(|e| e.into_inner())
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

/// A LUT matrix whose codebook is 8-bit integers times 2⁻⁶ (the integer-dot layout).
fn random_lut_int(format: Format, cout: usize, cin: usize, rng: &mut Rng) -> LutMatrix {
    let mut m = random_lut(format, cout, cin, rng);
    m.codebook.iter_mut().for_each(|c| *c = ((rng.next() % 256) as i32 - 128) as f32 / 64.0);
    m
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

/// The integer-dot kernels write each activation as a 16-bit plane and a 7-bit plane for its
/// residual: `|x − x̂| ≤ max|x| / (65534 · 126)` (about 2⁻²³) per element, so the scalar
/// reference is within `Σ|w| · max|x| / (65534 · 126)` (+ f32 rounding) of dense
/// dequantize-then-matmul.
#[allow(clippy::too_many_arguments)]
fn check_quantized_x(label: &str, y: &[f32], r: &[f32], x: &[f32], w: &[f32], t: usize, cout: usize, cin: usize) {
    for tt in 0..t {
        let xr = &x[tt * cin..(tt + 1) * cin];
        let xmax = xr.iter().fold(0f32, |a, v| a.max(v.abs()));
        for o in 0..cout {
            let wr = &w[o * cin..(o + 1) * cin];
            let l1: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            let wl1: f32 = wr.iter().map(|v| v.abs()).sum();
            let (a, b) = (y[tt * cout + o], r[tt * cout + o]);
            // The two-plane bound with the pair layout's smaller code range (±32639), which also
            // covers the plain one (±32767).
            let tol = wl1 * xmax / (65278.0 * 126.0) * 1.01 + 1e-6 * (l1 + b.abs()) + 1e-30;
            assert!((a - b).abs() <= tol, "{label} t={tt} o={o}: {a} vs {b} (tol {tol})");
        }
    }
}

fn run_all(label: &str, p: &PackedMatrix, w: &[f32], rng: &mut Rng) {
    let (cout, cin) = (p.cout, p.cin);
    for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40] {
        let x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
        let r = matmul_ref(&x, t, w, cout, cin);
        let mut ys = vec![f32::NAN; t * cout];
        p.matmul_with(Backend::Scalar, &x, t, &mut ys);
        if p.is_int_dot() {
            check_quantized_x(&format!("{label} scalar vs dense"), &ys, &r, &x, w, t, cout, cin);
        } else {
            check(&format!("{label} scalar vs dense"), &ys, &r, &x, w, t, cout, cin);
        }
        let best = Backend::best();
        if best != Backend::Scalar {
            let mut ya = vec![f32::NAN; t * cout];
            p.matmul_with(best, &x, t, &mut ya);
            if p.is_int_dot() && t < intdot::GEMM_MIN_T {
                // Exact integer block sums and one shared f32 step: identical bits.
                for (i, (a, b)) in ya.iter().zip(&ys).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{label} t={t} {best:?} vs scalar, value {i}: {a} vs {b}");
                }
            } else {
                check(&format!("{label} {best:?} vs scalar"), &ya, &ys, &x, w, t, cout, cin);
            }
        }
    }
}

#[test]
fn lut_kernels_match_scalar_reference_and_dense() {
    let _switches = switches();
    let mut rng = Rng(42);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        for (cout, cin) in SHAPES {
            let m = random_lut(format, cout, cin, &mut rng);
            m.validate().unwrap();
            let p = PackedMatrix::from_lut(&m);
            assert!(!p.is_int_dot());
            run_all(&format!("{format:?} {cout}x{cin}"), &p, &m.reconstruct(), &mut rng);
        }
    }
}

#[test]
fn int8_kernels_match_scalar_reference_and_dense() {
    let _switches = switches();
    let mut rng = Rng(7);
    for (cout, cin) in SHAPES.into_iter().chain([(3, 11), (1, 1), (7, 1500)]) {
        let m = random_int8(cout, cin, &mut rng);
        let w = m.reconstruct();
        run_all(&format!("int8 {cout}x{cin}"), &PackedMatrix::from_int8(&m), &w, &mut rng);
        run_all(&format!("int8 tiles {cout}x{cin}"), &PackedMatrix::tiles_from_int8(&m), &w, &mut rng);
    }
}

#[test]
fn integer_dot_kernels_match_scalar_reference_and_dense() {
    let _switches = switches();
    let mut rng = Rng(11);
    // Ragged edges in both dimensions, and inputs spanning several activation blocks.
    let shapes =
        SHAPES.into_iter().chain([(64, 128), (34, 300), (6, 1000), (10, 1100), (4, 2048), (6, 2080), (18, 4200)]);
    for (cout, cin) in shapes {
        for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
            let m = random_lut_int(format, cout, cin, &mut rng);
            m.validate().unwrap();
            let p = PackedMatrix::from_lut(&m);
            assert!(p.is_int_dot(), "{format:?} with an 8-bit codebook");
            let w = m.reconstruct();
            run_all(&format!("{format:?} int {cout}x{cin}"), &p, &w, &mut rng);
            // The float tile kernels on the same matrix agree too.
            run_all(&format!("{format:?} tiles {cout}x{cin}"), &PackedMatrix::tiles_from_lut(&m), &w, &mut rng);
        }
    }
}

#[test]
fn integer_codebooks_are_recognised_exactly() {
    let _switches = switches();
    use intdot::int8_codebook;
    let (f, q) = int8_codebook(&[0.5, -1.0, 0.25, 0.0]).unwrap();
    assert_eq!(f, 2f32.powi(-7));
    assert_eq!(q, vec![64, -128, 32, 0]);
    let (f, q) = int8_codebook(&[127.0, -3.0]).unwrap();
    assert_eq!((f, q), (1.0, vec![127, -3]));
    assert_eq!(int8_codebook(&[254.0, 2.0]).unwrap(), (2.0, vec![127, 1]));
    // 1/3 is no multiple of a power of two that keeps the largest value within 8 bits.
    assert!(int8_codebook(&[1.0, 1.0 / 3.0]).is_none());
    assert!(int8_codebook(&[255.0, 1.0]).is_none());
    assert!(int8_codebook(&[f32::NAN]).is_none());
}

#[test]
fn integer_dot_propagates_non_finite_inputs() {
    let _switches = switches();
    let mut rng = Rng(5);
    let m = random_lut_int(Format::Lut4, 16, 200, &mut rng);
    let p = PackedMatrix::from_lut(&m);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x: Vec<f32> = (0..200).map(|_| rng.f()).collect();
        x[150] = bad;
        for backend in [Backend::Scalar, Backend::best()] {
            let mut y = vec![0f32; 16];
            p.matmul_with(backend, &x, 1, &mut y);
            assert!(y.iter().all(|v| v.is_nan()), "{backend:?} {bad}: {y:?}");
        }
    }
}

#[test]
fn extreme_indices_and_int8_values_decode() {
    let _switches = switches();
    // Every index value (incl. the top entry whose bit 3 drives the blend) and ±127/-128.
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        let (d, k) = (format.vec_dim(), format.entries());
        let (cout, cin) = (16 * d, 2 * k);
        let m = LutMatrix {
            format,
            cout,
            cin,
            codebook: (0..k * d).map(|i| (i + 1) as f32 - (k * d / 2) as f32).collect(),
            idx: (0..cout / d * cin).map(|i| ((i * 5 + i / cin) % k) as u8).collect(),
            scale: vec![1.0; cout],
        };
        let p = PackedMatrix::tiles_from_lut(&m);
        let w = m.reconstruct();
        let dot = PackedMatrix::from_lut(&m);
        assert!(dot.is_int_dot(), "{format:?}");
        for j in 0..cin {
            let mut x = vec![0f32; cin];
            x[j] = 1.0;
            for backend in [Backend::Scalar, Backend::best()] {
                let mut y = vec![0f32; cout];
                p.matmul_with(backend, &x, 1, &mut y);
                let col: Vec<f32> = (0..cout).map(|o| w[o * cin + j]).collect();
                assert_eq!(y, col, "{format:?} {backend:?} column {j}");
                // One-hot inputs are quantized exactly; only the f32 scale product rounds.
                dot.matmul_with(backend, &x, 1, &mut y);
                for (a, b) in y.iter().zip(&col) {
                    assert!((a - b).abs() <= 1e-6 * b.abs(), "{format:?} {backend:?} int column {j}: {a} vs {b}");
                }
            }
        }
    }
    let q: Vec<i8> = (0..8 * 4).map(|i| [-128i8, -127, 127, -1, 0, 1][i % 6]).collect();
    let m = Int8Matrix { cout: 8, cin: 4, q, scale: vec![1.0; 8] };
    let w = m.reconstruct();
    for p in [PackedMatrix::tiles_from_int8(&m), PackedMatrix::from_int8(&m)] {
        for j in 0..4 {
            let mut x = vec![0f32; 4];
            x[j] = 1.0;
            for backend in [Backend::Scalar, Backend::best()] {
                let mut y = vec![0f32; 8];
                p.matmul_with(backend, &x, 1, &mut y);
                for (o, &v) in y.iter().enumerate() {
                    let e = w[o * 4 + j];
                    assert!((v - e).abs() <= 1e-6 * e.abs(), "int8 {backend:?} column {j}: {v} vs {e}");
                }
            }
        }
    }
}

#[test]
fn integer_sums_are_exact_at_the_extremes() {
    let _switches = switches();
    // The largest weights against the largest activation codes over whole blocks: each lane
    // then sums 256 products of 255 · 32767 (unsigned weights; 255 · 32639 in the 512-bit
    // decode's layout), the most a block can hold. All inputs equal, so the result is known in
    // closed form: a lane that overflowed would be off by 2³² times the scale, not by the one
    // rounding of the final f32 steps allowed here.
    for cin in [intdot::XBLOCK, intdot::XBLOCK + 96, 2 * intdot::XBLOCK] {
        for (wv, xv) in [(127i8, 1f32), (-128, 1.0), (127, -1.0), (-128, -1.0)] {
            let m = Int8Matrix { cout: 9, cin, q: vec![wv; 9 * cin], scale: vec![1.0; 9] };
            let p = PackedMatrix::from_int8(&m);
            let x = vec![xv; cin];
            let want = wv as f32 * xv * cin as f32;
            for backend in [Backend::Scalar, Backend::best()] {
                let mut y = vec![0f32; 9];
                p.matmul_with(backend, &x, 1, &mut y);
                assert!(
                    y.iter().all(|&v| (v - want).abs() <= 2e-7 * want.abs()),
                    "{backend:?} w={wv} x={xv} cin={cin}: {y:?} vs {want}"
                );
            }
        }
    }
}

#[test]
fn second_plane_sums_are_exact_at_the_extremes() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the 512-bit decode kernels' pair layout at the extremes");
    // Whole blocks of the extreme weights against the extreme second-plane codes (±63), the
    // first plane zero: each `pmaddubsw` pair then adds 2 · 255 · 63, the most it is given, and
    // the result is known in closed form.
    use intdot::{matmul_many, QuantX, CHUNK, XBLOCK};
    for cin in [XBLOCK, XBLOCK + 96, 2 * XBLOCK] {
        for (wv, code) in [(127i8, 63i8), (-128, 63), (127, -63), (-128, -63)] {
            let m = Int8Matrix { cout: 9, cin, q: vec![wv; 9 * cin], scale: vec![1.0; 9] };
            let p = PackedMatrix::from_int8(&m);
            let d = p.as_dot().unwrap();
            let nblocks = cin.div_ceil(XBLOCK);
            let cin_pad = cin.div_ceil(CHUNK) * CHUNK;
            let mut corr = vec![0i32; nblocks * 2 * 8];
            for j in 0..cin {
                // Plane 2 of block j / XBLOCK, lane (j mod 32) / 4.
                corr[(j / XBLOCK * 2 + 1) * 8 + j % CHUNK / 4] += 128 * code as i32;
            }
            // The same codes in every column: the 512-bit decode's pair layout holds the same
            // values, so both layouts are this one.
            for paired in [false, intdot::paired_kernels()] {
                let qx = QuantX {
                    t: 1,
                    planes: 2,
                    cin_pad,
                    nblocks,
                    q: vec![0; cin_pad],
                    q2: (0..cin_pad).map(|j| if j < cin { code } else { 0 }).collect(),
                    scale: (0..nblocks).flat_map(|_| [0.0, 1.0]).collect(),
                    paired,
                    qhl: if paired { vec![0; cin_pad / 64 * 128] } else { Vec::new() },
                    corr: corr.clone(),
                    ..QuantX::default()
                };
                let want = wv as f32 * code as f32 * cin as f32;
                for simd in [false, true] {
                    let mut y = vec![0f32; 9];
                    matmul_many(simd, &[d], &qx, &mut [&mut y]);
                    assert!(
                        y.iter().all(|&v| v == want),
                        "simd={simd} paired={paired} w={wv} code={code} cin={cin}: {y:?} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn many_rows_through_the_dot_kernels_equal_the_scalar_reference() {
    let _switches = switches();
    // Direct callers may pass more rows than a kernel call holds; they are split.
    use intdot::{matmul_many, QuantX};
    let mut rng = Rng(5);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x64] {
        let m = random_lut_int(format, 20, 300, &mut rng);
        let p = PackedMatrix::from_lut(&m);
        let d = p.as_dot().unwrap();
        let t = 2 * intdot::GEMM_MIN_T + 3;
        let x: Vec<f32> = (0..t * 300).map(|_| rng.f()).collect();
        let qx = QuantX::new(&x, t, 300);
        let (mut ys, mut ya) = (vec![0f32; t * 20], vec![0f32; t * 20]);
        matmul_many(false, &[d], &qx, &mut [&mut ys]);
        matmul_many(true, &[d], &qx, &mut [&mut ya]);
        assert_eq!(
            ys.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            ya.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn large_matrix_parallel_path() {
    let _switches = switches();
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
    // The same for the integer-dot layout, with enough rows for several passes.
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x64] {
        let m = random_lut_int(format, 1000, 1030, &mut rng);
        let p = PackedMatrix::from_lut(&m);
        let x: Vec<f32> = (0..9 * 1030).map(|_| rng.f()).collect();
        let mut y1 = vec![0f32; 9 * 1000];
        p.matmul(&x, 9, &mut y1);
        let mut y2 = vec![0f32; 9 * 1000];
        pool.install(|| p.matmul(&x, 9, &mut y2));
        assert_eq!(y1, y2);
        let w = m.reconstruct();
        check_quantized_x("int 1000x1030", &y1, &matmul_ref(&x, 9, &w, 1000, 1030), &x, &w, 9, 1000, 1030);
    }
}

#[test]
fn packed_layouts_decode_to_the_stored_weights_exactly() {
    let _switches = switches();
    use crate::matmul::RowSource;
    let mut rng = Rng(21);
    for (cout, cin) in [(16, 40), (34, 300)] {
        for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
            let m = random_lut_int(format, cout, cin, &mut rng);
            let w = m.reconstruct();
            for p in [PackedMatrix::from_lut(&m), PackedMatrix::tiles_from_lut(&m)] {
                let mut got = vec![f32::NAN; cout * cin];
                p.decode(0, cout, &mut got);
                assert_eq!(got, w, "{format:?} {cout}x{cin} int-dot={}", p.is_int_dot());
                // A row range that starts mid-pair.
                let mut part = vec![0f32; 3 * cin];
                p.decode(5, 3, &mut part);
                assert_eq!(part[..], w[5 * cin..8 * cin]);
            }
        }
        let m = random_int8(cout, cin, &mut rng);
        for p in [PackedMatrix::from_int8(&m), PackedMatrix::tiles_from_int8(&m)] {
            let mut got = vec![0f32; cout * cin];
            p.decode(0, cout, &mut got);
            assert_eq!(got, m.reconstruct());
        }
    }
}

#[test]
fn integer_dot_parts_round_trip_through_shared_memory() {
    let _switches = switches();
    // As a compiled cache stores and maps them: the layout rebuilt from what the cache records
    // (kind, shape, whether it holds the AVX-512 layouts), on rows of 19 chunks (whole groups
    // of every kind's AVX-512 layout, a pair and a chunk after them).
    use intdot::{six_bit_layout, Blob, DotLayout, DotMatrix};
    let mut rng = Rng(8);
    let (cout, cin) = (34, 600);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        let m = random_lut_int(format, cout, cin, &mut rng);
        let p = PackedMatrix::from_lut(&m);
        let d = p.as_dot().unwrap();
        let (layout, data, tables, scale) = d.parts();
        let cached = DotLayout::cached(&layout.kind, layout.cout, layout.cin, six_bit_layout());
        assert_eq!(cached, layout, "{format:?}: the layout a cache reads back");
        let src: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> =
            std::sync::Arc::new([vec![7u8; 5], data.to_vec()].concat());
        let blob = Blob::Shared { src: src.clone(), offset: 5, len: data.len() };
        let back =
            PackedMatrix::from_dot(format, DotMatrix::from_parts(&cached, blob, &tables, scale.to_vec()).unwrap());
        let x: Vec<f32> = (0..2 * cin).map(|_| rng.f()).collect();
        let (mut y1, mut y2) = (vec![0f32; 2 * cout], vec![0f32; 2 * cout]);
        p.matmul(&x, 2, &mut y1);
        back.matmul(&x, 2, &mut y2);
        assert_eq!(y1, y2, "{format:?}");
        // Sizes are checked against the layout.
        let short = Blob::Shared { src, offset: 5, len: data.len() - 1 };
        let err = DotMatrix::from_parts(&layout, short, &tables, scale.to_vec()).unwrap_err().to_string();
        assert!(err.contains("index data"), "{err}");
        assert!(DotMatrix::from_parts(&layout, Blob::Owned(data.to_vec()), &tables[1..], scale.to_vec()).is_err());
        let mut bad = layout.clone();
        bad.kind = "lut5".into();
        assert!(DotMatrix::from_parts(&bad, Blob::Owned(data.to_vec()), &tables, scale.to_vec()).is_err());
    }
}

#[test]
fn one_activation_plane_matches_scalar_and_the_16_bit_bound() {
    let _switches = switches();
    use intdot::{matmul_many, QuantX};
    let mut rng = Rng(31);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64] {
        for (cout, cin) in [(34, 300), (64, 1100)] {
            let m = random_lut_int(format, cout, cin, &mut rng);
            let p = PackedMatrix::from_lut(&m);
            let d = p.as_dot().unwrap();
            let w = m.reconstruct();
            for t in [1, 3, 5] {
                let x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
                let qx = QuantX::with_planes(&x, t, cin, 1);
                let (mut ys, mut ya) = (vec![0f32; t * cout], vec![0f32; t * cout]);
                matmul_many(false, &[d], &qx, &mut [&mut ys]);
                matmul_many(true, &[d], &qx, &mut [&mut ya]);
                check(&format!("{format:?} 1 plane avx2 vs scalar"), &ya, &ys, &x, &w, t, cout, cin);
                // One plane: |x − x̂| ≤ max|x| / 65534 per element.
                let r = matmul_ref(&x, t, &w, cout, cin);
                for tt in 0..t {
                    let xmax = x[tt * cin..(tt + 1) * cin].iter().fold(0f32, |a, v| a.max(v.abs()));
                    for o in 0..cout {
                        let wl1: f32 = w[o * cin..(o + 1) * cin].iter().map(|v| v.abs()).sum();
                        let tol = wl1 * xmax / 65534.0 * 1.01 + 1e-4;
                        let (a, b) = (ys[tt * cout + o], r[tt * cout + o]);
                        assert!((a - b).abs() <= tol, "{format:?} t={tt} o={o}: {a} vs {b} (tol {tol})");
                    }
                }
            }
        }
    }
}

#[test]
fn simd_decode_equals_scalar_decode() {
    let _switches = switches();
    let mut rng = Rng(23);
    for (cout, cin) in [(2, 1), (6, 33), (16, 64), (10, 100), (34, 300)] {
        let mut mats: Vec<intdot::DotMatrix> =
            [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64]
                .into_iter()
                .map(|f| intdot::DotMatrix::from_lut(&random_lut_int(f, cout, cin, &mut rng)).unwrap())
                .collect();
        mats.push(intdot::DotMatrix::from_int8(&random_int8(cout, cin, &mut rng)));
        for m in &mats {
            for (r0, n) in [(0, cout), (cout - 2, 2)] {
                let mut a = vec![f32::NAN; n * cin];
                let mut b = vec![f32::NAN; n * cin];
                m.decode_rows(r0, n, &mut a);
                m.decode_rows_with(true, r0, n, &mut b);
                assert_eq!(a, b, "{cout}x{cin} rows {r0}+{n}");
            }
        }
    }
}

#[test]
fn simd_activation_quantization_equals_scalar() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the quantizer's pair layout for the 512-bit decode");
    use intdot::QuantX;
    let mut rng = Rng(29);
    for (t, cin) in [(1, 1), (1, 31), (2, 576), (3, 1536), (1, 2100), (2, 4200)] {
        for planes in [1, 2] {
            let mut x: Vec<f32> = (0..t * cin).map(|i| rng.f() * if i % 97 == 0 { 300.0 } else { 1.0 }).collect();
            if cin > 1000 {
                x[5] = f32::NAN; // a non-finite block, and finite ones after it
            }
            let a = QuantX::with_planes(&x, t, cin, planes);
            // The same layout through the portable code (the pair layout of the 512-bit decode
            // where `a` took it).
            let b = if a.paired {
                QuantX::paired(&x, t, cin, planes)
            } else {
                QuantX::with_planes_scalar(&x, t, cin, planes)
            };
            assert_eq!(a.q, b.q, "codes t={t} cin={cin} planes={planes}");
            assert_eq!(a.q2, b.q2, "second-plane codes t={t} cin={cin} planes={planes}");
            assert_eq!(a.qhl, b.qhl, "code bytes t={t} cin={cin} planes={planes}");
            assert!(a.q2.iter().all(|&v| (-63..=63).contains(&v)), "second-plane range");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.scale), bits(&b.scale), "scales t={t} cin={cin} planes={planes}");
            assert_eq!(a.corr, b.corr, "corrections t={t} cin={cin} planes={planes}");
        }
    }
}

#[test]
fn requantizing_into_kept_buffers_equals_a_fresh_quantization() {
    let _switches = switches();
    // The kept buffers are sized, not cleared: whatever a larger, denser earlier call left in
    // them, zero blocks, zero residuals, one plane and the padding past the input must still
    // come out as zero codes.
    use intdot::QuantX;
    let mut rng = Rng(41);
    let dense: Vec<f32> = (0..3 * 4200).map(|_| rng.f() * 9.0).collect();
    let mut kept = QuantX::default();
    for (t, cin, planes) in [(1, 576, 2), (2, 4200, 2), (1, 1531, 1), (1, 2100, 2), (2, 33, 2)] {
        let mut x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
        if cin > 2048 {
            x[..2048].fill(0.0); // a zero block
            x[2048..2048 + 32].fill(0.5); // codes with no residual (0.5 is exact)
        }
        for planes_now in [planes, 3 - planes] {
            let fresh = QuantX::with_planes(&x, t, cin, planes_now);
            kept.fill_with_planes(&dense, 3, 4200, 2);
            kept.fill_with_planes(&x, t, cin, planes_now);
            assert_eq!(kept.q, fresh.q, "codes t={t} cin={cin} planes={planes_now}");
            assert_eq!(kept.q2, fresh.q2, "second-plane codes t={t} cin={cin} planes={planes_now}");
            assert_eq!(kept.corr, fresh.corr, "corrections t={t} cin={cin} planes={planes_now}");
            assert_eq!(kept.qhl, fresh.qhl, "code bytes t={t} cin={cin} planes={planes_now}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&kept.scale), bits(&fresh.scale), "scales t={t} cin={cin} planes={planes_now}");
        }
    }
}

#[test]
fn pair_layout_bytes_rebuild_the_codes() {
    let _switches = switches();
    // The 512-bit decode's pair layout: `h, l` bytes of each 16-bit code (256·h + l, l in
    // ±128, h in ±127), 16 columns of A, 16 of B, then the rest of each; the second plane in the
    // same order; a last chunk without a partner left plain.
    use intdot::{QuantX, CHUNK};
    let mut rng = Rng(37);
    for cin in [1, 64, 77, 576, 2048 + 40] {
        let mut x: Vec<f32> = (0..cin).map(|_| rng.f()).collect();
        x[cin / 2] = 5.0; // the block's largest magnitude: the code at the limit
        let qp = QuantX::paired(&x, 1, cin, 2);
        let plain = QuantX::with_planes_scalar(&x, 1, cin, 2);
        let pairs = qp.cin_pad / (2 * CHUNK);
        assert_eq!(qp.qhl.len(), pairs * 4 * CHUNK);
        assert!(qp.q.iter().all(|&v| (-32639..=32639).contains(&v)), "codes within the pair layout's range");
        for p in 0..pairs {
            for k in 0..2 * CHUNK {
                let (c, m) = (2 * p + (k / 16) % 2, (k / 32) * 16 + k % 16);
                let (h, l) = (qp.qhl[p * 4 * CHUNK + k] as i32, qp.qhl[p * 4 * CHUNK + 2 * CHUNK + k] as i32);
                let (q1, q2) = qp.chunk(0, c);
                let pos = if m / 8 == 1 {
                    m + 8
                } else if m / 8 == 2 {
                    m - 8
                } else {
                    m
                };
                assert_eq!(256 * h + l, q1[pos] as i32, "cin={cin} pair {p} byte {k}");
                assert_eq!(qp.q2[p * 2 * CHUNK + k], q2[m], "cin={cin} pair {p} byte {k}");
            }
        }
        // Different code ranges, each within its two-plane bound of the input.
        for c in 0..qp.cin_pad / CHUNK {
            let ((a1, a2), (b1, b2)) = (qp.chunk(0, c), plain.chunk(0, c));
            for m in 0..CHUNK {
                // Column m: the 16-bit code at position xpos(m), the second-plane code at m.
                let pos = if m / 8 == 1 {
                    m + 8
                } else if m / 8 == 2 {
                    m - 8
                } else {
                    m
                };
                let b = c * CHUNK / intdot::XBLOCK;
                let va = a1[pos] as f32 * qp.scale[2 * b] + a2[m] as f32 * qp.scale[2 * b + 1];
                let vb = b1[pos] as f32 * plain.scale[2 * b] + b2[m] as f32 * plain.scale[2 * b + 1];
                let xv = x.get(c * CHUNK + m).copied().unwrap_or(0.0);
                // The two-plane bound, max|x| / (2 · XMAX · 126), with XMAX 32639 and 32767.
                assert!((va - xv).abs() <= 5.0 / (65278.0 * 126.0) * 1.01, "cin={cin} chunk {c}: {va} vs {xv}");
                assert!((vb - xv).abs() <= 5.0 / (65534.0 * 126.0) * 1.01, "cin={cin} chunk {c}: {vb} vs {xv}");
            }
        }
    }
}

#[test]
fn avx512_and_avx2_kernels_equal_the_scalar_reference() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the AVX-512 and 512-bit decode kernels (the AVX2 ones were)");
    // The AVX-512 variants (VNNI multiply-accumulates; for vec2x64 one `vpermi2b` per 64-entry
    // table) and the AVX2 kernels: both must give the scalar reference's bits for every format,
    // at decode (T = 1, one and two planes) and verify (T = 3 and 5) sizes, on ragged shapes
    // with every index value. Each packs the matrix as it would (vec2x64: the six-bit layout
    // with AVX-512, the nibble layout without), and the reference gives the same bits on both
    // layouts. Where the CPU lacks the AVX-512 subsets both runs take the AVX2 path.
    use intdot::{matmul_many, set_avx512, QuantX};
    let mut rng = Rng(11);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        // Chunks: 1 (no pair), 3 (a pair and one left over), 66 (a full block, then a pair),
        // 65 (a full block, then one left over), 18, 75 (a full block, then lut2's and
        // vec2x64's group of eight, a pair and one left over), 86 (a full block of four lut3
        // groups of sixteen, then one, three pairs).
        for &(cout, cin) in
            &[(2, 32), (18, 77), (64, 2048 + 40), (20, 2048 + 10), (130, 576), (6, 2048 + 340), (10, 2048 + 700)]
        {
            let (int8, lut) = if format == Format::Int8 {
                (Some(random_int8(cout, cin, &mut rng)), None)
            } else {
                let mut m = random_lut_int(format, cout, cin, &mut rng);
                let k = format.entries();
                let mut idx = m.idx.to_vec();
                for (i, v) in idx.iter_mut().enumerate().take(k) {
                    *v = i as u8;
                }
                m.idx = idx.into();
                (None, Some(m))
            };
            let w = int8.as_ref().map_or_else(|| lut.as_ref().unwrap().reconstruct(), |m| m.reconstruct());
            // Packed with the AVX-512 kernels off, then on.
            let packs: Vec<PackedMatrix> = [false, true]
                .into_iter()
                .map(|avx512| {
                    set_avx512(avx512);
                    let p = int8
                        .as_ref()
                        .map_or_else(|| PackedMatrix::from_lut(lut.as_ref().unwrap()), PackedMatrix::from_int8);
                    set_avx512(true);
                    p
                })
                .collect();
            for (t, planes) in [(1, 2), (1, 1), (3, 2), (5, 2), (5, 1), (70, 2)] {
                let x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
                let qx = QuantX::with_planes_scalar(&x, t, cin, planes);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let scalar = |d: &intdot::DotMatrix, qx: &QuantX| {
                    let mut y = vec![0f32; t * cout];
                    matmul_many(false, &[d], qx, &mut [&mut y]);
                    y
                };
                let want = scalar(packs[0].as_dot().unwrap(), &qx);
                let want_six = scalar(packs[1].as_dot().unwrap(), &qx);
                assert_eq!(bits(&want_six), bits(&want), "{format:?} {cout}x{cin}: the reference on both layouts");
                for (avx512, p) in [false, true].into_iter().zip(&packs) {
                    set_avx512(avx512);
                    let mut y = vec![0f32; t * cout];
                    matmul_many(true, &[p.as_dot().unwrap()], &qx, &mut [&mut y]);
                    set_avx512(true);
                    assert_eq!(bits(&y), bits(&want), "{format:?} {cout}x{cin} t={t} planes={planes} avx512={avx512}");
                }
                // Both layouts through the 512-bit kernels (the nibble layout there only when
                // packed with AVX-512 off).
                for d in packs.iter().filter(|_| intdot::paired_kernels()).map(|p| p.as_dot().unwrap()) {
                    // Activations in the pair layout (aarch64: the dot-product kernel): the kernels
                    // and the scalar reference reading that layout (its codes use a slightly
                    // smaller range: its own reference, and dequantize-then-matmul within the
                    // activation bound).
                    let qp = QuantX::paired(&x, t, cin, planes);
                    let mut want_p = vec![0f32; t * cout];
                    matmul_many(false, &[d], &qp, &mut [&mut want_p]);
                    let mut y = vec![0f32; t * cout];
                    matmul_many(true, &[d], &qp, &mut [&mut y]);
                    assert_eq!(bits(&y), bits(&want_p), "{format:?} {cout}x{cin} paired planes={planes}");
                    // Two planes (one plane: its own 16-bit bound, checked for the plain layout
                    // elsewhere).
                    if planes == 2 {
                        let r = matmul_ref(&x, t, &w, cout, cin);
                        check_quantized_x(
                            &format!("{format:?} {cout}x{cin} paired"),
                            &want_p,
                            &r,
                            &x,
                            &w,
                            t,
                            cout,
                            cin,
                        );
                    }
                }
            }
        }
    }
    eprintln!("integer kernels on this CPU: {}", intdot::isa());
}

#[test]
fn tasks_from_memory_equal_the_scalar_reference() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the 512-bit decode's streamed tasks");
    // Tasks of 1 MiB and more read their rows as two or four streams from parts of the task
    // in the 512-bit decode, the rows left over side by side: every kind must give the
    // reference's bits at one thread (one task) and two (tasks of 70, 20 and 10 % of a share),
    // on row counts that leave rows over, short rows and long ones (which ask whole rows ahead),
    // and stay within the activation bound of dense f32.
    use intdot::{matmul_many, QuantX};
    let mut rng = Rng(29);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        for (cout, cin) in [(3002, 4096), (522, 17408 + 96)] {
            let (p, w) = if format == Format::Int8 {
                let m = random_int8(cout, cin, &mut rng);
                (PackedMatrix::from_int8(&m), m.reconstruct())
            } else {
                let m = random_lut_int(format, cout, cin, &mut rng);
                (PackedMatrix::from_lut(&m), m.reconstruct())
            };
            let d = p.as_dot().unwrap();
            assert!(d.packed_bytes() > 2 << 20, "{format:?} {cout}x{cin}: {} bytes", d.packed_bytes());
            let x: Vec<f32> = (0..cin).map(|_| rng.f()).collect();
            let qx = QuantX::with_planes(&x, 1, cin, 2);
            let mut want = vec![0f32; cout];
            matmul_many(false, &[d], &qx, &mut [&mut want]);
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut y = vec![f32::NAN; cout];
                pool.install(|| matmul_many(true, &[d], &qx, &mut [&mut y]));
                let first = bits(&y).iter().zip(bits(&want)).position(|(a, b)| *a != b);
                assert!(first.is_none(), "{format:?} {cout}x{cin}, {threads} thread(s): output {first:?} differs");
            }
            let label = format!("{format:?} {cout}x{cin} from memory");
            check_quantized_x(&label, &want, &matmul_ref(&x, 1, &w, cout, cin), &x, &w, 1, cout, cin);
        }
    }
}

#[test]
fn prefill_tiles_on_avx512_and_avx2_match_the_reference() {
    let _switches = switches();
    crate::testutil::avx512f("the 16-wide prefill tiles (the 8-wide ones were)");
    // Prefill (T ≥ GEMM_MIN_T) decodes weights to f32 and runs FMA tiles, 16 wide where the
    // CPU has AVX-512 F and 8 wide on AVX2: both within f32 rounding of dequantize-then-matmul
    // on ragged shapes (tails of the 16- and 8-wide steps, partial tiles of rows and columns).
    use intdot::{gemm_many, set_avx512, GEMM_MIN_T};
    let mut rng = Rng(13);
    // T = 16, 17, 35, 70 and 131: partial vectors of the 64-row activation tiles, and more than
    // one of them; 14, 30, 130 and 262
    // outputs: partial 6-row weight tiles (whole row pairs for vec2x64).
    for (format, &(cout, cin)) in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x64]
        .into_iter()
        .flat_map(|f| [(2, 1), (14, 5), (30, 37), (130, 70), (262, 129), (64, 2048 + 40)].iter().map(move |s| (f, s)))
    {
        let m = random_lut_int(format, cout, cin, &mut rng);
        let w = m.reconstruct();
        for t in [GEMM_MIN_T, GEMM_MIN_T + 1, 2 * GEMM_MIN_T + 3, 70, 131] {
            let x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
            let r = matmul_ref(&x, t, &w, cout, cin);
            for avx512 in [false, true] {
                // Packed as this setting packs (vec2x64: nibble or six-bit layout).
                set_avx512(avx512);
                let d = intdot::DotMatrix::from_lut(&m).unwrap();
                let mut y = vec![f32::NAN; t * cout];
                gemm_many(true, &[&d], &x, t, &mut [&mut y]);
                set_avx512(true);
                check(&format!("{format:?} {cout}x{cin} t={t} avx512={avx512}"), &y, &r, &x, &w, t, cout, cin);
            }
        }
    }
}

#[test]
fn shared_calls_cut_into_guided_tasks_cover_every_row_once() {
    let _switches = switches();
    // Three matrices sharing an input, big enough to be cut into tasks of falling size across
    // matrix boundaries, on pools of 1–3 threads (with and without the spinning team): every
    // output row is written (they start as NaN) with the bits of the one-thread call.
    use intdot::{matmul_many, QuantX};
    let mut rng = Rng(17);
    let ms: Vec<PackedMatrix> = [(402, 576), (74, 576), (530, 576)]
        .iter()
        .map(|&(o, i)| PackedMatrix::from_lut(&random_lut_int(Format::Vec2x64, o, i, &mut rng)))
        .collect();
    let ds: Vec<_> = ms.iter().map(|p| p.as_dot().unwrap()).collect();
    for t in [1usize, 3] {
        let x: Vec<f32> = (0..t * 576).map(|_| rng.f()).collect();
        let qx = QuantX::new(&x, t, 576);
        let run = |threads: usize, team: bool| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut ys: Vec<Vec<f32>> = ds.iter().map(|d| vec![f32::NAN; t * d.cout]).collect();
                let mut call = || {
                    let mut refs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
                    matmul_many(true, &ds, &qx, &mut refs);
                };
                if team {
                    crate::team::with_team(call)
                } else {
                    call()
                }
                ys
            })
        };
        let want = run(1, false);
        assert!(want.iter().flatten().all(|v| v.is_finite()));
        for (threads, team) in [(2, false), (2, true), (3, true)] {
            let got = run(threads, team);
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(
                    g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "t={t} threads={threads} team={team}"
                );
            }
        }
    }
}

#[test]
fn integer_prefill_equals_its_scalar_reference_and_dense() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the byte-plane prefill kernels (their scalar reference was)");
    // The byte-plane prefill: the AVX-512 kernels (where the CPU has them) give the scalar
    // reference's bits, and the reference is within the activations' three-plane bound of
    // dequantize-then-matmul. Ragged panels (outputs not a multiple of 16), ragged tiles of rows
    // (T not a multiple of 8), padded inputs, several blocks (cin > 2048), every format and both
    // vec2x64 layouts, matrices sharing one input.
    use intdot::prefill::gemm_many_int;
    use intdot::set_avx512;
    let mut rng = Rng(17);
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        for &(cout, cin) in &[(2, 1), (18, 37), (64, 576), (34, 2100), (16, 4200)] {
            for avx512 in [true, false] {
                set_avx512(avx512);
                let (d, w) = if format == Format::Int8 {
                    let m = random_int8(cout, cin, &mut rng);
                    (intdot::DotMatrix::from_int8(&m), m.reconstruct())
                } else {
                    let m = random_lut_int(format, cout, cin, &mut rng);
                    (intdot::DotMatrix::from_lut(&m).unwrap(), m.reconstruct())
                };
                set_avx512(true);
                let d2 = intdot::DotMatrix::from_int8(&random_int8(10, cin, &mut rng));
                let w2 = {
                    let mut v = vec![0f32; 10 * cin];
                    d2.decode_rows(0, 10, &mut v);
                    v
                };
                for t in [1, 8, 17, 21] {
                    let mut x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
                    // An outlier in the first row, to give its block a coarse scale.
                    x[0] = 40.0;
                    let label = format!("{format:?} {cout}x{cin} t={t} avx512={avx512}");
                    let (mut ys, mut ys2) = (vec![f32::NAN; t * cout], vec![f32::NAN; t * 10]);
                    assert!(gemm_many_int(false, &[&d, &d2], &x, t, &mut [&mut ys, &mut ys2]));
                    check_quantized_x(
                        &format!("{label} scalar vs dense"),
                        &ys,
                        &matmul_ref(&x, t, &w, cout, cin),
                        &x,
                        &w,
                        t,
                        cout,
                        cin,
                    );
                    check_quantized_x(
                        &format!("{label} second"),
                        &ys2,
                        &matmul_ref(&x, t, &w2, 10, cin),
                        &x,
                        &w2,
                        t,
                        10,
                        cin,
                    );
                    let (mut ya, mut ya2) = (vec![f32::NAN; t * cout], vec![f32::NAN; t * 10]);
                    assert!(gemm_many_int(true, &[&d, &d2], &x, t, &mut [&mut ya, &mut ya2]));
                    for (i, (a, b)) in ya.iter().chain(&ya2).zip(ys.iter().chain(&ys2)).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{label} simd vs scalar, value {i}: {a} vs {b}");
                    }
                }
                // A non-finite activation: nothing is claimed, the caller multiplies in f32.
                let mut x: Vec<f32> = (0..2 * cin).map(|_| rng.f()).collect();
                x[cin] = f32::NAN;
                let mut y = vec![0f32; 2 * cout];
                assert!(!gemm_many_int(true, &[&d], &x, 2, &mut [&mut y]));
            }
        }
    }
}

#[test]
fn integer_prefill_planes_on_avx512_equal_the_scalar_code_and_rebuild_the_input() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the AVX-512 byte-plane quantizer (its scalar code was)");
    // The AVX-512 quantizer gives the scalar code's planes and blocks, and the planes rebuild
    // each value within its block's bound: |x − s₁·(256h + l) − s₂·q₂| ≤ max|x| / (32639 · 254),
    // half for the second plane's rounding and half for the f32 residual `x − s₁·q₁`. Widths with tails of the 16-wide
    // steps and several blocks; rows with an outlier, with zeros, with huge and tiny values.
    use intdot::prefill::PlaneX;
    let mut rng = Rng(19);
    for &cin in &[1usize, 15, 37, 576, 2048, 2049, 4200] {
        let cin_pad = cin.div_ceil(32) * 32;
        let t = 5;
        let mut x: Vec<f32> = (0..t * cin).map(|_| rng.f()).collect();
        x[0] = 300.0;
        x[cin..2 * cin].fill(0.0);
        // Huge, within the 2⁶⁴ (1.8e19) the planes take.
        x[2 * cin..3 * cin].iter_mut().for_each(|v| *v *= 1e19);
        x[3 * cin..4 * cin].iter_mut().for_each(|v| *v *= 1e-25);
        let (mut a, mut b) = (PlaneX::default(), PlaneX::default());
        assert!(a.fill(false, &x, t, cin, cin_pad));
        assert!(b.fill(true, &x, t, cin, cin_pad));
        assert_eq!(a.x, b.x, "cin {cin}: planes");
        assert_eq!(a.blocks, b.blocks, "cin {cin}: scales and corrections");
        let nb = a.nblocks;
        for r in 0..t {
            let p = &a.x[r * 3 * cin_pad..(r + 1) * 3 * cin_pad];
            for c in 0..cin_pad {
                let blk = a.blocks[r * nb + c / 2048];
                let (h, l, q) = (p[c] as f32, p[cin_pad + c] as f32, p[2 * cin_pad + c] as f32);
                // Rebuilt in f64, so that only the quantization's own error counts.
                let back = blk.s[0] as f64 * h as f64 + blk.s[1] as f64 * l as f64 + blk.s[2] as f64 * q as f64;
                let v = if c < cin { x[r * cin + c] as f64 } else { 0.0 };
                let (b0, b1) = ((c / 2048) * 2048, ((c / 2048 + 1) * 2048).min(cin));
                let m = x[r * cin..(r + 1) * cin]
                    .get(b0..b1)
                    .unwrap_or(&[])
                    .iter()
                    .fold(0f64, |a, v| a.max(v.abs() as f64));
                assert!((back - v).abs() <= m / (32639.0 * 254.0) * 1.01, "cin {cin} row {r} col {c}: {back} vs {v}");
            }
            for (bi, blk) in a.blocks[r * nb..(r + 1) * nb].iter().enumerate() {
                let cols = bi * 2048..((bi + 1) * 2048).min(cin_pad);
                for (pl, &corr) in blk.corr.iter().enumerate() {
                    let s: i32 = p[pl * cin_pad..][cols.clone()].iter().map(|&c| c as i32).sum();
                    assert_eq!(corr, 128 * s, "cin {cin} row {r} block {bi} plane {pl}");
                }
            }
        }
        // A non-finite value, or a block too small to scale or too large for f32 block sums,
        // refuses the planes.
        for bad in [f32::NAN, f32::INFINITY, 1e-36, 1e20] {
            let mut y = x.clone();
            y[cin..2 * cin].fill(0.0);
            y[cin + cin / 2] = bad;
            assert!(!a.fill(true, &y, t, cin, cin_pad) && !a.fill(false, &y, t, cin, cin_pad), "{bad}");
        }
    }
}

/// Finite activation rows at the edges of f32, each with the weights it is multiplied by: unit
/// weights for small magnitudes, weights of about 2⁻²⁰ for large ones (so that the exact
/// products stay within f32).
fn extreme_rows(cin: usize, rng: &mut Rng) -> Vec<(&'static str, Vec<f32>, bool)> {
    let scaled = |rng: &mut Rng, s: f32| (0..cin).map(|_| rng.f() * s).collect::<Vec<f32>>();
    let lone = |v: f32| {
        let mut r = vec![0f32; cin];
        r[cin / 2] = v;
        r
    };
    let mut rows = vec![
        // Normal, but 1/scale overflows at ~1e-34.
        ("tiny", scaled(rng, 1e-34), false),
        ("tinier", scaled(rng, 1e-37), false),
        ("subnormal", scaled(rng, 1e-40), false),
        ("smallest subnormal", lone(-f32::from_bits(1)), false),
        ("one-hot", lone(1.0), false),
        (
            "outlier over tiny values",
            scaled(rng, 1e-30).into_iter().enumerate().map(|(j, v)| if j == 3 { 1.0 } else { v }).collect(),
            false,
        ),
        ("huge", scaled(rng, 1e38), true),
        (
            "f32::MAX",
            scaled(rng, 1.0).into_iter().enumerate().map(|(j, v)| if j == 1 { f32::MAX } else { v }).collect(),
            true,
        ),
        // Every magnitude from 1e-45 to 1e38 side by side.
        ("mixed", (0..cin).map(|j| rng.f() * 10f32.powi((j % 84) as i32 - 45)).collect(), true),
    ];
    if cin > intdot::XBLOCK {
        let b = intdot::XBLOCK;
        let blocks =
            |rng: &mut Rng, s0: f32, s1: f32| (0..cin).map(|j| rng.f() * if j < b { s0 } else { s1 }).collect();
        rows.push(("unit block, subnormal block", blocks(rng, 1.0, 1e-42), false));
        rows.push(("tiny block, unit block", blocks(rng, 1e-30, 1.0), false));
        rows.push(("huge block, tiny block", blocks(rng, 1e37, 1e-37), true));
    }
    rows
}

/// `y` against `x Wᵀ` in f64: within the activations' bound per input (`m_b / (65278 · 126)`
/// for two planes, `m_b / 65278` for one, `m_b` the block's largest magnitude; the pair
/// layout's code range, which covers the plain one's), `2⁻⁷⁰` of the row's largest magnitude
/// (subnormal scales of blocks far below it), f32 rounding of the sums, and `ulps` units of the
/// smallest subnormal (the rounding of subnormal results: a few for an output, one per product
/// for f32 products of subnormal inputs).
#[allow(clippy::too_many_arguments)]
fn check_extreme(
    label: &str,
    y: &[f32],
    x: &[f32],
    w: &[f32],
    (t, cout, cin): (usize, usize, usize),
    planes: usize,
    ulps: f64,
) {
    let per = if planes == 2 { 65278.0 * 126.0 } else { 65278.0 };
    for tt in 0..t {
        let xr = &x[tt * cin..(tt + 1) * cin];
        let bmax: Vec<f64> =
            xr.chunks(intdot::XBLOCK).map(|b| b.iter().fold(0f64, |a, v| a.max(v.abs() as f64))).collect();
        let row_max = bmax.iter().fold(0f64, |a, &v| a.max(v));
        for o in 0..cout {
            let wr = &w[o * cin..(o + 1) * cin];
            let (mut exact, mut l1, mut tol) = (0f64, 0f64, 0f64);
            for (j, (&a, &b)) in xr.iter().zip(wr).enumerate() {
                let (a, b) = (a as f64, b as f64);
                exact += a * b;
                l1 += (a * b).abs();
                tol += b.abs() * (bmax[j / intdot::XBLOCK] / per * 1.01 + row_max * 2f64.powi(-70));
            }
            assert!(exact.abs() < f32::MAX as f64 / 2.0, "{label}: the test's product leaves f32");
            let tol = tol + 1e-6 * (l1 + exact.abs()) + ulps * f32::from_bits(1) as f64;
            let v = y[tt * cout + o];
            assert!(
                v.is_finite() && (v as f64 - exact).abs() <= tol,
                "{label} t={tt} o={o}: {v} vs {exact} (tol {tol})"
            );
        }
    }
}

/// Packs a matrix under the AVX-512 setting of the moment.
type Packer = Box<dyn Fn() -> PackedMatrix>;

/// A random integer-dot matrix of `format` (int8 included), and the same with its row scales
/// times 2⁻²⁰: each as a packer and its dense weights.
fn unit_and_small(format: Format, cout: usize, cin: usize, rng: &mut Rng) -> [(Packer, Vec<f32>); 2] {
    let small = |s: &[f32]| s.iter().map(|v| v / 1048576.0).collect::<Vec<f32>>();
    if format == Format::Int8 {
        let m = random_int8(cout, cin, rng);
        let s = Int8Matrix { scale: small(&m.scale), ..m.clone() };
        let (wm, ws) = (m.reconstruct(), s.reconstruct());
        [(Box::new(move || PackedMatrix::from_int8(&m)), wm), (Box::new(move || PackedMatrix::from_int8(&s)), ws)]
    } else {
        let m = random_lut_int(format, cout, cin, rng);
        let s = LutMatrix { scale: small(&m.scale), ..m.clone() };
        let (wm, ws) = (m.reconstruct(), s.reconstruct());
        [(Box::new(move || PackedMatrix::from_lut(&m)), wm), (Box::new(move || PackedMatrix::from_lut(&s)), ws)]
    }
}

#[test]
fn decode_kernels_are_total_over_finite_inputs() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the AVX-512 and 512-bit decode kernels on extreme inputs");
    // Tiny, subnormal, huge and mixed activations through every integer-dot decode path: the
    // portable quantizer and the AVX2 one give the same codes and scales; the scalar reference
    // is finite and within the activations' bound of the f64 product; the AVX2, AVX-512 and
    // 512-bit (pair layout) kernels give the reference's bits; one row (decode) and several
    // (verify), through `matmul_many` and the public entry.
    use intdot::{matmul_many, set_avx512, set_wide, QuantX};
    let mut rng = Rng(53);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let layout =
        |q: &QuantX| (q.q.clone(), q.q2.clone(), q.qhl.clone(), bits(&q.scale), q.corr.clone(), q.shift.clone());
    let mut shifted = 0;
    for format in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        for &(cout, cin) in &[(20, 77), (18, intdot::XBLOCK + 40)] {
            let mats = unit_and_small(format, cout, cin, &mut rng);
            let rows = extreme_rows(cin, &mut rng);
            for (wi, (packer, w)) in mats.iter().enumerate() {
                // Packed with the AVX-512 kernels off, then on (vec2x64 and lut3 differ).
                let packs: Vec<PackedMatrix> = [false, true]
                    .into_iter()
                    .map(|avx512| {
                        set_avx512(avx512);
                        let p = packer();
                        set_avx512(true);
                        p
                    })
                    .collect();
                let group: Vec<&(&str, Vec<f32>, bool)> = rows.iter().filter(|r| r.2 == (wi == 1)).collect();
                // Each row alone, then all of them as one call.
                let mut inputs: Vec<(String, Vec<f32>, usize)> =
                    group.iter().map(|r| (r.0.to_string(), r.1.clone(), 1)).collect();
                inputs.push(("all".into(), group.iter().flat_map(|r| r.1.iter().copied()).collect(), group.len()));
                for (name, x, t) in &inputs {
                    let t = *t;
                    for planes in [1, 2] {
                        let label = format!("{format:?} {cout}x{cin} {name} planes={planes}");
                        let qx = QuantX::with_planes_scalar(x, t, cin, planes);
                        shifted += qx.shift.iter().filter(|&&e| e != 0).count();
                        set_wide(false);
                        let simd_q = QuantX::with_planes(x, t, cin, planes);
                        set_wide(true);
                        assert!(layout(&simd_q) == layout(&qx), "{label}: the AVX2 quantizer");
                        let mut want = vec![f32::NAN; t * cout];
                        matmul_many(false, &[packs[0].as_dot().unwrap()], &qx, &mut [&mut want]);
                        check_extreme(&label, &want, x, w, (t, cout, cin), planes, 4.0);
                        for (avx512, p) in [false, true].into_iter().zip(&packs) {
                            let d = p.as_dot().unwrap();
                            let mut r = vec![f32::NAN; t * cout];
                            matmul_many(false, &[d], &qx, &mut [&mut r]);
                            assert_eq!(bits(&r), bits(&want), "{label}: the reference on the AVX-512 layout");
                            set_avx512(avx512);
                            let mut y = vec![f32::NAN; t * cout];
                            matmul_many(true, &[d], &qx, &mut [&mut y]);
                            set_avx512(true);
                            assert_eq!(bits(&y), bits(&want), "{label}: avx512={avx512}");
                        }
                        if intdot::paired_kernels() {
                            let qp = QuantX::paired(x, t, cin, planes);
                            assert!(layout(&QuantX::with_planes(x, t, cin, planes)) == layout(&qp), "{label}: paired");
                            for d in packs.iter().map(|p| p.as_dot().unwrap()) {
                                let (mut r, mut y) = (vec![f32::NAN; t * cout], vec![f32::NAN; t * cout]);
                                matmul_many(false, &[d], &qp, &mut [&mut r]);
                                matmul_many(true, &[d], &qp, &mut [&mut y]);
                                assert_eq!(bits(&y), bits(&r), "{label}: the 512-bit kernels");
                                check_extreme(&format!("{label} paired"), &r, x, w, (t, cout, cin), planes, 4.0);
                            }
                        }
                    }
                    // The public entry: the process-wide planes and layout, kept buffers.
                    for backend in [Backend::Scalar, Backend::best()] {
                        let mut y = vec![f32::NAN; t * cout];
                        packs[1].matmul_with(backend, x, t, &mut y);
                        let label = format!("{format:?} {cout}x{cin} {name} {backend:?}");
                        // From GEMM_MIN_T rows on, the f32 path.
                        let ulps = if t < intdot::GEMM_MIN_T { 4.0 } else { cin as f64 };
                        check_extreme(&label, &y, x, w, (t, cout, cin), 2, ulps);
                    }
                }
            }
        }
    }
    assert!(shifted > 0, "no row was shifted");
}

#[test]
fn prefill_is_total_over_finite_inputs() {
    let _switches = switches();
    crate::testutil::avx512_kernels("the byte-plane prefill on extreme inputs");
    // The same extreme rows through prefill (T ≥ GEMM_MIN_T): the byte planes refuse blocks they
    // cannot scale and the f32 tiles take them; every setting (byte planes, f32 tiles 16 and 8
    // wide, the portable decode) is finite and within the bound of the f64 product.
    use intdot::{gemm_many, set_avx512, set_prefill, Prefill, GEMM_MIN_T};
    let mut rng = Rng(59);
    for format in [Format::Lut4, Format::Lut3, Format::Vec2x64, Format::Int8] {
        for &(cout, cin) in &[(20, 77), (18, intdot::XBLOCK + 40)] {
            let mats = unit_and_small(format, cout, cin, &mut rng);
            let rows = extreme_rows(cin, &mut rng);
            for (wi, (packer, w)) in mats.iter().enumerate() {
                let group: Vec<&Vec<f32>> = rows.iter().filter(|r| r.2 == (wi == 1)).map(|r| &r.1).collect();
                let t = GEMM_MIN_T + 1;
                let x: Vec<f32> = (0..t).flat_map(|r| group[r % group.len()].iter().copied()).collect();
                for (avx512, prefill, simd) in [
                    (true, Prefill::Int, true),
                    (true, Prefill::F32, true),
                    (false, Prefill::Auto, true),
                    (true, Prefill::Auto, false),
                ] {
                    set_avx512(avx512);
                    set_prefill(prefill);
                    let p = packer();
                    let mut y = vec![f32::NAN; t * cout];
                    gemm_many(simd, &[p.as_dot().unwrap()], &x, t, &mut [&mut y]);
                    set_avx512(true);
                    set_prefill(Prefill::Auto);
                    let label = format!("{format:?} {cout}x{cin} avx512={avx512} {prefill:?} simd={simd}");
                    // The f32 tiles: products of subnormal inputs round, one unit each.
                    check_extreme(&label, &y, &x, w, (t, cout, cin), 2, cin as f64);
                }
            }
        }
    }
}
