//! `forge bench --context N --fill random`: decode timed at a depth of `N` positions without a
//! prefill of `N` tokens (which on the 27B shape at 131,072 positions would take hours on two
//! cores). Every attention layer's cache gets `N` random rows, and every DeltaNet layer a random
//! recurrent state, of the scale a real prefill leaves: a short real prefill is run first, and
//! each key/value head's channels are drawn with that prefill's per-channel mean and standard
//! deviation (each DeltaNet layer's state with its state's), so that the codes of a quantized
//! cache (v8, kv8) cover the range they would. The rows go into the cache through its ordinary
//! append, rounded or quantized as a real prefill's would be.

use crate::cmd_bench::{median, peak_rss, Probe};
use anyhow::{bail, Result};
use forge_model::model::{Logits, Model};
use forge_model::sampling::Rng;
use forge_model::session::{LayerState, Session};
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

/// Tokens of the real prefill whose caches and states give the statistics.
const STATS_TOKENS: usize = 64;
/// Positions appended to a cache at a time while filling.
const CHUNK: usize = 256;

/// About N(0, 1) from one draw: the sum of four 16-bit uniforms, centred and scaled (Irwin–Hall;
/// tails cut at ±3.46σ, which is all a timing run needs, at a quarter of Box–Muller's cost).
fn normal(rng: &mut Rng) -> f32 {
    let r = rng.next_u64();
    let s: u32 = (0..4).map(|i| ((r >> (16 * i)) & 0xFFFF) as u32).sum();
    // Four U(0, 1) sum to mean 2, variance 1/3.
    (s as f32 / 65536.0 - 2.0) * 3f32.sqrt()
}

/// Per-channel mean and standard deviation of `rows` (`d` values each).
fn channel_stats(rows: &[f32], d: usize) -> (Vec<f32>, Vec<f32>) {
    let n = (rows.len() / d.max(1)).max(1) as f64;
    let (mut sum, mut sq) = (vec![0f64; d], vec![0f64; d]);
    for r in rows.chunks_exact(d) {
        for (c, &x) in r.iter().enumerate() {
            sum[c] += x as f64;
            sq[c] += x as f64 * x as f64;
        }
    }
    let mean: Vec<f32> = sum.iter().map(|s| (s / n) as f32).collect();
    let std = sq.iter().zip(&sum).map(|(q, s)| ((q / n - (s / n).powi(2)).max(0.0)).sqrt() as f32).collect();
    (mean, std)
}

/// A session of `model`'s KV cache type holding `context` random positions (see the module
/// notes), with room for `more` past them.
pub fn filled_session(model: &Model, context: usize, more: usize, seed: u64) -> Result<Session> {
    let v = model.cfg.vocab_size;
    let prompt = forge_model::generate::synthetic_prompt(v, STATS_TOKENS.min(context).max(1));
    let mut real = model.new_session();
    model.forward(&mut real, &prompt, Logits::None)?;
    let (kvh, hd) = (model.cfg.num_kv_heads, model.cfg.head_dim);
    let mut sess = model.new_session();
    sess.reserve(context + more);
    sess.layers.par_iter_mut().zip(&real.layers).enumerate().try_for_each(|(i, (st, src))| -> Result<()> {
        let mut rng = Rng::new(seed ^ (0x9E37_79B9 * (i as u64 + 1)));
        match (st, src) {
            (LayerState::Attn(cache), LayerState::Attn(from)) => {
                // (mean, std) of keys and of values per head, each per channel.
                let stats: Vec<_> = (0..kvh)
                    .map(|h| {
                        let (k, v) = from.rows_f32(h);
                        (channel_stats(&k, hd), channel_stats(&v, hd))
                    })
                    .collect();
                let (mut k, mut val) = (vec![0f32; CHUNK * kvh * hd], vec![0f32; CHUNK * kvh * hd]);
                let mut left = context;
                while left > 0 {
                    let n = left.min(CHUNK);
                    for (buf, pick) in [(&mut k, 0usize), (&mut val, 1)] {
                        for (j, x) in buf[..n * kvh * hd].iter_mut().enumerate() {
                            let (h, c) = (j / hd % kvh, j % hd);
                            let (mean, std) = if pick == 0 { &stats[h].0 } else { &stats[h].1 };
                            *x = mean[c] + std[c] * normal(&mut rng);
                        }
                    }
                    cache.push(&k[..n * kvh * hd], &val[..n * kvh * hd]);
                    left -= n;
                }
            }
            (LayerState::Delta(d), LayerState::Delta(from)) => {
                let n = from.rec.len().max(1) as f64;
                let ms = from.rec.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / n;
                let rms = ms.sqrt() as f32;
                d.rec.iter_mut().for_each(|x| *x = rms * normal(&mut rng));
                d.conv.copy_from_slice(&from.conv);
            }
            _ => bail!("layer {i}: kinds differ"),
        }
        Ok(())
    })?;
    sess.pos = context;
    Ok(sess)
}

