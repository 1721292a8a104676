//! `forge bench` for speculative decoding: plain and speculative decode of one prompt in one run,
//! and the cost of one verifying forward against one decode step.

use crate::spec_args::SpecArgs;
use anyhow::{bail, Context, Result};
use forge_model::generate::generate_with;
use forge_model::load::Loaded;
use forge_model::sampling::{Sampler, SamplingParams};
use forge_model::speculative::SpecStats;
use forge_model::{Logits, Model};
use serde_json::json;
use std::path::Path;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The prompt: the file's text as a user turn when the model has a chat template, else as is.
fn prompt_ids(loaded: &Loaded, file: Option<&Path>, prompt_tokens: usize) -> Result<Vec<u32>> {
    let Some(f) = file else {
        return Ok(forge_model::generate::synthetic_prompt(loaded.model.cfg.vocab_size, prompt_tokens));
    };
    let text = std::fs::read_to_string(f).with_context(|| format!("{}: cannot read", f.display()))?;
    let tok = loaded.tokenizer()?;
    match &loaded.template {
        Some(tpl) => {
            let msgs = json!([{"role": "user", "content": text}]);
            tok.encode(&tpl.render(&msgs, None, true, &serde_json::Map::new())?, false)
        }
        None => tok.encode(&text, tok.add_bos()),
    }
}

struct Run {
    ids: Vec<u32>,
    tok_s: f64,
    spec: SpecStats,
    step_s: f64,
}

/// Greedy decode of `gen` tokens after `prompt`; the rate counts every token after prefill.
fn run_once(model: &Model, draft: Option<&Model>, spec: &SpecArgs, prompt: &[u32], gen: usize) -> Result<Run> {
    let params = SamplingParams { temperature: 0.0, ..Default::default() };
    let mut sampler = Sampler::new(params.clone());
    let drafter = if draft.is_some() || spec.lookup {
        spec.drafter(draft, &params, model.cfg.vocab_size, model.kv_dtype())
    } else {
        None
    };
    let mut session = model.new_session();
    session.reserve(prompt.len() + gen + 8);
    let mut ids = Vec::with_capacity(gen);
    let cfg = if drafter.is_some() { spec.config()? } else { Default::default() };
    let st = generate_with(model, &mut session, prompt, gen, &mut sampler, &[], drafter, cfg, |t| {
        ids.push(t);
        Ok(true)
    })?;
    Ok(Run {
        tok_s: st.generated_tokens as f64 / st.decode_s.max(1e-9),
        step_s: st.spec.plain_s / st.spec.plain_steps.max(1) as f64,
        ids,
        spec: st.spec,
    })
}

pub struct SpecBench<'a> {
    pub spec: &'a SpecArgs,
    pub prompt_file: Option<&'a Path>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub repeats: usize,
    pub json: bool,
}

