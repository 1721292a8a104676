//! Every fuzz target on its seed corpus (`fuzz/corpus/<target>/`) plus seeded random mutations:
//! no panic, no input slower than `MAX_INPUT_TIME`, no single allocation above `MAX_ALLOC`.
//! `FORGE_FUZZ_ITERS` sets the mutations per target (default 3000); `FORGE_FUZZ_SEED` the seed.

use forge_fuzz::alloc::LimitAlloc;
use forge_fuzz::harness::{corpus_dir, fuzz, load_corpus, Budget};
use forge_fuzz::TARGETS;

#[global_allocator]
static ALLOC: LimitAlloc = LimitAlloc;

fn env_u64(key: &str, default: u64) -> u64 {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn check(name: &str) {
    let target = TARGETS.iter().find(|t| t.0 == name).expect("a target").1;
    let corpus = load_corpus(&corpus_dir(name));
    assert!(!corpus.is_empty(), "{name}: empty corpus in {}", corpus_dir(name).display());
    let budget = Budget::Iterations(env_u64("FORGE_FUZZ_ITERS", 3000));
    let r = fuzz(name, target, &corpus, budget, env_u64("FORGE_FUZZ_SEED", 1));
    eprintln!("{}", r.line());
    let failures: Vec<String> =
        r.failures.iter().map(|f| format!("{} ({}): {}", f.saved.display(), f.origin, f.message)).collect();
    assert!(failures.is_empty(), "{name}: {} failing inputs:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn fuzz_gguf() {
    check("gguf");
}

#[test]
fn fuzz_safetensors() {
    check("safetensors");
}

#[test]
fn fuzz_config() {
    check("config");
}

#[test]
fn fuzz_tokenizer() {
    check("tokenizer");
}

#[test]
fn fuzz_chat_template() {
    check("chat_template");
}

#[test]
fn fuzz_request() {
    check("request");
}

#[test]
fn fuzz_tool_parser() {
    check("tool_parser");
}

#[test]
fn every_target_has_a_test_a_cargo_fuzz_target_and_a_small_corpus() {
    let root = forge_fuzz::harness::repo_root();
    let this = std::fs::read_to_string(file!()).or_else(|_| std::fs::read_to_string(root.join(file!()))).unwrap();
    let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
    let mut total = 0;
    for (name, _) in TARGETS {
        assert!(this.contains(&format!("check(\"{name}\")")), "{name}: no test here");
        assert!(root.join(format!("fuzz/fuzz_targets/{name}.rs")).exists(), "{name}: no cargo-fuzz target");
        assert!(manifest.contains(&format!("name = \"{name}\"")), "{name}: not in fuzz/Cargo.toml");
        for (file, bytes) in load_corpus(&corpus_dir(name)) {
            assert!(bytes.len() <= 16 << 10, "{name}/{file}: {} bytes; seeds stay small", bytes.len());
            total += bytes.len();
        }
    }
    assert!(total < 256 << 10, "the corpus is {total} bytes");
}

#[test]
fn seed_files_are_what_the_generator_writes() {
    // `cargo run --release -p forge-fuzz --example fuzz -- --write-seeds` rewrites them.
    for (name, seeds) in forge_fuzz::seeds::all() {
        let on_disk: std::collections::BTreeMap<String, Vec<u8>> =
            load_corpus(&corpus_dir(name)).into_iter().filter(|(f, _)| f.starts_with("seed-")).collect();
        let generated: std::collections::BTreeMap<String, Vec<u8>> = seeds.into_iter().collect();
        let names = |m: &std::collections::BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&on_disk), names(&generated), "{name}: seed files differ from the generator's");
        for (file, bytes) in &on_disk {
            assert!(*bytes == generated[file], "{name}/{file}: differs from the generator's output");
        }
    }
}
