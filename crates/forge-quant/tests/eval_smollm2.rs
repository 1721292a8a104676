//! `forge eval` end to end on the real SmolLM2-135M-Instruct (tools/setup.sh fetches it), kept
//! short for 2-core CI: three windows of 128 tokens from `data/eval/prose.txt`
//! (evaluation only; nothing here tunes anything).
//!
//! Oracles: a model against its own reference (KL exactly 0, top-1 100 %); perplexity recomputed
//! here from raw `Logits::All` rows with an independent f64 log-softmax; the log-sum inequality
//! (top-K + tail KL ≤ full KL) on a real model pair; the llama.cpp protocol's counts on the real
//! text and tokenizer.

use forge_core::tensor::HostTensor;
use forge_model::linear::{Linear, Weight};
use forge_model::load::{load, Loaded};
use forge_model::Logits;
use forge_quant::eval::reference::{self, KlOptions, Reference, ReferenceOptions};
use forge_quant::eval::{self, EvalSetup, Protocol, TextSpec, WindowArgs, WindowPlan};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const CTX: usize = 128;
const CHUNKS: usize = 3;
const SCORE_FROM: usize = 64;

fn data_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data"))
}

fn teacher() -> &'static Loaded {
    static M: OnceLock<Loaded> = OnceLock::new();
    M.get_or_init(|| {
        let path = forge_core::hub::resolve_model("smollm2", false).expect("SmolLM2 missing: run tools/setup.sh");
        load(&path).unwrap()
    })
}

fn setup(score_from: usize) -> EvalSetup {
    EvalSetup::resolve(&WindowArgs {
        text: Some("eval/prose.txt:6000".into()),
        data_dir: Some(data_dir()),
        ctx: Some(CTX),
        chunks: Some(CHUNKS),
        score_from: Some(score_from),
        ..Default::default()
    })
    .unwrap()
}

fn text(s: &EvalSetup) -> eval::EvalText {
    eval::tokenize(teacher().tokenizer().unwrap(), s.text.read().unwrap()).unwrap()
}

