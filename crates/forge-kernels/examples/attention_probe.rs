//! One thread's KV8 attention over a part of a history, at the 27B shape's group (six query
//! heads of 256 over one KV head) or SmolLM2's (three of 64): the same part again and again
//! (its rows in L2) against parts of a history far larger than the caches (rows from memory).
//! Prints each case's rate in history bytes a second: the first says what the arithmetic
//! allows, the second what memory gives it.
//!
//! `cargo run --release -p forge-kernels --example attention_probe -- [d g]`

use forge_kernels::attention::{attend_part, History, KvElem, RowScales};
use half::f16;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().expect("d g")).collect();
    let (d, g) = if args.len() == 2 { (args[0], args[1]) } else { (256, 6) };
    let part = 1024usize;
    let rows = (1usize << 30) / (2 * d + 4); // about 1 GiB of history
    let codes: Vec<i8> = (0..rows * d).map(|i| i8::from_f32(((i * 7919 % 255) as f32) - 127.0)).collect();
    let scales: Vec<f16> = (0..rows).map(|j| f16::from_f32(0.01 + (j % 5) as f32 * 1e-3)).collect();
    let q: Vec<f32> = (0..g * d).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
    let (mut s, mut out, mut st) = (vec![0f32; g * part], vec![0f32; g * d], vec![0f32; 2 * g]);
    // A part's values are another part's codes, so that keys and values are different memory.
    let parts = rows / part;
    let kv = |p: usize| History {
        keys: &codes[p * part * d..(p + 1) * part * d],
        values: &codes[(p + parts / 2) % parts * part * d..((p + parts / 2) % parts + 1) * part * d],
        key_scales: RowScales::F16(&scales[p * part..(p + 1) * part]),
        value_scales: RowScales::F16(&scales[(p + parts / 2) % parts * part..((p + parts / 2) % parts + 1) * part]),
        n: part,
        stride: d,
        offset: 0,
    };
    if let Some((f, b)) = forge_kernels::simd::dot_rates() {
        println!("this core: {:.1} G f32 FMA lanes/s, {:.1} G vpdpbusd MACs/s", f / 1e9, b / 1e9);
    }
    let bytes = (part * (2 * d + 4)) as f64;
    for (name, stride) in [("one part (L2)", 0usize), ("parts in turn (memory)", 1)] {
        let reps = if stride == 0 { 20000 } else { 400 };
        let t0 = Instant::now();
        for r in 0..reps {
            let p = (r * stride * 7) % parts;
            attend_part(&q, d, kv(p), 0.0625, &mut s, &mut out, &mut st, true);
        }
        let secs = t0.elapsed().as_secs_f64();
        println!("d={d} g={g} {name}: {:.2} GB/s of history", reps as f64 * bytes / secs / 1e9);
    }
}
