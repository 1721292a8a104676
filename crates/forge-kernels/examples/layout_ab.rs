//! A/B of the two index layouts of vec2x64 (or, with `FORMATS=lut3`, of lut3) through the same
//! AVX-512 decode kernels, interleaved in one process: the nibble layout (lut3: two-bit fields
//! and a word of bit 2; packed with the AVX-512 kernels off, as AVX2 and NEON pack it) against
//! the stream layout of six-bit (three-bit) fields (packed with them on). Each round times both on the
//! same activations, and the median of the rounds is reported.
//!
//! `cargo run --release -p forge-kernels --example layout_ab -- [COUTxCIN] [rounds] [cold]`
//! (`cold`: cycle through copies of the matrix adding up to four times the last-level cache, at
//! least 512 MiB, so that each call reads its weights from memory, not cache;
//! `RAYON_NUM_THREADS` sets the threads).

use forge_kernels::lut::Format;
use forge_kernels::lutmm::intdot::{self, matmul_many, DotMatrix, QuantX};
use std::time::Instant;

mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (cout, cin) = common::shape_arg(&args, 1, (17408, 5120));
    let rounds: usize = args.get(2).map(|s| s.parse().expect("rounds")).unwrap_or(7);
    let cold = args.get(3).is_some_and(|s| s == "cold");
    if !intdot::six_bit_layout() {
        println!("this CPU has no AVX-512 VBMI kernels: one layout only");
        return;
    }
    let formats = std::env::var("FORMATS").map_or(vec![Format::Vec2x64], |_| common::formats());
    for format in formats {
        run(format, cout, cin, rounds, cold);
    }
}

fn run(format: Format, cout: usize, cin: usize, rounds: usize, cold: bool) {
    let x = common::Rng::new().activations(cin);
    let qx = QuantX::new(&x, 1, cin);
    // The same seeded matrix in both layouts.
    intdot::set_avx512(false);
    let nibble = common::Rng::new().lut_matrix(format, cout, cin);
    intdot::set_avx512(true);
    let six = common::Rng::new().lut_matrix(format, cout, cin);
    let bytes = six.packed_bytes();
    let copies = if cold { (common::cold_bytes() / bytes).max(2) } else { 1 };
    let sets: Vec<Vec<DotMatrix>> = [&nibble, &six].iter().map(|d| vec![(*d).clone(); copies]).collect();
    // About 0.2 s per timing, and each copy at least twice.
    let reps = (2 * copies).max((2e8 / bytes as f64 * rayon::current_num_threads() as f64) as usize);
    let mut y = [vec![0f32; cout], vec![0f32; cout]];
    let mut gbs = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        for (k, set) in sets.iter().enumerate() {
            let t0 = Instant::now();
            for i in 0..reps {
                matmul_many(true, &[&set[i % copies]], &qx, &mut [&mut y[k]]);
            }
            gbs[k].push(bytes as f64 * reps as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
    }
    assert_eq!(y[0], y[1], "the two layouts must give the same outputs");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (a, b) = (median(&mut gbs[0]), median(&mut gbs[1]));
    println!(
        "{} {cout}x{cin}, {} thread(s), {}: nibble {a:.2} GB/s, stream {b:.2} GB/s, ratio {:.2} (median of {rounds} rounds)",
        format.name(),
        rayon::current_num_threads(),
        if cold { "read from memory" } else { "in cache" },
        b / a
    );
}
