//! The stable fuzz driver from the command line (see docs/fuzzing.md):
//!
//! ```text
//! cargo run --release -p forge-fuzz --example fuzz -- [--iters N | --secs S] [--seed N] [TARGET...]
//! cargo run --release -p forge-fuzz --example fuzz -- --replay TARGET FILE...
//! cargo run --release -p forge-fuzz --example fuzz -- --write-seeds
//! ```
//!
//! Runs each target (all by default) on its corpus plus mutations and prints executions, rate,
//! slowest input and largest allocation; failing inputs are saved under `target/fuzz-failures/`.

use forge_fuzz::alloc::LimitAlloc;
use forge_fuzz::harness::{corpus_dir, fuzz, load_corpus, run_one, Budget};
use forge_fuzz::TARGETS;
use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static ALLOC: LimitAlloc = LimitAlloc;

fn usage() -> ExitCode {
    eprintln!(
        "usage: fuzz [--iters N | --secs S] [--seed N] [TARGET...]\n       fuzz --replay TARGET FILE...\n       \
         fuzz --write-seeds\ntargets: {}",
        TARGETS.iter().map(|t| t.0).collect::<Vec<_>>().join(" ")
    );
    ExitCode::from(2)
}

fn target(name: &str) -> Option<forge_fuzz::targets::Target> {
    TARGETS.iter().find(|t| t.0 == name).map(|t| t.1)
}

fn write_seeds() -> ExitCode {
    for (name, seeds) in forge_fuzz::seeds::all() {
        let dir = corpus_dir(name);
        std::fs::create_dir_all(&dir).expect("corpus directory");
        for (file, _) in load_corpus(&dir) {
            if file.starts_with("seed-") && !seeds.iter().any(|(n, _)| *n == file) {
                std::fs::remove_file(dir.join(&file)).expect("remove a stale seed");
            }
        }
        let bytes: usize = seeds.iter().map(|(_, b)| b.len()).sum();
        for (file, b) in &seeds {
            std::fs::write(dir.join(file), b).expect("write a seed");
        }
        println!("{name}: {} seeds, {bytes} bytes", seeds.len());
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut budget = Budget::Iterations(100_000);
    let mut seed = 1u64;
    let mut names = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--write-seeds" => return write_seeds(),
            "--replay" => {
                let Some(t) = it.next().and_then(|n| target(n)) else { return usage() };
                let mut failed = false;
                for file in it {
                    let input = std::fs::read(file).unwrap_or_else(|e| panic!("{file}: {e}"));
                    match run_one(t, &input) {
                        Ok((took, largest)) => println!("{file}: ok in {took:?}, largest allocation {largest} bytes"),
                        Err(e) => {
                            failed = true;
                            println!("{file}: {e}");
                        }
                    }
                }
                return if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS };
            }
            "--iters" => match it.next().and_then(|n| n.parse().ok()) {
                Some(n) => budget = Budget::Iterations(n),
                None => return usage(),
            },
            "--secs" => match it.next().and_then(|n| n.parse().ok()) {
                Some(s) => budget = Budget::Time(Duration::from_secs_f64(s)),
                None => return usage(),
            },
            "--seed" => match it.next().and_then(|n| n.parse().ok()) {
                Some(s) => seed = s,
                None => return usage(),
            },
            name if target(name).is_some() => names.push(name.to_string()),
            _ => return usage(),
        }
    }
    if names.is_empty() {
        names = TARGETS.iter().map(|t| t.0.to_string()).collect();
    }
    let mut failures = 0;
    for name in &names {
        let corpus = load_corpus(&corpus_dir(name));
        let r = fuzz(name, target(name).expect("checked"), &corpus, budget, seed);
        println!("{}", r.line());
        for f in &r.failures {
            println!("  FAILURE ({}): {}\n    saved as {}", f.origin, f.message, f.saved.display());
        }
        failures += r.failures.len();
    }
    if failures > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
