//! Speculative decoding against plain decoding on the tiny `transformers` fixtures: greedy ids
//! equal for every drafter, draft length and KV cache type; the rolled-back session equal to one
//! that only saw the kept tokens; sampled tokens distributed as plain sampling draws them.

use forge_model::load::load;
use forge_model::model::VERIFY_MAX_ROWS;
use forge_model::sampling::{Dist, Rng, Sampler, SamplingParams};
use forge_model::session::{KvDtype, LayerState};
use forge_model::speculative::{Decoder, Draft, Drafter, LookupDrafter, ModelDrafter, SpecConfig};
use forge_model::{Logits, Model, Session};
use std::path::PathBuf;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name);
    load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}")).model
}

fn greedy() -> Sampler {
    Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() })
}

/// A prompt with a repeated stretch, so that prompt lookup finds matches.
fn prompt(vocab: usize) -> Vec<u32> {
    let base = forge_model::generate::synthetic_prompt(vocab, 24);
    [&base[..], &base[4..14], &base[..6]].concat()
}

/// Plain greedy decoding: `n` ids.
fn plain(m: &Model, kv: KvDtype, p: &[u32], n: usize) -> Vec<u32> {
    let mut s = m.new_session_with_kv(kv);
    let logits = m.forward(&mut s, p, Logits::Last).unwrap();
    let mut d = Decoder::new(m, &mut s, p.to_vec(), logits, greedy());
    (0..n).map(|_| d.next_token().unwrap()).collect()
}

/// Proposes what `inner` proposes with some tokens replaced (seeded), so that verification
/// accepts part of a draft and rolls back the rest.
struct Noisy<D> {
    inner: D,
    rng: Rng,
    vocab: u32,
}

impl<D: Drafter> Drafter for Noisy<D> {
    fn propose(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> anyhow::Result<()> {
        self.inner.propose(context, k, draft)?;
        for t in &mut draft.tokens {
            if self.rng.next_f64() < 0.3 {
                *t = (self.rng.next_u64() % self.vocab as u64) as u32;
            }
        }
        draft.dists.clear();
        Ok(())
    }
    fn name(&self) -> String {
        "noisy".into()
    }
}

fn speculative(
    m: &Model,
    kv: KvDtype,
    p: &[u32],
    n: usize,
    drafter: Box<dyn Drafter + '_>,
    k: usize,
) -> (Vec<u32>, f64) {
    let mut s = m.new_session_with_kv(kv);
    let logits = m.forward(&mut s, p, Logits::Last).unwrap();
    let cfg = SpecConfig { max_draft: k, adaptive: false };
    let mut d = Decoder::new(m, &mut s, p.to_vec(), logits, greedy()).with_drafter(Some(drafter), cfg);
    let ids: Vec<u32> = (0..n).map(|_| d.next_token().unwrap()).collect();
    let rate = d.stats.acceptance_rate();
    assert!(d.stats.verifies > 0, "the drafter never proposed");
    (ids, rate)
}

#[test]
fn greedy_speculation_returns_plain_greedy_ids() {
    for (name, draft_name) in
        [("qwen35_tiny", "qwen35_tiny"), ("llama_tiny", "qwen2_tiny"), ("qwen35_tiny_mm", "qwen35_tiny_mm")]
    {
        let m = fixture(name);
        let dm = fixture(draft_name);
        let v = m.cfg.vocab_size;
        let p = prompt(v);
        for kv in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
            let want = plain(&m, kv, &p, 40);
            for k in 1..VERIFY_MAX_ROWS {
                let lookup = Box::new(LookupDrafter { min_n: 1, max_n: 3 });
                let (got, _) = speculative(&m, kv, &p, 40, lookup, k);
                assert_eq!(got, want, "{name} {kv:?} lookup k={k}");
                let noisy = Box::new(Noisy {
                    inner: ModelDrafter::new(&dm, KvDtype::F16, greedy(), v),
                    rng: Rng::new(k as u64),
                    vocab: v as u32,
                });
                let (got, rate) = speculative(&m, kv, &p, 40, noisy, k);
                assert_eq!(got, want, "{name} {kv:?} draft model k={k}");
                assert!(rate < 1.0, "{name} {kv:?} k={k}: every draft accepted, nothing rolled back");
            }
        }
    }
}

