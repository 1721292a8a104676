//! Read bandwidth buffer by buffer: buffers of the given sizes allocated in one process, one
//! pass over each in turn per round (4 MiB pieces claimed by a spinning team, four streams a
//! piece, as `forge bench`'s probe reads), median, lowest and highest pass per buffer.
//!
//! On a VM the speed of memory can depend on where a buffer's pages lie: buffers of one
//! process can read up to about 15 % apart, each steady from pass to pass and not in order of
//! size, and the spread changes from one process to the next. Hence `forge bench` also reads
//! the weights' own pages.
//!
//! `cargo run --release -p forge-kernels --example buffer_probe -- ROUNDS GIB...` (threads from
//! `RAYON_NUM_THREADS`).
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Streams a piece is read as, and the piece's bytes (`forge bench`'s probe).
const STREAMS: usize = 4;
const PIECE: usize = 4 << 20;

/// One pass over `buf`, GB/s.
fn pass(buf: &[u64]) -> f64 {
    let seg = (PIECE / 8 / STREAMS) & !7;
    let pieces = buf.len() / (STREAMS * seg);
    let sink = AtomicU64::new(0);
    let secs = forge_kernels::team::with_team(|| {
        let t0 = Instant::now();
        forge_kernels::team::parallel_for(pieces, &|k| {
            let v = forge_kernels::stream::sum_streams(&buf[k * STREAMS * seg..], STREAMS, seg);
            sink.fetch_add(v, Ordering::Relaxed);
        });
        t0.elapsed().as_secs_f64()
    });
    std::hint::black_box(sink.load(Ordering::Relaxed));
    (pieces * STREAMS * seg * 8) as f64 / secs / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: buffer_probe ROUNDS GIB...";
    let rounds: usize = args.get(1).and_then(|s| s.parse().ok()).expect(usage);
    let sizes: Vec<f64> = args[2..].iter().map(|s| s.parse().expect(usage)).collect();
    assert!(!sizes.is_empty(), "{usage}");
    let bufs: Vec<Vec<u64>> = sizes
        .iter()
        .map(|g| {
            let n = ((g * (1u64 << 30) as f64) as usize / 8).max(PIECE / 8);
            (0..n).map(|i| i as u64).collect()
        })
        .collect();
    let mut runs: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); bufs.len()];
    for _ in 0..rounds {
        for (r, b) in runs.iter_mut().zip(&bufs) {
            r.push(pass(b));
        }
    }
    println!("{} thread(s), {rounds} rounds", rayon::current_num_threads());
    for (i, (g, mut r)) in sizes.iter().zip(runs).enumerate() {
        r.sort_by(|a, b| a.total_cmp(b));
        println!(
            "buffer {i}: {g:5.2} GiB, median {:.2} GB/s (lowest {:.2}, highest {:.2})",
            r[r.len() / 2],
            r[0],
            r[r.len() - 1]
        );
    }
}
