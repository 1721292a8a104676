//! `forge compile`'s cache on a quantized tiny qwen3_5 fixture: the compiled export loads its
//! integer-dot matrices from the mapped cache and computes bit-identical logits; a second
//! compile reuses the cache; a cache from other weights, for the other vec2x64 layout, or a
//! damaged one is ignored, never used.

mod common;

use forge_kernels::lut::Format;
use forge_model::compiled::{compile, CACHE_FILE};
use forge_model::linear::Weight;
use forge_model::load::load;
use forge_model::Logits;
use forge_quant::plan::{Basis, Plan};
use forge_quant::quantize::quantize;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn tokens(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("tokens.txt")).unwrap().split_whitespace().map(|s| s.parse().unwrap()).collect()
}

fn logits(dir: &Path, toks: &[u32]) -> (Vec<f32>, usize, usize) {
    let q = load(dir).unwrap();
    let mut packed = 0;
    let mut plain = 0;
    for l in q.model.linears() {
        match l.weight {
            Weight::Packed(_) => packed += 1,
            Weight::Lut(_) | Weight::Int8(_) => plain += 1,
            Weight::Dense(_) | Weight::Gguf(_) => {}
        }
    }
    let mut s = q.model.new_session();
    let mut out = q.model.forward(&mut s, &toks[..10], Logits::All).unwrap();
    for &t in &toks[10..16] {
        out.extend(q.model.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    (out, packed, plain)
}

#[test]
fn compiled_cache_is_used_reused_and_checked() {
    let src = fixture("qwen35_tiny");
    let out = std::env::temp_dir().join(format!("forge-compiled-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut plan = Plan::uniform(Format::Lut4);
    plan.mlp = Format::Vec2x64;
    plan.kv = Format::Int8;
    plan.mlp_basis = Basis::Online;
    // Matrices in lut3, lut2 and vec2x16, whose AVX-512 layouts are cached like the others.
    plan.entries.insert("0.down".into(), "lut3".into());
    plan.entries.insert("1.down".into(), "lut2".into());
    plan.entries.insert("1.up".into(), "vec2x16".into());
    let opts = common::rtn_options(&src.to_string_lossy(), src.clone(), plan, 3, &out);
    quantize(&opts).unwrap();
    let toks = tokens(&src);
    let (before, packed0, plain0) = logits(&out, &toks);
    assert_eq!(packed0, 0);

    let r = compile(&out, false, &|_, _| {}).unwrap();
    assert!(!r.reused);
    assert_eq!((r.matrices, r.tiles), (plain0, 0));
    let (after, packed, plain) = logits(&out, &toks);
    assert_eq!((packed, plain), (plain0, 0), "every matrix comes from the cache");
    assert_eq!(before, after, "cached and freshly packed matrices compute the same logits");

    let bytes = std::fs::read(out.join(CACHE_FILE)).unwrap();
    let again = compile(&out, false, &|_, _| {}).unwrap();
    assert!(again.reused);
    assert_eq!(std::fs::read(out.join(CACHE_FILE)).unwrap(), bytes, "reused, not rewritten");
    let forced = compile(&out, true, &|_, _| {}).unwrap();
    assert!(!forced.reused);
    assert_eq!(std::fs::read(out.join(CACHE_FILE)).unwrap(), bytes, "deterministic");

    // Other weights: change one byte of a layer file's data; the fingerprint samples it.
    let layer = out.join("layer_01.safetensors");
    let orig = std::fs::read(&layer).unwrap();
    let mut changed = orig.clone();
    let n = changed.len();
    changed[n - 1] ^= 1;
    std::fs::write(&layer, &changed).unwrap();
    let (_, packed, _) = logits(&out, &toks);
    assert_eq!(packed, 0, "a cache from other weights is ignored");
    std::fs::write(&layer, &orig).unwrap();

    // A cache whose metadata does not name its index layouts (the entry renamed, same length)
    // is ignored: its matrices cannot be read safely.
    let entry = b"\"index_layouts\"";
    let at = bytes.windows(entry.len()).position(|w| w == entry).expect("the layouts entry");
    let mut unnamed = bytes.clone();
    unnamed[at + entry.len() - 2] = b'z';
    std::fs::write(out.join(CACHE_FILE), &unnamed).unwrap();
    let (l, packed, _) = logits(&out, &toks);
    assert_eq!(packed, 0, "a cache without its layouts entry is ignored");
    assert_eq!(l, before);

    // A damaged cache is ignored too (with a warning), never a panic or a partial model.
    std::fs::write(out.join(CACHE_FILE), &bytes[..bytes.len() / 2]).unwrap();
    let (l, packed, _) = logits(&out, &toks);
    assert_eq!(packed, 0);
    assert_eq!(l, before);
    std::fs::write(out.join(CACHE_FILE), b"\xff\xff\xff\xff\xff\xff\xff\x7f{").unwrap();
    assert_eq!(logits(&out, &toks).1, 0);
    // `compile` (without --force) replaces a damaged or stale cache.
    let rebuilt = compile(&out, false, &|_, _| {}).unwrap();
    assert!(!rebuilt.reused);
    assert_eq!(std::fs::read(out.join(CACHE_FILE)).unwrap(), bytes, "rebuilt as before");
    assert_eq!(logits(&out, &toks).1, plain0);

    // LUT matrices pack to the AVX-512 kernels' own layouts where those run (vec2x64 six-bit
    // fields, groups) and to the plain ones without them: a cache compiled for the other
    // layouts is ignored (the matrices are packed afresh, same logits) and `compile` rebuilds it.
    use forge_kernels::lutmm::intdot::{set_avx512, six_bit_layout};
    if six_bit_layout() {
        set_avx512(false);
        assert!(!compile(&out, true, &|_, _| {}).unwrap().reused);
        set_avx512(true);
        let (l, packed, _) = logits(&out, &toks);
        assert_eq!(packed, 0, "a cache of the nibble layout is not used by the six-bit kernels");
        assert_eq!(l, before);
        assert!(!compile(&out, false, &|_, _| {}).unwrap().reused);
        assert_eq!(std::fs::read(out.join(CACHE_FILE)).unwrap(), bytes, "rebuilt in this CPU's layout");
    }
    let _ = std::fs::remove_dir_all(&out);
}