/// Every layer's state, bitwise.
fn assert_same_state(a: &Session, b: &Session, what: &str) {
    assert_eq!(a.pos, b.pos, "{what}: position");
    for (i, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        match (x, y) {
            (LayerState::Attn(x), LayerState::Attn(y)) => {
                assert_eq!(x.len(), y.len(), "{what}: layer {i} cached positions");
                for h in 0..x.heads() {
                    assert!(x.rows_f32(h) == y.rows_f32(h), "{what}: layer {i} head {h} keys/values");
                    assert!(x.scales_f32(h) == y.scales_f32(h), "{what}: layer {i} head {h} key and value scales");
                }
            }
            (LayerState::Delta(x), LayerState::Delta(y)) => {
                assert!(x.conv == y.conv, "{what}: layer {i} conv state");
                assert!(x.rec == y.rec, "{what}: layer {i} recurrent state");
            }
            _ => panic!("{what}: layer {i} kinds differ"),
        }
    }
}

#[test]
fn a_committed_pass_equals_a_session_that_saw_only_the_kept_tokens() {
    for name in ["qwen35_tiny", "qwen35_tiny_mm", "llama3_tiny"] {
        let m = fixture(name);
        let v = m.cfg.vocab_size;
        let p = prompt(v);
        let rows = forge_model::generate::synthetic_prompt(v, 40)[30..].to_vec();
        for kv in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
            let mut base = m.new_session_with_kv(kv);
            m.forward(&mut base, &p, Logits::None).unwrap();
            for t in 1..=VERIFY_MAX_ROWS {
                for keep in 0..=t {
                    let mut s = base.clone();
                    s.begin_speculation();
                    let verify = m.forward(&mut s, &rows[..t], Logits::All).unwrap();
                    m.commit(&mut s, keep).unwrap();
                    let mut want = base.clone();
                    let mut decode = Vec::new();
                    for &tok in &rows[..t] {
                        decode.extend(m.forward(&mut want.clone(), &[tok], Logits::All).unwrap());
                        m.forward(&mut want, &[tok], Logits::None).unwrap();
                    }
                    // Rows verified together equal rows decoded one by one, bit for bit.
                    let mut one = base.clone();
                    let each: Vec<f32> =
                        rows[..t].iter().flat_map(|&tok| m.forward(&mut one, &[tok], Logits::All).unwrap()).collect();
                    assert!(verify == each, "{name} {kv:?} T={t}: verify rows differ from decode rows");
                    let mut kept = base.clone();
                    if keep > 0 {
                        m.forward(&mut kept, &rows[..keep], Logits::None).unwrap();
                    }
                    assert_same_state(&s, &kept, &format!("{name} {kv:?} T={t} keep={keep}"));
                    // And it decodes on identically.
                    let a = m.forward(&mut s, &[3], Logits::All).unwrap();
                    let b = m.forward(&mut kept, &[3], Logits::All).unwrap();
                    assert!(a == b, "{name} {kv:?} T={t} keep={keep}: next logits");
                }
            }
        }
    }
    let m = fixture("qwen35_tiny");
    let mut s = m.new_session();
    assert!(m.commit(&mut s, 0).unwrap_err().to_string().contains("without an open speculative pass"));
    s.begin_speculation();
    m.forward(&mut s, &[1, 2], Logits::None).unwrap();
    assert!(m.commit(&mut s, 3).unwrap_err().to_string().contains("cannot keep 3 of the 2"));
}

