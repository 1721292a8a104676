//! Fuzz targets for every parser that reads untrusted bytes, in one place: each is a
//! `fn(&[u8])` that must neither panic, hang nor allocate without bound on any input.
//!
//! Two drivers share them: `fuzz/` (cargo-fuzz, coverage-guided, nightly) and [`harness`], a
//! stable driver that replays each target's seed corpus (`fuzz/corpus/<target>/`) plus seeded
//! random mutations of it. The tests of this crate run the harness in CI; the `fuzz` example runs
//! it for longer. See `docs/fuzzing.md`.

pub mod alloc;
pub mod harness;
pub mod mutate;
pub mod seeds;
pub mod targets;

pub use targets::TARGETS;