/// A fresh directory for this process. The shared reference cannot be removed when the tests end
/// (statics have no teardown), so directories of earlier runs whose process is gone go first.
fn tmp(name: &str) -> PathBuf {
    static PRUNE: OnceLock<()> = OnceLock::new();
    PRUNE.get_or_init(|| {
        for e in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let pid = n.strip_prefix("forge-eval-").and_then(|r| r.rsplit_once('-')).map(|(_, p)| p.to_string());
            if let Some(pid) = pid.filter(|p| p.parse::<u32>().is_ok()) {
                if !Path::new("/proc").join(&pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    });
    let d = std::env::temp_dir().join(format!("forge-eval-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The teacher's reference (top-256 and full vocabulary), built once.
fn reference_dir() -> &'static Path {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        let out = tmp("ref").join("smollm2");
        let s = setup(SCORE_FROM);
        let opts = ReferenceOptions { full_vocab: true, ..Default::default() };
        reference::build(teacher(), &s, &text(&s), &out, &opts).unwrap();
        out
    })
}

fn kl(r: &Reference, l: &Loaded, full: bool) -> reference::KlResult {
    reference::check_candidate(r, l).unwrap();
    reference::kl_against(r, &l.model, &KlOptions { full_vocab: full, show_progress: false }).unwrap()
}

#[test]
fn reference_header_and_files() {
    let r = Reference::open(reference_dir()).unwrap();
    let m = &r.manifest;
    let per = CTX - 1 - SCORE_FROM;
    assert_eq!((m.windows, m.scored_per_window, m.positions, m.top_k), (CHUNKS, per, CHUNKS * per, 256));
    assert_eq!(m.vocab_size, 49152);
    assert!(!m.tokens.add_bos, "SmolLM2's GGUF says add_bos_token = false");
    // Independent tokenization and hashes.
    let bytes = std::fs::read(data_dir().join("eval/prose.txt")).unwrap();
    let ids = teacher().tokenizer().unwrap().encode(std::str::from_utf8(&bytes[..6000]).unwrap(), false).unwrap();
    assert_eq!(m.tokens.count, ids.len());
    assert_eq!(r.tokens, ids[..CHUNKS * CTX]);
    let raw: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(m.tokens.sha256, eval::text::sha256_hex(&raw));
    assert_eq!(m.text.sha256, eval::text::sha256_hex(&bytes[..6000]));
    let model_bytes = std::fs::read(&m.model.path).unwrap();
    assert_eq!(m.model.sha256, eval::text::sha256_hex(&model_bytes));
    // Stored NLL is the target's −log p; the top-1 log-prob is the largest and the K+1 outcomes
    // sum to 1.
    for p in 0..m.positions {
        let lp = &r.topk_logp[p * 256..(p + 1) * 256];
        assert!(lp.windows(2).all(|w| w[0] >= w[1]));
        let mass: f64 = lp.iter().map(|&x| (x as f64).exp()).sum::<f64>() + (r.tail[p] as f64).exp();
        assert!((mass - 1.0).abs() < 1e-5, "position {p}: mass {mass}");
        assert!(r.nll[p] >= -lp[0] - 1e-6);
    }
    assert!((r.teacher_ppl() - m.teacher.ppl).abs() < 1e-9 * m.teacher.ppl);
    // No temporary directories left next to it.
    let parent = reference_dir().parent().unwrap();
    assert_eq!(std::fs::read_dir(parent).unwrap().count(), 1);
    // Refuses to overwrite without force.
    let s = setup(SCORE_FROM);
    let e = reference::build(teacher(), &s, &text(&s), reference_dir(), &ReferenceOptions::default()).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e:#}");
    // --force replaces references only.
    let other = tmp("not-a-ref");
    std::fs::write(other.join("keep.txt"), b"x").unwrap();
    let force = ReferenceOptions { force: true, ..Default::default() };
    let e = reference::build(teacher(), &s, &text(&s), &other, &force).unwrap_err();
    assert!(e.to_string().contains("not an evaluation reference"), "{e:#}");
    assert!(other.join("keep.txt").exists());
    std::fs::remove_dir_all(&other).ok();
}

#[test]
fn damaged_or_incomplete_references_are_refused() {
    let src = reference_dir();
    let d = tmp("damaged");
    let copy = |name: &str| {
        let to = d.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() != "full_logp.npy" {
                std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
            }
        }
        to
    };
    let no_manifest = copy("no-manifest");
    std::fs::remove_file(no_manifest.join("manifest.json")).unwrap();
    let e = Reference::open(&no_manifest).err().unwrap();
    assert!(format!("{e:#}").contains("not a complete reference"), "{e:#}");

    let flipped = copy("flipped");
    let p = flipped.join("nll.npy");
    let mut b = std::fs::read(&p).unwrap();
    let last = b.len() - 1;
    b[last] ^= 1;
    std::fs::write(&p, b).unwrap();
    let e = Reference::open(&flipped).err().unwrap();
    assert!(format!("{e:#}").contains("nll.npy") && format!("{e:#}").contains("damaged"), "{e:#}");

    // The full-vocabulary file is absent: opening checks its size.
    let e = Reference::open(&copy("no-full")).err().unwrap();
    assert!(format!("{e:#}").contains("full_logp.npy"), "{e:#}");

    // A manifest whose token hash is not what the candidate's tokenizer produces.
    let tampered = copy("tampered");
    std::fs::copy(src.join("full_logp.npy"), tampered.join("full_logp.npy")).unwrap();
    let mp = tampered.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mp).unwrap()).unwrap();
    m["tokens"]["sha256"] = "0".repeat(64).into();
    std::fs::write(&mp, serde_json::to_vec(&m).unwrap()).unwrap();
    let r = Reference::open(&tampered).unwrap();
    let e = reference::check_candidate(&r, teacher()).unwrap_err();
    assert!(format!("{e:#}").contains("different token ids"), "{e:#}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn other_vocabulary_is_refused() {
    let r = Reference::open(reference_dir()).unwrap();
    let tiny = load(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama_tiny"))).unwrap();
    let e = reference::check_candidate(&r, &tiny).unwrap_err();
    assert!(format!("{e:#}").contains("vocabulary size"), "{e:#}");
    let e = reference::kl_against(&r, &tiny.model, &KlOptions { full_vocab: false, show_progress: false }).unwrap_err();
    assert!(format!("{e:#}").contains("vocabulary size"), "{e:#}");
}

#[test]
fn model_against_itself_is_exactly_zero() {
    let r = Reference::open(reference_dir()).unwrap();
    for full in [false, true] {
        let res = kl(&r, teacher(), full);
        assert_eq!(res.kl.len(), r.manifest.positions);
        assert!(res.kl.iter().all(|&x| x == 0.0), "full {full}: max {}", res.kl.iter().cloned().fold(0.0, f64::max));
        assert_eq!(res.top1_agreement(), 1.0);
        let s = reference::summarize(&r, eval::model_id(&teacher().path).unwrap(), "all linears".into(), &res);
        assert!(
            (s.ppl_candidate - s.ppl_teacher).abs() < 1e-5 * s.ppl_teacher,
            "{} vs {}",
            s.ppl_candidate,
            s.ppl_teacher
        );
        assert_eq!(s.candidate.sha256, r.manifest.model.sha256);
    }
}

fn perturb(l: &mut Linear, f: impl Fn(usize, &mut f32)) {
    // The teacher's weights (dense, or GGUF blocks decoded).
    assert!(matches!(l.weight, Weight::Dense(_) | Weight::Gguf(_)), "{} is not the teacher's", l.name);
    let mut w = l.effective_weight().unwrap();
    w.iter_mut().enumerate().for_each(|(i, x)| f(i, x));
    *l = Linear::dense(l.name.clone(), HostTensor::from_f32(vec![l.out_f, l.in_f], w), l.bias.clone());
}

#[test]
fn perturbed_teacher_has_positive_kl_bounded_by_full_kl() {
    let r = Reference::open(reference_dir()).unwrap();
    let mut cand = load(&teacher().path).unwrap();
    // One weight.
    perturb(&mut cand.model.layers[3].mlp.down, |i, x| {
        if i == 1234 {
            *x += 0.5
        }
    });
    let one = kl(&r, &cand, false);
    let mean = one.kl.iter().sum::<f64>() / one.kl.len() as f64;
    assert!(mean > 0.0 && one.kl.iter().all(|x| x.is_finite()), "mean {mean}");
    assert!(one.kl.iter().filter(|&&x| x > 0.0).count() > one.kl.len() / 2);

    // A whole matrix of noise: a candidate with clearly non-zero KL.
    perturb(cand.model.layers[5].self_attn_or_mixer_q(), |i, x| {
        let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        *x += 0.02 * ((h as f32 / (1u64 << 24) as f32) - 0.5)
    });
    let coarse = kl(&r, &cand, false);
    let full = kl(&r, &cand, true);
    let (mc, mf) = (coarse.kl.iter().sum::<f64>(), full.kl.iter().sum::<f64>());
    for (p, (&c, &f)) in coarse.kl.iter().zip(&full.kl).enumerate() {
        assert!(c <= f + 1e-6, "position {p}: top-256+tail {c} > full {f}");
    }
    // The ratio is about 0.92 (SmolLM2 leaves ~5 % of the mass outside its top 256 on this prose, and
    // the coarse KL misses how the candidate redistributes it).
    assert!(mf > 0.0 && mc > 0.85 * mf, "top-256+tail {mc} vs full {mf}");
    eprintln!("noisy q_proj: top-256+tail / full KL = {:.4}", mc / mf);
    assert_eq!(coarse.top1, full.top1);
}

/// Mutable access to the first attention projection of a layer (SmolLM2 is all attention).
trait MixerQ {
    fn self_attn_or_mixer_q(&mut self) -> &mut Linear;
}
impl MixerQ for forge_model::model::Layer {
    fn self_attn_or_mixer_q(&mut self) -> &mut Linear {
        match &mut self.mixer {
            forge_model::model::Mixer::Attention(a) => &mut a.q,
            forge_model::model::Mixer::DeltaNet(d) => &mut d.in_qkv,
        }
    }
}

#[test]
fn perplexity_equals_exp_mean_nll_from_raw_logits() {
    let s = setup(0);
    let t = text(&s);
    let report = eval::perplexity(&teacher().model, &s, &t, false).unwrap();
    assert_eq!(report.positions, CHUNKS * (CTX - 1));
    // Independent: tokenize, cut, run one prefill per window, log-softmax in f64 here.
    let m = &teacher().model;
    let v = m.cfg.vocab_size;
    let bytes = std::fs::read(data_dir().join("eval/prose.txt")).unwrap();
    let ids = teacher().tokenizer().unwrap().encode(std::str::from_utf8(&bytes[..6000]).unwrap(), false).unwrap();
    let mut nll = Vec::new();
    for w in 0..CHUNKS {
        let toks = &ids[w * CTX..(w + 1) * CTX];
        let logits = m.forward(&mut m.new_session(), toks, Logits::All).unwrap();
        for i in 0..CTX - 1 {
            let row = &logits[i * v..(i + 1) * v];
            let mx = row.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
            nll.push(lse - row[toks[i + 1] as usize] as f64);
        }
    }
    let want = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    assert!((report.ppl - want).abs() < 1e-9 * want, "{} vs {want}", report.ppl);
    for (a, b) in report.nll.iter().zip(&nll) {
        assert!((a - b).abs() < 1e-9, "{a} vs {b}");
    }
    // A sane language model on English prose.
    assert!(report.ppl > 2.0 && report.ppl < 60.0, "{}", report.ppl);
}

#[test]
fn llama_perplexity_protocol_on_the_real_text() {
    let s = EvalSetup::resolve(&WindowArgs {
        protocol: Some("llama-perplexity".into()),
        data_dir: Some(data_dir()),
        ..Default::default()
    })
    .unwrap();
    let bytes = s.text.read().unwrap();
    assert_eq!(bytes.bytes.len(), 163_840);
    let prose = std::fs::read(data_dir().join("eval/prose.txt")).unwrap();
    let code = std::fs::read(data_dir().join("eval/code.txt")).unwrap();
    assert_eq!(bytes.bytes, [&prose[..81920], &code[..81920]].concat());
    // The spec string alone reproduces the text.
    assert_eq!(TextSpec::parse(&bytes.spec, None).unwrap().read().unwrap().bytes, bytes.bytes);
    let t = eval::tokenize(teacher().tokenizer().unwrap(), bytes).unwrap();
    assert_eq!((t.invalid_utf8_bytes, t.unrepresentable, t.add_bos), (0, 0, false));
    let p = Protocol::LlamaPerplexity;
    let plan = WindowPlan::new(t.tokens.len(), s.ctx, s.chunks, s.score_from).unwrap();
    assert_eq!(plan, WindowPlan { ctx: 512, windows: 20, score_from: 256 });
    assert_eq!((plan.n_positions(), p.score_from()), (5100, 256));
    // The 10,240 evaluated tokens all come from the prose part.
    let prefix = teacher().tokenizer().unwrap().decode(&t.tokens[..plan.n_tokens()], false).unwrap();
    assert!(prefix.len() < 81920 && prose.starts_with(prefix.as_bytes()), "{} bytes", prefix.len());
}