/// Plain and speculative decoding of the same prompt, alternated `repeats` times; medians.
pub fn speculative(model_path: &Path, loaded: &Loaded, b: &SpecBench) -> Result<()> {
    let draft = b.spec.load_draft(model_path)?;
    let model = &loaded.model;
    for l in model.linears().into_iter().chain(draft.iter().flat_map(|d| d.model.linears())) {
        l.prepare();
    }
    let prompt = prompt_ids(loaded, b.prompt_file, b.prompt_tokens)?;
    let none = SpecArgs::default();
    let (mut plain, mut fast) = (Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..b.repeats.max(1) {
        let p = run_once(model, None, &none, &prompt, b.gen_tokens)?;
        let s = run_once(model, draft.as_ref().map(|d| &d.model), b.spec, &prompt, b.gen_tokens)?;
        if p.ids != s.ids {
            bail!("speculative greedy ids differ from plain ones: this is a bug (please report it)");
        }
        plain.push(p.tok_s);
        fast.push(s.tok_s);
        last = Some((p, s));
    }
    let (p, s) = last.expect("one run at least");
    let (pt, st) = (median(plain), median(fast));
    let verify_s = s.spec.verify_s / s.spec.verifies.max(1) as f64;
    let drafter = if b.spec.lookup {
        format!("lookup {}..{}", b.spec.lookup_min, b.spec.lookup_max)
    } else {
        b.spec.draft.clone().unwrap_or_default()
    };
    if b.json {
        let j = json!({
            "model": model_path.display().to_string(),
            "drafter": drafter,
            "threads": rayon::current_num_threads(),
            "prompt_tokens": prompt.len(),
            "gen_tokens": b.gen_tokens,
            "repeats": b.repeats,
            "draft_tokens": b.spec.draft_tokens,
            "adaptive": !b.spec.fixed_draft,
            "plain_decode_tok_s": pt,
            "spec_decode_tok_s": st,
            "speedup": st / pt,
            "acceptance_rate": s.spec.acceptance_rate(),
            "tokens_per_verify": s.spec.tokens_per_verify(),
            "drafted": s.spec.drafted,
            "accepted": s.spec.accepted,
            "verifies": s.spec.verifies,
            "plain_steps": s.spec.plain_steps,
            "draft_s": s.spec.draft_s,
            "verify_s": verify_s,
            "decode_step_s": p.step_s,
            "verify_over_decode": verify_s / p.step_s.max(1e-12),
            "identical_ids": true,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("model      {}", model_path.display());
        println!("drafter    {drafter} (up to {} tokens, adaptive: {})", b.spec.draft_tokens, !b.spec.fixed_draft);
        println!("prompt     {} tokens, {} generated (greedy; ids identical to plain)", prompt.len(), b.gen_tokens);
        println!("plain      {pt:.2} tok/s");
        println!("speculative {st:.2} tok/s  ({:.2}×)", st / pt);
        println!(
            "acceptance {:.1} % ({} of {} drafts), {:.2} tokens per verify, {} verifies, {} plain steps",
            100.0 * s.spec.acceptance_rate(),
            s.spec.accepted,
            s.spec.drafted,
            s.spec.tokens_per_verify(),
            s.spec.verifies,
            s.spec.plain_steps
        );
        println!(
            "verify     {:.2} ms against {:.2} ms a decode step ({:.2}×); drafting {:.1} ms in all",
            verify_s * 1e3,
            p.step_s * 1e3,
            verify_s / p.step_s.max(1e-12),
            s.spec.draft_s * 1e3
        );
    }
    Ok(())
}

/// The time of one forward over `rows` new tokens against one over a single token, at the
/// same position after a prompt, each rolled back after it is timed.
pub fn verify_cost(
    model_path: &Path,
    model: &Model,
    rows: usize,
    prompt_tokens: usize,
    repeats: usize,
    json_out: bool,
) -> Result<()> {
    if !(1..=forge_model::model::VERIFY_MAX_ROWS).contains(&rows) {
        bail!("--verify-tokens {rows}: must be 1 to {}", forge_model::model::VERIFY_MAX_ROWS);
    }
    for l in model.linears() {
        l.prepare();
    }
    let v = model.cfg.vocab_size;
    let prompt = forge_model::generate::synthetic_prompt(v, prompt_tokens.max(1) + rows);
    let (ctx, tail) = prompt.split_at(prompt.len() - rows);
    let mut s = model.new_session();
    s.reserve(prompt.len() + 1);
    model.forward(&mut s, ctx, Logits::None)?;
    let mut out = Vec::new();
    // A decode step on a copy of the session; a verify with its rollback snapshot counted (the
    // journal's copy of every DeltaNet state) and then taken back.
    let mut time = |n: usize| -> Result<f64> {
        if n == 1 {
            let mut c = s.clone();
            let t0 = Instant::now();
            model.forward_into(&mut c, &tail[..1], Logits::Last, &mut out)?;
            return Ok(t0.elapsed().as_secs_f64());
        }
        let t0 = Instant::now();
        s.begin_speculation();
        model.forward_into(&mut s, &tail[..n], Logits::All, &mut out)?;
        let dt = t0.elapsed().as_secs_f64();
        model.commit(&mut s, 0)?;
        Ok(dt)
    };
    time(1)?;
    time(rows)?;
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(3) {
        one.push(time(1)?);
        many.push(time(rows)?);
    }
    let (a, b) = (median(one), median(many));
    if json_out {
        let j = json!({
            "model": model_path.display().to_string(),
            "threads": rayon::current_num_threads(),
            "context_tokens": ctx.len(),
            "verify_tokens": rows,
            "decode_step_s": a,
            "verify_s": b,
            "verify_over_decode": b / a,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("model   {}", model_path.display());
        println!("context {} tokens", ctx.len());
        println!("decode  {:.2} ms (one token)", a * 1e3);
        println!("verify  {:.2} ms ({rows} tokens, {:.2}× one)", b * 1e3, b / a);
    }
    Ok(())
}
