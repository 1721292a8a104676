//! The stable driver: replays a target's seed corpus, then runs seeded random mutations of it,
//! catching panics, inputs that take too long and inputs that make the target allocate too much
//! at once (with [`crate::alloc::LimitAlloc`] as the global allocator). Failing inputs are saved
//! under `target/fuzz-failures/` to be replayed with the `fuzz` example.

use crate::alloc;
use crate::mutate::{mutate, Rng};
use crate::targets::Target;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// The largest single allocation one input may cause. The seeds are a few KiB and mutations keep
/// them under 64 KiB; the one-time loading of the shared fixtures (the SmolLM2 vocabulary) stays
/// far below.
pub const MAX_ALLOC: usize = 256 << 20;
/// One input taking this long is reported as a hang.
pub const MAX_INPUT_TIME: Duration = Duration::from_secs(10);

/// The repository root (the drivers run from the source tree).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn corpus_dir(target: &str) -> PathBuf {
    repo_root().join("fuzz/corpus").join(target)
}

/// The files of a corpus directory, sorted by name.
pub fn load_corpus(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .filter_map(|e| Some((e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).ok()?)))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[derive(Debug)]
pub struct Failure {
    /// Where the input was saved.
    pub saved: PathBuf,
    /// The corpus file, or the mutation that produced it.
    pub origin: String,
    pub message: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub target: String,
    pub corpus: usize,
    pub execs: u64,
    pub elapsed: Duration,
    pub slowest: Duration,
    pub largest_alloc: usize,
    pub failures: Vec<Failure>,
}

impl Report {
    pub fn execs_per_sec(&self) -> f64 {
        self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn line(&self) -> String {
        format!(
            "{:<14} corpus {:>3}  execs {:>9}  {:>8.0}/s  slowest {:>7.2} ms  largest alloc {:>6.2} MiB  failures {}",
            self.target,
            self.corpus,
            self.execs,
            self.execs_per_sec(),
            self.slowest.as_secs_f64() * 1e3,
            self.largest_alloc as f64 / (1 << 20) as f64,
            self.failures.len()
        )
    }
}

/// The message of the last panic on any thread (message and location).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.to_string());
            if std::env::var_os("FORGE_FUZZ_QUIET").is_none() {
                previous(info);
            }
        }));
    });
}

/// Runs `target` on one input: its time and largest allocation, or why it failed.
pub fn run_one(target: Target, input: &[u8]) -> Result<(Duration, usize), String> {
    install_panic_hook();
    alloc::take_largest();
    let t = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| target(input)));
    let took = t.elapsed();
    let largest = alloc::take_largest();
    if r.is_err() {
        let msg = LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()).take();
        return Err(format!("panicked: {}", msg.unwrap_or_else(|| "(no message)".into())));
    }
    if largest > MAX_ALLOC {
        return Err(format!("allocated {largest} bytes at once (limit {MAX_ALLOC}) for a {}-byte input", input.len()));
    }
    if took > MAX_INPUT_TIME {
        return Err(format!("took {took:?} for a {}-byte input", input.len()));
    }
    Ok((took, largest))
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

fn save(target: &str, input: &[u8]) -> PathBuf {
    let dir = repo_root().join("target/fuzz-failures");
    let _ = std::fs::create_dir_all(&dir);
    let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let path = dir.join(format!("{target}-{hash:016x}"));
    let _ = std::fs::write(&path, input);
    path
}

/// How long a run goes on.
#[derive(Clone, Copy, Debug)]
pub enum Budget {
    Iterations(u64),
    Time(Duration),
}

/// Replays `corpus`, then mutates it per `budget`, from a seed derived from `seed` and the
/// target's name. Stops early after 5 failures.
pub fn fuzz(name: &str, target: Target, corpus: &[(String, Vec<u8>)], budget: Budget, seed: u64) -> Report {
    let mut report = Report { target: name.to_string(), corpus: corpus.len(), ..Default::default() };
    let start = Instant::now();
    let record = |report: &mut Report, input: &[u8], origin: String, r: Result<(Duration, usize), String>| {
        report.execs += 1;
        match r {
            Ok((took, largest)) => {
                report.slowest = report.slowest.max(took);
                report.largest_alloc = report.largest_alloc.max(largest);
            }
            Err(message) => report.failures.push(Failure { saved: save(name, input), origin, message }),
        }
    };
    for (file, input) in corpus {
        let r = run_one(target, input);
        record(&mut report, input, format!("corpus file {file}"), r);
    }
    let inputs: Vec<Vec<u8>> = corpus.iter().map(|(_, b)| b.clone()).collect();
    if !inputs.is_empty() {
        let mut rng = Rng::new(seed ^ fnv(name));
        let mut i = 0u64;
        loop {
            let more = match budget {
                Budget::Iterations(n) => i < n,
                Budget::Time(d) => start.elapsed() < d,
            };
            if !more || report.failures.len() >= 5 {
                break;
            }
            let base = rng.below(inputs.len());
            let input = mutate(&mut rng, &inputs[base], &inputs);
            let r = run_one(target, &input);
            record(&mut report, &input, format!("mutation {i} of {} (seed {seed})", corpus[base].0), r);
            i += 1;
        }
    }
    report.elapsed = start.elapsed();
    report
}
