//! A low-rank branch's FP16 factors at decode, read from memory, two ways alternated round by
//! round in one process: `B` (rank × in, long rows) as row dot products without and with the
//! lines asked for ahead (`simd::dot_f16` against `matmul_xwt`, which takes
//! `simd::dot_f16_stream`); `A` (out × rank) as row dot products against the same matrix in
//! tiles of 16 rows (`f16tiles`, what `Linear` runs); a dense BF16 48 × 5120 (a DeltaNet's
//! `in_proj_a`) decoded into f32 blocks against widened row by row.
//!
//! `cargo run --release -p forge-kernels --example lowrank_probe -- [rounds] [hot]` (threads from
//! `RAYON_NUM_THREADS`; without `hot` the calls cycle through copies adding up to four times the
//! last-level cache, so that the factors come from memory as a model's do).
use forge_core::tensor::FloatSlice;
use forge_kernels::f16tiles;
use std::time::Instant;
mod common;

fn main() {
    // On a worker of the pool: with one thread, calls then run inline instead of being handed
    // to the pool and waited for.
    rayon::ThreadPoolBuilder::new().build().expect("thread pool").install(run);
}

fn run() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map(|s| s.parse().expect("rounds")).unwrap_or(5);
    let hot = args.get(2).is_some_and(|s| s == "hot");
    let mut rng = common::Rng::new();
    println!(
        "{} thread(s), {}, median of {rounds} rounds, GB/s",
        rayon::current_num_threads(),
        if hot { "hot" } else { "from memory" }
    );
    for &(n_out, n_in) in &[(64usize, 5120usize), (64, 6144), (10240, 64), (6144, 64), (5120, 64)] {
        let bytes = n_out * n_in * 2;
        let copies = if hot { 1 } else { (common::cold_bytes() / bytes).max(2) };
        let reps = if hot { 200 } else { copies };
        let rows: Vec<Vec<u16>> = (0..copies)
            .map(|_| {
                (0..n_out * n_in)
                    .map(|_| half::f16::from_f32((rng.next() % 1000) as f32 / 1000.0 - 0.5).to_bits())
                    .collect()
            })
            .collect();
        let tiles: Vec<Vec<u16>> = rows.iter().map(|r| f16tiles::pack(r, n_out, n_in)).collect();
        let x = rng.activations(n_in);
        let mut y = vec![0f32; n_out];
        let long = n_in > 256;
        let mut res: Vec<Vec<f64>> = vec![Vec::new(); 2];
        forge_kernels::team::with_team(|| {
            for r in 0..rounds {
                for v in [r % 2, 1 - r % 2] {
                    let t0 = Instant::now();
                    match (long, v) {
                        (true, 0) => {
                            // `matmul_xwt`'s decode path with the plain dot product.
                            for w in rows.iter().cycle().take(reps) {
                                let per = (n_out / (2 * rayon::current_num_threads())).max(1);
                                forge_kernels::team::par_chunks_mut(&mut y, per, &|i, out| {
                                    for (j, o) in out.iter_mut().enumerate() {
                                        *o = forge_kernels::simd::dot_f16(&x, &w[(i * per + j) * n_in..][..n_in]);
                                    }
                                });
                            }
                        }
                        (false, 1) => {
                            for w in tiles.iter().cycle().take(reps) {
                                f16tiles::gemm_add(&x, 1, w, n_out, n_in, &mut y);
                            }
                        }
                        _ => {
                            for w in rows.iter().cycle().take(reps) {
                                forge_kernels::matmul::matmul_xwt(&x, 1, FloatSlice::F16(w), n_out, n_in, &mut y);
                            }
                        }
                    }
                    res[v].push(bytes as f64 * reps as f64 / t0.elapsed().as_secs_f64() / 1e9);
                }
            }
        });
        let med = |v: &Vec<f64>| {
            let mut v = v.clone();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (a, b) = (med(&res[0]), med(&res[1]));
        let names = if long { ("row dots", "lines ahead") } else { ("row dots", "tiles") };
        println!("{n_out}x{n_in}: {} {a:.1}, {} {b:.1} ({:.2}x)", names.0, names.1, b / a);
    }
    // A DeltaNet's `in_proj_a`/`in_proj_b` (dense BF16, 48 × 5120), as `matmul_xwt` takes them.
    let (n_out, n_in) = (48usize, 5120usize);
    let copies = if hot { 1 } else { (common::cold_bytes() / (n_out * n_in * 2)).max(2) };
    let ws: Vec<Vec<u16>> = (0..copies)
        .map(|_| {
            (0..n_out * n_in)
                .map(|_| half::bf16::from_f32((rng.next() % 1000) as f32 / 1000.0 - 0.5).to_bits())
                .collect()
        })
        .collect();
    let x = rng.activations(n_in);
    let mut y = vec![0f32; n_out];
    let reps = if hot { 200 } else { copies };
    // The block path (rows decoded into f32 blocks, `matmul_rows`) against the row path that
    // `matmul_xwt` takes, alternated.
    let mut v = [Vec::new(), Vec::new()];
    forge_kernels::team::with_team(|| {
        for r in 0..rounds {
            for k in [r % 2, 1 - r % 2] {
                let t0 = Instant::now();
                for w in ws.iter().cycle().take(reps) {
                    if k == 0 {
                        let rows = forge_kernels::matmul::DenseRows { w: FloatSlice::BF16(w), n_out, n_in };
                        forge_kernels::matmul::matmul_rows(&x, 1, &rows, &mut y);
                    } else {
                        forge_kernels::matmul::matmul_xwt(&x, 1, FloatSlice::BF16(w), n_out, n_in, &mut y);
                    }
                }
                v[k].push(t0.elapsed().as_secs_f64() / reps as f64);
            }
        }
    });
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (med(&mut v[0]), med(&mut v[1]));
    let gb = |t: f64| (n_out * n_in * 2) as f64 / t / 1e9;
    println!(
        "48x5120 bf16: blocks {:.1} us a call ({:.1} GB/s), rows {:.1} us ({:.1} GB/s), {:.2}x",
        a * 1e6,
        gb(a),
        b * 1e6,
        gb(b),
        a / b
    );
}