#[test]
fn stops_and_forced_tokens_inside_an_accepted_run_match_plain_decoding() {
    let m = fixture("qwen35_tiny");
    let v = m.cfg.vocab_size;
    let p = prompt(v);
    let want = plain(&m, KvDtype::F32, &p, 30);
    // generate() stops at a stop id met in the middle of an accepted run.
    let stop = want[17];
    let first = want.iter().position(|&t| t == stop).unwrap();
    let run = |drafter: Option<Box<dyn Drafter + '_>>| {
        let mut s = m.new_session();
        let mut out = Vec::new();
        let st = forge_model::generate::generate_with(
            &m,
            &mut s,
            &p,
            30,
            &mut greedy(),
            &[stop],
            drafter,
            SpecConfig { adaptive: false, ..Default::default() },
            |t| {
                out.push(t);
                Ok(true)
            },
        )
        .unwrap();
        (out, st, s.pos)
    };
    let (plain_ids, plain_st, plain_pos) = run(None);
    let drafter = ModelDrafter::new(&m, KvDtype::F32, greedy(), v);
    let (spec_ids, spec_st, spec_pos) = run(Some(Box::new(drafter)));
    assert_eq!(plain_ids, want[..first]);
    assert_eq!(spec_ids, plain_ids);
    assert_eq!((spec_st.stop_id, spec_pos), (plain_st.stop_id, plain_pos), "the session holds the same tokens");
    assert!(spec_st.spec.accepted > 0);
    // A forced token in the middle of a verified run: the rest is dropped and decoding goes on
    // from the forced token exactly as plain decoding would.
    let forced_at = 5;
    let decode = |drafter: Option<Box<dyn Drafter + '_>>| {
        let mut s = m.new_session();
        let logits = m.forward(&mut s, &p, Logits::Last).unwrap();
        let fixed = SpecConfig { adaptive: false, ..Default::default() };
        let mut d = Decoder::new(&m, &mut s, p.clone(), logits, greedy()).with_drafter(drafter, fixed);
        let mut ids = Vec::new();
        for i in 0..20 {
            if i == forced_at {
                d.next_forced(7).unwrap();
                ids.push(7);
            } else {
                ids.push(d.next_token().unwrap());
            }
        }
        let (fed, last) = d.finish().unwrap();
        (ids, fed, last)
    };
    let a = decode(None);
    let b = decode(Some(Box::new(ModelDrafter::new(&m, KvDtype::F32, greedy(), v))));
    assert_eq!(a.0, b.0, "ids");
    // Each run's session holds a prefix of its context (drafts it fed past the last token taken
    // are kept: they are the context) and the logits after it, as one-by-one decoding gives them.
    for (label, (ids, fed, last)) in [("plain", &a), ("speculative", &b)] {
        let context = [&p[..], &ids[..]].concat();
        assert!(fed.len() >= context.len() - 1 && context.starts_with(fed), "{label}: {} tokens held", fed.len());
        let mut s = m.new_session();
        let mut want = m.forward(&mut s, &p, Logits::Last).unwrap();
        for &t in &fed[p.len()..] {
            want = m.forward(&mut s, &[t], Logits::Last).unwrap();
        }
        assert!(&want == last, "{label}: logits after the held tokens");
    }
}