/// Greedy decode of `gen` tokens from the filled session, rolled back to `context` after each
/// run (attention rows dropped; DeltaNet states carried on, their scale unchanged).
fn decode_runs(model: &Model, sess: &mut Session, context: usize, gen: usize, runs: usize) -> Result<Vec<f64>> {
    let mut logits = Vec::new();
    let mut rates = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut tok = 1u32;
        let t0 = Instant::now();
        for _ in 0..gen {
            model.forward_into(sess, &[tok], Logits::Last, &mut logits)?;
            tok = forge_model::sampling::argmax(&logits);
        }
        rates.push(gen as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        for l in &mut sess.layers {
            if let LayerState::Attn(c) = l {
                c.truncate(context);
            }
        }
        sess.pos = context;
    }
    Ok(rates)
}

pub struct FillBench<'a> {
    pub path: &'a std::path::Path,
    pub context: usize,
    pub gen_tokens: usize,
    pub repeats: usize,
    pub json: bool,
}

/// Fills, times decode (one untimed warm-up run, then `repeats`; the median), profiles one run
/// more for the split, and reports memory and peak RSS.
pub fn run(model: &Model, b: &FillBench, probe: &Probe) -> Result<()> {
    if b.context > model.cfg.max_position_embeddings {
        eprintln!(
            "forge: warning: --context {} is past the model's {} positions",
            b.context, model.cfg.max_position_embeddings
        );
    }
    for l in model.linears() {
        l.prepare();
    }
    let gen = b.gen_tokens.max(1);
    let t0 = Instant::now();
    let mut sess = filled_session(model, b.context, gen + 1, 0x5EED)?;
    let fill_s = t0.elapsed().as_secs_f64();
    let (rates, split) = rayon::scope(|_| -> Result<_> {
        decode_runs(model, &mut sess, b.context, gen.min(4), 1)?;
        let rates = decode_runs(model, &mut sess, b.context, gen, b.repeats.max(1))?;
        forge_model::profile::enable(true);
        let t = Instant::now();
        decode_runs(model, &mut sess, b.context, gen, 1)?;
        let wall = t.elapsed().as_secs_f64();
        forge_model::profile::enable(false);
        let mut split: Vec<(String, f64)> = forge_model::profile::totals()
            .into_iter()
            .map(|(p, s)| (p.name().to_string(), 1e3 * s / gen as f64))
            .collect();
        let covered: f64 = split.iter().map(|(_, v)| v).sum();
        split.push(("other".into(), (1e3 * wall / gen as f64 - covered).max(0.0)));
        Ok((rates, split))
    })?;
    let decode = median(rates.clone());
    // The machine's read rate next to the runs, for attention's share of it.
    let probe_gb_s = median((0..5).map(|_| probe.pass()).collect());
    let (mut kv, mut kv_used, mut recurrent) = (0usize, 0usize, 0usize);
    for l in &sess.layers {
        match l {
            LayerState::Attn(c) => (kv, kv_used) = (kv + c.capacity_bytes(), kv_used + c.used_bytes()),
            LayerState::Delta(d) => recurrent += (d.conv.len() + d.rec.len()) * 4,
        }
    }
    // The probe's buffer is held by the caller; the model's own peak is what is left.
    let peak = peak_rss().map(|p| p.saturating_sub(probe.bytes() as u64));
    let attn_ms: f64 = split.iter().filter(|(k, _)| k == "attention_core").map(|(_, v)| v).sum();
    let total_ms: f64 = split.iter().map(|(_, v)| v).sum();
    // The bytes of history one token's attention reads: every cached position of every layer.
    let attn_layers = sess.layers.iter().filter(|l| matches!(l, LayerState::Attn(_))).count();
    let per_position = model.kv_dtype().bytes_per_position(model.cfg.head_dim) * model.cfg.num_kv_heads;
    let history_bytes = (attn_layers * per_position * b.context) as f64;
    if b.json {
        let j = json!({
            "model": b.path.display().to_string(),
            "threads": rayon::current_num_threads(),
            "kv_cache_dtype": model.kv_dtype().name(),
            "context": b.context,
            "fill": "random",
            "fill_s": fill_s,
            "gen_tokens": gen,
            "repeats": b.repeats.max(1),
            "decode_tok_s": decode,
            "decode_runs_tok_s": rates,
            "decode_split_ms_per_token": split.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "attention_share": attn_ms / total_ms.max(1e-12),
            "attention_history_gb_s": (attn_ms > 0.0).then(|| history_bytes / (attn_ms * 1e-3) / 1e9),
            "probe_gb_s": probe_gb_s,
            "peak_rss_bytes": peak,
            "memory_bytes": { "kv_cache": kv, "kv_cache_used": kv_used, "recurrent_state": recurrent },
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("model            {}", b.path.display());
        println!("threads          {}", rayon::current_num_threads());
        println!("KV cache         {}", model.kv_dtype().name());
        println!(
            "context          {} positions of random rows at a real prefill's scale (filled in {fill_s:.1} s)",
            b.context
        );
        println!("decode           {decode:.1} tok/s ({gen} tokens, median of {})", b.repeats.max(1));
        let parts: Vec<String> =
            split.iter().map(|(k, v)| format!("{k} {v:.2} ms ({:.0} %)", 100.0 * v / total_ms.max(1e-12))).collect();
        println!("decode split     {} per token", parts.join(", "));
        if attn_ms > 0.0 {
            let gbs = history_bytes / (attn_ms * 1e-3) / 1e9;
            println!(
                "attention        reads {:.1} MiB of history a token: {gbs:.2} GB/s, {:.0} % of the read bandwidth ({probe_gb_s:.2} GB/s, median of 5 probes)",
                history_bytes / (1 << 20) as f64,
                100.0 * gbs / probe_gb_s
            );
        }
        println!(
            "memory           KV cache {:.1} MiB ({:.1} MiB used), recurrent state {:.1} MiB",
            kv as f64 / (1 << 20) as f64,
            kv_used as f64 / (1 << 20) as f64,
            recurrent as f64 / (1 << 20) as f64
        );
        if let Some(p) = peak {
            println!("peak RSS         {:.2} GiB (the probe's buffer left out)", p as f64 / (1u64 << 30) as f64);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_draws_have_about_unit_variance_and_zero_mean() {
        let mut rng = Rng::new(7);
        let xs: Vec<f32> = (0..100_000).map(|_| normal(&mut rng)).collect();
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean}, variance {var}");
        let (m, s) = channel_stats(&[1.0, 10.0, 3.0, 10.0], 2);
        assert_eq!((m, s), (vec![2.0, 10.0], vec![1.0, 0.0]));
    }
}
