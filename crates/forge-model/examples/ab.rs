//! In-process A/B timing of a kernel change on a whole model: prefill `P` tokens and decode `G`,
//! alternating `forge_kernels::experiment::set(0)` and `set(1)` run by run (the order flipped
//! every pair), and reports per variant the median prefill and decode tok/s and the median of
//! the paired ratios (variant 1 ÷ variant 0). With no change reading the switch it measures
//! the machine's noise (an A/A test).
//!
//! `cargo run --release -p forge-model --example ab -- EXPORT [pairs] [P] [G] [KV]`
//! (threads from `RAYON_NUM_THREADS`). With `KV` (`f16` or `v8`), variant 1 also runs with that
//! KV cache type and variant 0 with f32. `EXP=N` sets the switch to N instead of 1 in variant
//! 1's runs (several experiments in one build).

use forge_model::model::Logits;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or_else(|| anyhow::anyhow!("usage: ab EXPORT [pairs] [prompt] [gen]"))?;
    let pairs: usize = args.get(2).map_or(Ok(20), |s| s.parse())?;
    let p: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let g: usize = args.get(4).map_or(Ok(64), |s| s.parse())?;
    let kv1 = args.get(5).map(|s| forge_model::session::KvDtype::parse(s)).transpose()?;
    let exp: usize = std::env::var("EXP").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let set = |v: usize| forge_kernels::experiment::set(v * exp);
    // The KV cache type of variant `v`'s sessions.
    let kv_of = |v: usize| if v == 1 { kv1.unwrap_or_default() } else { forge_model::session::KvDtype::F32 };
    let loaded = forge_model::load::load(std::path::Path::new(path))?;
    let model = &loaded.model;
    let prompt = forge_model::generate::synthetic_prompt(model.cfg.vocab_size, p.max(1));
    let run = |v: usize| -> anyhow::Result<(f64, f64)> {
        let mut sess = model.new_session_with_kv(kv_of(v));
        sess.reserve(prompt.len() + g);
        let t0 = Instant::now();
        let mut logits = model.forward(&mut sess, &prompt, Logits::Last)?;
        let pf = prompt.len() as f64 / t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 0..g {
            let tok = forge_model::sampling::argmax(&logits);
            model.forward_into(&mut sess, &[tok], Logits::Last, &mut logits)?;
        }
        Ok((pf, g as f64 / t1.elapsed().as_secs_f64().max(1e-9)))
    };
    rayon::scope(|_| -> anyhow::Result<()> {
        for v in [0, 1] {
            set(v);
            run(v)?;
        }
        let mut got: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
        for i in 0..pairs {
            for k in 0..2 {
                let v = (i + k) % 2;
                set(v);
                got[v].push(run(v)?);
            }
        }
        set(0);
        for (name, f) in [("prefill", 0usize), ("decode", 1)] {
            let pick = |v: usize| got[v].iter().map(|r| if f == 0 { r.0 } else { r.1 }).collect::<Vec<_>>();
            let (a, b) = (pick(0), pick(1));
            let ratios = a.iter().zip(&b).map(|(x, y)| y / x).collect::<Vec<_>>();
            println!(
                "{name:8} variant 0 {:7.1} tok/s, variant 1 {:7.1} tok/s (medians of {pairs}); paired ratio 1/0 median {:.3}",
                median(a.clone()),
                median(b.clone()),
                median(ratios)
            );
        }
        Ok(())
    })
}