/// Upper critical value of χ² with `df` degrees of freedom at false-alarm rate 10⁻³
/// (Wilson–Hilferty).
fn chi2_critical_1e3(df: usize) -> f64 {
    let (k, z) = (df as f64, 3.090_232);
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The first speculative token's distribution against plain sampling's, by χ² over the
/// support (bins with expectation under 5 merged), false-alarm rate 10⁻³ per drafter.
#[test]
fn sampled_tokens_follow_the_plain_sampling_distribution() {
    type MakeDrafter<'a> = Box<dyn Fn(u64) -> Box<dyn Drafter + 'a> + 'a>;
    let m = fixture("qwen35_tiny");
    let v = m.cfg.vocab_size;
    let p = prompt(v);
    let params = |seed| SamplingParams { temperature: 1.3, top_k: 12, top_p: 0.97, min_p: 0.0, seed };
    // The drafter: the target itself, sampling colder from fewer candidates (q ≠ p).
    let draft_params = |seed| SamplingParams { temperature: 0.6, top_k: 6, top_p: 1.0, min_p: 0.0, seed };
    let dm = &m;
    // The forced first token, then the distribution of the next one.
    let forced = 5u32;
    let mut s0 = m.new_session();
    let logits0 = m.forward(&mut s0, &p, Logits::Last).unwrap();
    let mut after = s0.clone();
    let next_logits = m.forward(&mut after, &[forced], Logits::Last).unwrap();
    let mut want = Dist::new();
    Sampler::new(params(0)).dist_into(&next_logits, &mut want);
    let likely = want[0].0;
    let unlikely = want.last().unwrap().0;
    struct Fixed(u32);
    impl Drafter for Fixed {
        fn propose(&mut self, _: &[u32], k: usize, d: &mut Draft) -> anyhow::Result<()> {
            d.tokens = vec![self.0; k];
            d.dists.clear();
            Ok(())
        }
        fn name(&self) -> String {
            "fixed".into()
        }
    }
    let n = 3000;
    let cases: Vec<(&str, MakeDrafter)> = vec![
        ("one-hot likely", Box::new(|_| Box::new(Fixed(likely)))),
        ("one-hot unlikely", Box::new(|_| Box::new(Fixed(unlikely)))),
        (
            "one-hot outside the support",
            Box::new(|_| Box::new(Fixed((0..v as u32).find(|t| want.iter().all(|e| e.0 != *t)).unwrap()))),
        ),
        (
            "sampling draft model",
            Box::new(|seed| Box::new(ModelDrafter::new(dm, KvDtype::F32, Sampler::new(draft_params(seed ^ 0xD1)), v))),
        ),
    ];
    for (label, make) in &cases {
        let mut counts = vec![0usize; v];
        for seed in 0..n as u64 {
            let mut s = s0.clone();
            let mut d = Decoder::new(&m, &mut s, p.clone(), logits0.clone(), Sampler::new(params(seed)))
                .with_drafter(Some(make(seed)), SpecConfig { max_draft: 3, adaptive: false });
            d.next_forced(forced).unwrap();
            counts[d.next_token().unwrap() as usize] += 1;
            assert!(d.stats.verifies == 1, "{label}: the second token comes from a verify");
        }
        let (mut chi2, mut df, mut merged_e, mut merged_o) = (0.0, 0usize, 0.0, 0.0);
        let mut seen = 0;
        for &(t, pt) in &want {
            let (e, o) = (pt * n as f64, counts[t as usize] as f64);
            seen += counts[t as usize];
            if e >= 5.0 {
                chi2 += (o - e).powi(2) / e;
                df += 1;
            } else {
                merged_e += e;
                merged_o += o;
            }
        }
        assert_eq!(seen, n, "{label}: a token outside the sampling support was drawn");
        if merged_e > 0.0 {
            chi2 += (merged_o - merged_e).powi(2) / merged_e.max(1e-9);
            df += 1;
        }
        let crit = chi2_critical_1e3(df - 1);
        eprintln!("{label}: χ² {chi2:.1} on {} degrees of freedom (critical {crit:.1})", df - 1);
        assert!(chi2 < crit, "{label}: χ² {chi2:.1} ≥ {crit:.1}");
    }
    // Seeded runs repeat exactly.
    let run = |seed| {
        let mut s = s0.clone();
        let drafter = ModelDrafter::new(dm, KvDtype::F32, Sampler::new(draft_params(seed + 1)), v);
        let mut d = Decoder::new(&m, &mut s, p.clone(), logits0.clone(), Sampler::new(params(seed)))
            .with_drafter(Some(Box::new(drafter)), SpecConfig::default());
        (0..30).map(|_| d.next_token().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(run(9), run(9));
    assert_ne!(run(9), run(10));
}
