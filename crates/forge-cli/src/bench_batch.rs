//! `forge bench --batch 1,2,4,8`: aggregate decode speed of several sequences decoded together
//! (continuous batching, [`Model::forward_batch`]) against one sequence, in one run. Each
//! sequence has its own prompt (`--prompt-tokens` synthetic ids, prefilled alone) and decodes
//! `--gen-tokens` greedy tokens; a step feeds one token of every sequence.

use crate::cmd_bench::median;
use anyhow::{bail, Result};
use forge_model::model::{Logits, Model, Step};
use forge_model::Session;
use serde_json::json;
use std::time::Instant;

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Seconds for `gen` batched decode steps of `b` sequences.
fn decode(model: &Model, b: usize, prompt_tokens: usize, gen: usize) -> Result<f64> {
    let v = model.cfg.vocab_size;
    let mut sessions: Vec<Session> = Vec::with_capacity(b);
    let mut next: Vec<Vec<u32>> = Vec::with_capacity(b);
    for i in 0..b {
        let p = forge_model::generate::synthetic_prompt(v, prompt_tokens + i);
        let mut s = model.new_session();
        s.reserve(p.len() + gen);
        let l = model.forward(&mut s, &p[i..], Logits::Last)?;
        next.push(vec![argmax(&l)]);
        sessions.push(s);
    }
    let mut outs = vec![Vec::new(); b];
    let t0 = Instant::now();
    for _ in 0..gen {
        let mut steps: Vec<Step> =
            sessions.iter_mut().zip(&next).map(|(s, t)| Step { session: s, tokens: t, want: Logits::Last }).collect();
        model.forward_batch(&mut steps, &mut outs)?;
        for (n, o) in next.iter_mut().zip(&outs) {
            n[0] = argmax(o);
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

pub struct BatchBench<'a> {
    pub batches: &'a [usize],
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub repeats: usize,
    pub json: bool,
}

pub fn run(model: &Model, a: &BatchBench) -> Result<()> {
    if a.batches.is_empty() || a.batches.contains(&0) {
        bail!("--batch takes stream counts of at least 1, e.g. --batch 1,4,8");
    }
    let mut counts = a.batches.to_vec();
    if !counts.contains(&1) {
        counts.insert(0, 1);
    }
    for l in model.linears() {
        l.prepare();
    }
    // Warm-up (packed layouts, buffers).
    decode(model, counts.iter().copied().max().unwrap_or(1), a.prompt_tokens, 2)?;
    let mut rows = Vec::new();
    for &b in &counts {
        let secs = median(
            (0..a.repeats.max(1))
                .map(|_| decode(model, b, a.prompt_tokens, a.gen_tokens))
                .collect::<Result<Vec<_>>>()?,
        );
        // One more run split by part of the model (timers on: not in the figures above).
        forge_model::profile::enable(true);
        decode(model, b, a.prompt_tokens, a.gen_tokens)?;
        forge_model::profile::enable(false);
        let split: Vec<(String, f64)> = forge_model::profile::totals()
            .into_iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(p, s)| (p.name().to_string(), s * 1e3 / a.gen_tokens as f64))
            .collect();
        rows.push((b, (b * a.gen_tokens) as f64 / secs, secs / a.gen_tokens as f64, split));
    }
    let one = rows[0].1;
    if a.json {
        let r: Vec<_> = rows
            .iter()
            .map(|(b, tok_s, step, split)| {
                let split: serde_json::Map<String, serde_json::Value> =
                    split.iter().map(|(p, ms)| (p.clone(), json!(ms))).collect();
                json!({"streams": b, "tok_s": tok_s, "step_ms": step * 1e3, "vs_one": tok_s / one, "step_ms_by_part": split})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({"batch": r}))?);
        return Ok(());
    }
    println!(
        "{:>8} {:>12} {:>10} {:>14} {:>8}  step ms by part",
        "streams", "agg tok/s", "step ms", "tok/s/stream", "× one"
    );
    for (b, tok_s, step, split) in &rows {
        let parts: Vec<String> = split.iter().map(|(p, ms)| format!("{p} {ms:.2}")).collect();
        println!(
            "{b:>8} {tok_s:>12.1} {:>10.2} {:>14.1} {:>8.2}  {}",
            step * 1e3,
            tok_s / *b as f64,
            tok_s / one,
            parts.join(", ")
        );
    }
    Ok(())
}
