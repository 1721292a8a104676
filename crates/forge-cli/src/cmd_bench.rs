//! `forge bench`: prefill and decode speed of a model, weight bytes per token, effective GB/s
//! next to the machine's read bandwidth measured in the same run, and memory by category;
//! `--kernels`: GB/s of each packed matrix kernel against its scalar reference; `--quantize-stages`:
//! GFLOP/s of the quantizer's heavy stages against the FMA peak.

use anyhow::Result;
use forge_kernels::lut::{synthetic, Format, Synthetic};
use forge_kernels::lutmm::{self, Backend, PackedMatrix};
use forge_model::linear::{Linear, LowRank, Weight};
use forge_model::model::{Embedding, Logits, Model};
use forge_model::session::{LayerState, Session};
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Model: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Runs per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Size of the buffer for the read-bandwidth probe, GiB (a pass runs before each timed run,
    /// and the buffer is held through them).
    #[arg(long, default_value_t = 1.0)]
    bandwidth_gib: f64,
    /// Also measure the reference (decode-to-f32) path in the same run.
    #[arg(long)]
    reference: bool,
    /// Kernel microbenchmark (2048×2048 per format) instead of a model.
    #[arg(long)]
    kernels: bool,
    /// The heavy stages of `forge quantize` (calibration forward, Hessian, H⁻¹ factor, GPTQ
    /// sweep) on one matrix of --shape, each as GFLOP/s against the FMA peak of every thread.
    #[arg(long, conflicts_with = "kernels")]
    quantize_stages: bool,
    /// Matrix shape for --kernels and --quantize-stages, OUTxIN (e.g. 17408x5120, a 27B MLP matrix; each case cycles
    /// through copies of it adding up to four times the last-level cache, at least 512 MiB, so
    /// that the weights come from memory, not cache)
    #[arg(long, default_value = "2048x2048")]
    shape: String,
    #[arg(long)]
    json: bool,
    /// With --lookup or --draft: the prompt, as a user turn when the model has a chat
    /// template (default: --prompt-tokens synthetic ids).
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<std::path::PathBuf>,
    /// Time one forward over N new tokens (a speculative verification) against one decode step.
    #[arg(long, value_name = "N")]
    verify_tokens: Option<usize>,
    /// With --fill: time decode after N positions of context, held in the caches without a
    /// prefill of N tokens.
    #[arg(long, value_name = "N", requires = "fill")]
    context: Option<usize>,
    /// How --context's positions are made: `random`, rows of a real prefill's per-channel scale
    /// in every attention layer's cache and a random state of its scale in every DeltaNet layer.
    #[arg(long, value_parser = ["random"], requires = "context")]
    fill: Option<String>,
    /// Decode this many sequences together (a comma list, e.g. 1,4,8): aggregate tok/s against
    /// one sequence, in one run.
    #[arg(long, value_name = "N,...", value_delimiter = ',')]
    batch: Vec<usize>,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
}

pub fn run(a: Args) -> Result<()> {
    let threads = rayon::current_num_threads();
    let probe = Probe::new(a.bandwidth_gib);
    if a.quantize_stages {
        let (cout, cin) = parse_shape(&a.shape)?;
        let b = crate::bench_quant::StageBench { cout, cin, repeats: a.repeats, json: a.json };
        return crate::bench_quant::run(&b);
    }
    if a.kernels {
        return kernels(&a, threads, &probe);
    }
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let mut loaded = forge_model::load::load(&path)?;
    crate::configure(&mut loaded.model);
    let model = &loaded.model;
    if let Some(context) = a.context {
        let b = crate::bench_fill::FillBench {
            path: &path,
            context,
            gen_tokens: a.gen_tokens,
            repeats: a.repeats,
            json: a.json,
        };
        return crate::bench_fill::run(model, &b, &probe);
    }
    if !a.batch.is_empty() {
        let b = crate::bench_batch::BatchBench {
            batches: &a.batch,
            prompt_tokens: a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            repeats: a.repeats,
            json: a.json,
        };
        return crate::bench_batch::run(model, &b);
    }
    if let Some(n) = a.verify_tokens {
        return crate::bench_spec::verify_cost(&path, model, n, a.prompt_tokens, a.repeats, a.json);
    }
    if a.spec.enabled() {
        let b = crate::bench_spec::SpecBench {
            spec: &a.spec,
            prompt_file: a.prompt_file.as_deref(),
            prompt_tokens: a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            repeats: a.repeats,
            json: a.json,
        };
        return crate::bench_spec::speculative(&path, &loaded, &b);
    }
    let t0 = Instant::now();
    for l in model.linears() {
        l.prepare();
    }
    let prepare_s = t0.elapsed().as_secs_f64();
    let bytes_per_token: usize = model.linears().iter().map(|l| l.weight_bytes()).sum();
    let wprobe = WeightProbe::new(model);
    let fast = measure(model, &a, Some((&probe, &wprobe)))?;
    let reference = if a.reference {
        lutmm::set_fast_path(false);
        let r = measure(model, &a, None);
        lutmm::set_fast_path(true);
        Some(r?)
    } else {
        None
    };
    let split = decode_split(model, &a)?;
    let page_rates = part_page_rates(model, 5);
    let mem = fast.memory;
    let eff = |tok_s: f64| bytes_per_token as f64 * tok_s / 1e9;
    // Each paired token's weight bytes over its time, against the mean of the probe passes
    // just before and just after it.
    let bw = median(fast.bandwidth.clone());
    let against = |probes: &[f64]| {
        median(
            fast.paired
                .iter()
                .zip(probes.windows(2))
                .map(|(&secs, b)| bytes_per_token as f64 / secs / 1e9 / ((b[0] + b[1]) / 2.0))
                .collect(),
        )
    };
    let fraction = against(&fast.bandwidth);
    let weights_read =
        (!fast.weights_bw.is_empty()).then(|| (median(fast.weights_bw.clone()), against(&fast.weights_bw)));
    // The probe's buffer is held through the runs; the model's own peak is what is left.
    let peak = peak_rss().map(|p| p.saturating_sub(probe.bytes() as u64));
    let gb = |b: usize| b as f64 / (1u64 << 30) as f64;
    if a.json {
        let mut j = json!({
            "model": path.display().to_string(),
            "threads": threads,
            "isa": forge_kernels::lutmm::intdot::isa(),
            "prefill_kernels": forge_kernels::lutmm::intdot::prefill_isa(),
            "dot_rates_per_s": forge_kernels::simd::dot_rates().map(|(f, d)| json!({ "f32_fma": f, "vpdpbusd": d })),
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "repeats": a.repeats,
            "prefill_tok_s": fast.prefill,
            "decode_tok_s": fast.decode,
            "weight_bytes_per_token": bytes_per_token,
            "effective_gb_s": eff(fast.decode),
            "bandwidth_gb_s": bw,
            "bandwidth_fraction": fraction,
            "bandwidth_runs_gb_s": fast.bandwidth,
            "bandwidth_paired_tokens": fast.paired.len(),
            "weights_read_gb_s": weights_read.map(|w| w.0),
            "weights_read_fraction": weights_read.map(|w| w.1),
            "weights_read_runs_gb_s": fast.weights_bw,
            "pack_s": prepare_s,
            "peak_rss_bytes": peak,
            "decode_split_ms_per_token": split.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "decode_split_pages_gb_s": page_rates.iter().map(|(k, r)| (k.clone(), json!(r))).collect::<serde_json::Map<_, _>>(),
            "decode_split_weight_bytes": part_weight_bytes(model).into_iter().map(|(k, b)| (k, json!(b))).collect::<serde_json::Map<_, _>>(),
            "memory_bytes": {
                "weights": mem.weights,
                "packed": mem.packed,
                "kv_cache": mem.kv,
                "kv_cache_used": mem.kv_used,
                "recurrent_state": mem.recurrent,
                "scratch": mem.scratch,
            },
            "kv_cache_dtype": model.kv_dtype().name(),
            "decode_allocations_per_token": fast.allocs_per_token,
        });
        if let Some(r) = &reference {
            j["reference"] = json!({ "prefill_tok_s": r.prefill, "decode_tok_s": r.decode });
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("model            {}", path.display());
        println!("threads          {threads}");
        println!("kernels          {}", forge_kernels::lutmm::intdot::isa());
        match forge_kernels::simd::dot_rates() {
            Some((f, d)) => println!(
                "prefill kernels  {} (one core: f32 FMA {:.0}, vpdpbusd {:.0} G multiply-adds/s)",
                forge_kernels::lutmm::intdot::prefill_isa(),
                f / 1e9,
                d / 1e9
            ),
            None => println!("prefill kernels  {}", forge_kernels::lutmm::intdot::prefill_isa()),
        }
        println!("KV cache         {}", model.kv_dtype().name());
        println!("prompt/gen       {} / {} tokens, median of {}", a.prompt_tokens, a.gen_tokens, a.repeats);
        println!("prefill          {:.1} tok/s", fast.prefill);
        println!("decode           {:.1} tok/s", fast.decode);
        if let Some(r) = &reference {
            println!(
                "reference path   prefill {:.1} tok/s, decode {:.1} tok/s (fast path ×{:.2} decode)",
                r.prefill,
                r.decode,
                fast.decode / r.decode
            );
        }
        println!("weights/token    {:.1} MB", bytes_per_token as f64 / 1e6);
        println!(
            "effective        {:.2} GB/s; {:.0} % of the read bandwidth{} (medians over {} tokens, each timed between two passes of each probe and set against their mean)",
            eff(fast.decode),
            100.0 * fraction,
            weights_read.map_or(String::new(), |w| format!(", {:.0} % of its weights' own read rate", 100.0 * w.1)),
            fast.paired.len()
        );
        println!(
            "read bandwidth   {bw:.2} GB/s, median of {} probes ({} threads, {:.2} GiB buffer){}",
            fast.bandwidth.len(),
            threads,
            a.bandwidth_gib,
            weights_read.map_or(String::new(), |w| format!(
                "; the weights' own pages {:.2} GB/s (a pass over the packed matrices, as the kernels read them)",
                w.0
            ))
        );
        println!("packing          {prepare_s:.2} s");
        if let Some(p) = peak {
            println!(
                "peak RSS         {:.2} GiB (mapped files count as they are touched; the probe's buffer left out)",
                gb(p as usize)
            );
        }
        let total: f64 = split.iter().map(|(_, v)| v).sum();
        let part_bytes = part_weight_bytes(model);
        let parts: Vec<String> = split
            .iter()
            .map(|(k, v)| {
                // A part's weight bytes over its time, next to the probe: where decode falls short.
                let rate =
                    part_bytes.iter().find(|(p, b)| p == k && *b > 0 && *v > 0.0).map_or(String::new(), |(_, b)| {
                        let gbs = *b as f64 / (v * 1e-3) / 1e9;
                        // Against the part's own pages: memory speed differs with where pages lie.
                        let own = page_rates
                            .iter()
                            .find(|(p, _)| p == k)
                            .map_or(String::new(), |(_, r)| format!(", {:.0} % of its pages' {r:.1}", 100.0 * gbs / r));
                        format!(", {gbs:.1} GB/s{own}")
                    });
                // The delta rule reads and writes every layer's recurrent state once a token.
                let rate = if k == "deltanet_core" && mem.recurrent > 0 && *v > 0.0 {
                    format!(", state {:.1} GB/s", 2.0 * mem.recurrent as f64 / (v * 1e-3) / 1e9)
                } else {
                    rate
                };
                format!("{k} {v:.2} ms ({:.0} %{rate})", 100.0 * v / total.max(1e-12))
            })
            .collect();
        println!("decode split     {} per token", parts.join(", "));
        println!(
            "memory           weights {:.3} GiB, packed {:.3} GiB, KV cache {:.1} MiB ({:.1} MiB used), recurrent state {:.1} MiB, scratch {:.1} MiB",
            gb(mem.weights),
            gb(mem.packed),
            mem.kv as f64 / (1 << 20) as f64,
            mem.kv_used as f64 / (1 << 20) as f64,
            mem.recurrent as f64 / (1 << 20) as f64,
            mem.scratch as f64 / (1 << 20) as f64
        );
        println!("heap allocations {:.2} per decoded token (timed runs)", fast.allocs_per_token);
    }
    Ok(())
}

/// Peak resident set size of this process (Linux `VmHWM`), bytes.
pub(crate) fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

struct Speeds {
    prefill: f64,
    decode: f64,
    /// Seconds of each token decoded between two probe passes, and the passes' GB/s, one more
    /// than tokens (all empty without a probe), of the buffer and of the weights.
    paired: Vec<f64>,
    bandwidth: Vec<f64>,
    weights_bw: Vec<f64>,
    /// Heap allocations per token in the timed decode loops.
    allocs_per_token: f64,
    /// Memory after the last timed run (its session dropped before the next is made, so that
    /// peak RSS counts one session's caches).
    memory: Memory,
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Prefill `prompt_tokens` synthetic tokens, then greedy-decode `gen_tokens`; median over repeats
/// after one untimed warm-up. With `probe`, then as many tokens again (at least 8) decoded one
/// at a time between passes of it: on a shared machine the bandwidth can move by half within
/// seconds (the 27B shape's runs saw 33, 51 and 50 GB/s in three passes a run apart), so a
/// token is set against the passes on either side of it, not against one taken a run before.
fn measure(model: &Model, a: &Args, probe: Option<(&Probe, &WeightProbe)>) -> Result<Speeds> {
    let prompt = forge_model::generate::synthetic_prompt(model.cfg.vocab_size, a.prompt_tokens.max(1));
    let once = |gen: usize| -> Result<(f64, f64, u64, Session)> {
        // The caches are sized for the whole run up front, as llama.cpp sizes its context:
        // neither prefill nor decode times a cache growing.
        let mut sess = model.new_session();
        sess.reserve(prompt.len() + gen);
        let t0 = Instant::now();
        let logits = model.forward(&mut sess, &prompt, Logits::Last)?;
        let prefill = prompt.len() as f64 / t0.elapsed().as_secs_f64();
        let mut tok = forge_model::sampling::argmax(&logits);
        let mut logits = logits;
        let allocs0 = forge_kernels::scratch::allocations();
        let t1 = Instant::now();
        for _ in 0..gen {
            model.forward_into(&mut sess, &[tok], Logits::Last, &mut logits)?;
            tok = forge_model::sampling::argmax(&logits);
        }
        let decode = gen as f64 / t1.elapsed().as_secs_f64().max(1e-9);
        Ok((prefill, decode, forge_kernels::scratch::allocations() - allocs0, sess))
    };
    // All runs on one pool worker, as a server's decode loop runs, instead of each token being
    // handed to the pool from outside (and each run warming another worker's scratch).
    let (p, d, paired, bw, wbw, allocs, last) = rayon::scope(|_| -> Result<_> {
        once(4)?;
        let (mut p, mut d, mut allocs, mut last): (_, _, _, Option<Memory>) = (Vec::new(), Vec::new(), 0, None);
        for _ in 0..a.repeats.max(1) {
            let (pf, dc, n, sess) = once(a.gen_tokens)?;
            p.push(pf);
            d.push(dc);
            allocs += n;
            last = Some(memory(model, &sess));
        }
        let (mut paired, mut bw, mut wbw) = (Vec::new(), Vec::new(), Vec::new());
        if let Some((probe, wprobe)) = probe {
            let n = (a.repeats.max(1) * a.gen_tokens).max(8);
            let mut sess = model.new_session();
            sess.reserve(prompt.len() + n);
            let mut logits = model.forward(&mut sess, &prompt, Logits::Last)?;
            let mut passes = || {
                bw.push(probe.pass());
                if !wprobe.is_empty() {
                    wbw.push(wprobe.pass());
                }
            };
            passes();
            for _ in 0..n {
                let tok = forge_model::sampling::argmax(&logits);
                let t0 = Instant::now();
                model.forward_into(&mut sess, &[tok], Logits::Last, &mut logits)?;
                paired.push(t0.elapsed().as_secs_f64().max(1e-9));
                passes();
            }
        }
        Ok((p, d, paired, bw, wbw, allocs, last))
    })?;
    let tokens = (a.repeats.max(1) * a.gen_tokens).max(1) as f64;
    Ok(Speeds {
        prefill: median(p),
        decode: median(d),
        paired,
        bandwidth: bw,
        weights_bw: wbw,
        allocs_per_token: allocs as f64 / tokens,
        memory: last.expect("one repeat"),
    })
}

/// Decode time per token by part (ms), from one profiled run after the timed ones; `other` is
/// what the parts do not cover (sampling, the loop).
fn decode_split(model: &Model, a: &Args) -> Result<Vec<(String, f64)>> {
    use forge_model::profile;
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt_tokens.max(1) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut sess = model.new_session();
    let mut logits = model.forward(&mut sess, &prompt, Logits::Last)?;
    let mut tok = forge_model::sampling::argmax(&logits);
    let n = a.gen_tokens.max(1);
    sess.reserve(n);
    profile::enable(true);
    let t0 = Instant::now();
    for _ in 0..n {
        model.forward_into(&mut sess, &[tok], Logits::Last, &mut logits)?;
        tok = forge_model::sampling::argmax(&logits);
    }
    let wall = t0.elapsed().as_secs_f64();
    profile::enable(false);
    let mut out: Vec<(String, f64)> =
        profile::totals().into_iter().map(|(p, s)| (p.name().to_string(), 1e3 * s / n as f64)).collect();
    let covered: f64 = out.iter().map(|(_, v)| v).sum();
    out.push(("other".into(), (1e3 * wall / n as f64 - covered).max(0.0)));
    Ok(out)
}

/// The matrices of each part of the decode split that reads weights (the names of
/// `forge_model::profile::Part`).
fn part_linears(model: &Model) -> Vec<(&'static str, Vec<&Linear>)> {
    use forge_model::model::Mixer;
    let (mut attn, mut delta, mut mlp) = (Vec::new(), Vec::new(), Vec::new());
    for l in &model.layers {
        match &l.mixer {
            Mixer::Attention(a) => attn.extend([&a.q, &a.k, &a.v, &a.o]),
            Mixer::DeltaNet(d) => delta.extend([&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out]),
        }
        mlp.extend([&l.mlp.gate, &l.mlp.up, &l.mlp.down]);
    }
    vec![("attention", attn), ("deltanet", delta), ("mlp", mlp), ("head", vec![&model.head])]
}

/// Weight bytes a decoded token reads per part of the decode split.
fn part_weight_bytes(model: &Model) -> Vec<(String, usize)> {
    part_linears(model).into_iter().map(|(k, ls)| (k.to_string(), ls.iter().map(|l| l.weight_bytes()).sum())).collect()
}

/// Each part's own pages read by [`WeightProbe::pass`], GB/s: the median of `rounds` passes,
/// the parts taken in turn in each round (parts without integer-dot matrices left out).
fn part_page_rates(model: &Model, rounds: usize) -> Vec<(String, f64)> {
    let probes: Vec<(&str, WeightProbe)> = part_linears(model)
        .into_iter()
        .map(|(k, ls)| (k, WeightProbe::of(&ls)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    let mut runs = vec![Vec::with_capacity(rounds); probes.len()];
    for _ in 0..rounds {
        for (r, (_, p)) in runs.iter_mut().zip(&probes) {
            r.push(p.pass());
        }
    }
    probes.iter().zip(runs).map(|((k, _), r)| (k.to_string(), median(r))).collect()
}

struct Memory {
    weights: usize,
    packed: usize,
    /// KV cache pages held (reserved room included), and the bytes of the positions stored.
    kv: usize,
    kv_used: usize,
    recurrent: usize,
    /// Pooled work buffers and kept activation quantizations of all threads.
    scratch: usize,
}

fn stored_bytes(l: &Linear) -> usize {
    let w = match &l.weight {
        Weight::Dense(t) => t.numel() * t.dtype().size(),
        Weight::Lut(m) => m.idx.len() + 4 * (m.codebook.len() + m.scale.len()),
        Weight::Int8(m) => m.q.len() + 4 * m.scale.len(),
        Weight::Packed(_) => 0,
        Weight::Gguf(m) => m.stored_bytes(),
    };
    w + l.lowrank.as_ref().map_or(0, LowRank::bytes)
}

fn memory(model: &Model, sess: &Session) -> Memory {
    let lin = model.linears();
    // A float table tied to a float head is the same matrix, counted once (with the head).
    let embed = match &model.embed {
        Embedding::Table(t) if !(model.cfg.tie_embeddings && matches!(model.head.weight, Weight::Dense(_))) => {
            t.numel() * t.dtype().size()
        }
        // A tied table is the head's matrix, counted with it.
        Embedding::Blocks(m) if !model.cfg.tie_embeddings => m.stored_bytes(),
        _ => 0,
    };
    let weights = lin.iter().map(|l| stored_bytes(l)).sum::<usize>() + embed;
    let packed =
        lin.iter().filter(|l| !matches!(l.weight, Weight::Dense(_) | Weight::Gguf(_))).map(|l| l.weight_bytes()).sum();
    let (mut kv, mut kv_used, mut recurrent) = (0, 0, 0);
    for l in &sess.layers {
        match l {
            LayerState::Attn(c) => (kv, kv_used) = (kv + c.capacity_bytes(), kv_used + c.used_bytes()),
            LayerState::Delta(d) => recurrent += (d.conv.len() + d.rec.len()) * 4,
        }
    }
    Memory { weights, packed, kv, kv_used, recurrent, scratch: forge_kernels::scratch::held_bytes() }
}

/// Multi-threaded read bandwidth: sums a buffer in several streams per worker, with software
/// prefetch as the kernels use it.
/// The buffer is kept so that the probe can run between timed runs: on a shared machine the
/// bandwidth drifts by a third within minutes, so a kernel's share of it is only meaningful
/// against a probe taken next to it.
pub struct Probe {
    buf: Vec<u64>,
}

impl Probe {
    /// A probe over `gib` GiB (at least 8 MiB), its pages touched.
    pub fn new(gib: f64) -> Probe {
        let n = ((gib * (1u64 << 30) as f64) as usize / 8).max(1 << 20);
        let mut buf = vec![0u64; n];
        buf.par_chunks_mut(1 << 16)
            .enumerate()
            .for_each(|(i, c)| c.iter_mut().enumerate().for_each(|(j, v)| *v = (i ^ j) as u64));
        Probe { buf }
    }

    /// Bytes of the buffer.
    pub fn bytes(&self) -> usize {
        self.buf.len() * 8
    }

    /// One pass over the buffer, GB/s: [`PROBE_TASK`]-byte pieces claimed in turn by the
    /// workers of a spinning team (as decode's kernel calls are run), each summed as
    /// [`STREAMS`] segments in lockstep, prefetched as the kernels prefetch their rows, with the
    /// widest loads the CPU has (`forge_kernels::stream`). Claimed pieces, not one fixed share
    /// a worker, so that a core slowed by a neighbour does not leave the other idle at the end.
    pub fn pass(&self) -> f64 {
        // Whole 64-byte lines per segment.
        let seg = (PROBE_TASK / 8 / STREAMS) & !7;
        let tasks = self.buf.len() / (STREAMS * seg);
        claimed_pass(tasks, &|k| {
            (forge_kernels::stream::sum_streams(&self.buf[k * STREAMS * seg..], STREAMS, seg), STREAMS * seg * 8)
        })
    }
}

/// GB/s of `tasks` pieces claimed in turn by the workers of a spinning team, piece `k` read by
/// `read(k)` (its sum, kept from the optimizer, and the bytes it read).
fn claimed_pass(tasks: usize, read: &(dyn Fn(usize) -> (u64, usize) + Sync)) -> f64 {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    let (sink, bytes) = (AtomicU64::new(0), AtomicUsize::new(0));
    let secs = forge_kernels::team::with_team(|| {
        let t0 = Instant::now();
        forge_kernels::team::parallel_for(tasks, &|k| {
            let (v, n) = read(k);
            sink.fetch_add(v, Ordering::Relaxed);
            bytes.fetch_add(n, Ordering::Relaxed);
        });
        t0.elapsed().as_secs_f64()
    });
    std::hint::black_box(sink.load(Ordering::Relaxed));
    bytes.load(Ordering::Relaxed) as f64 / secs / 1e9
}

/// A probe over the model's own packed weights: every integer-dot matrix's index rows, in the
/// order decode reads them, cut into [`PROBE_TASK`]-byte pieces claimed by the team's workers
/// and read as [`Probe::pass`] reads its buffer: where the weights lie (a memory-mapped cache in
/// the page cache, or this process's memory) might read at another speed than a fresh buffer,
/// and decode can be no faster than a plain pass over its own bytes. (On the 2-vCPU Zen 4 the
/// two probes agreed within 1–4 % on the 27B shape, through phases of 32 and of 50 GB/s.)
pub struct WeightProbe {
    mats: Vec<std::sync::Arc<PackedMatrix>>,
    /// Matrix, and the byte range of its index rows.
    pieces: Vec<(usize, std::ops::Range<usize>)>,
}

impl WeightProbe {
    pub fn new(model: &Model) -> WeightProbe {
        WeightProbe::of(&model.linears())
    }

    /// A probe over the integer-dot matrices of `linears`, in that order.
    pub fn of(linears: &[&Linear]) -> WeightProbe {
        WeightProbe::of_matrices(linears.iter().filter_map(|l| l.packed.get(&l.weight)))
    }

    /// A probe over the index rows of `matrices` (those in the integer-dot layout), in order.
    pub fn of_matrices(matrices: impl IntoIterator<Item = std::sync::Arc<PackedMatrix>>) -> WeightProbe {
        let (mut mats, mut pieces) = (Vec::new(), Vec::new());
        for p in matrices {
            let Some(n) = p.index_bytes().map(<[u8]>::len) else { continue };
            pieces.extend((0..n).step_by(PROBE_TASK).map(|s| (mats.len(), s..(s + PROBE_TASK).min(n))));
            mats.push(p);
        }
        WeightProbe { mats, pieces }
    }

    /// Whether there is anything to read (a model without integer-dot matrices has not).
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// One pass over the weights, GB/s of the bytes read.
    pub fn pass(&self) -> f64 {
        claimed_pass(self.pieces.len(), &|k| {
            let (m, r) = &self.pieces[k];
            let bytes = &self.mats[*m].index_bytes().expect("an integer-dot matrix")[r.clone()];
            forge_kernels::stream::sum_bytes(bytes, STREAMS)
        })
    }
}

/// Bytes of one probe task: 4 MiB, 1 MiB a stream; at 100 GB/s a task takes 40 µs, far longer
/// than claiming it.
const PROBE_TASK: usize = 4 << 20;

/// Sequential streams each probe worker reads at once. One stream a core read 22–24 GB/s on the
/// 2-vCPU Xeon, two 26–33, four 30–38 and eight 33–37 (a C loop of 512-bit loads, three runs):
/// the memory system needs several streams in flight per core to deliver its bandwidth, and
/// a probe with one measured a third less than the machine gives.
const STREAMS: usize = 4;

/// Bytes of matrix copies each kernel case cycles through: four times the last-level cache
/// (at least 512 MiB), so that each call reads its weights from memory. A fixed 512 MiB was
/// several times the Xeons' 105 MiB L3, but about the 480 MiB reported by a later one.
fn cold_bytes() -> usize {
    (4 * last_level_cache_bytes().unwrap_or(0)).max(512 << 20)
}

/// The largest cache size Linux reports for CPU 0 (`/sys/devices/system/cpu/cpu0/cache/index*/
/// size`, e.g. `491520K`), if any.
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(s.trim()))
        .max()
}

/// `"491520K"`, `"32M"` or `"512"` (bytes) as bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

fn parse_shape(shape: &str) -> Result<(usize, usize)> {
    shape
        .split_once('x')
        .and_then(|(o, i)| Some((o.parse::<usize>().ok()?, i.parse::<usize>().ok()?)))
        .filter(|&(o, i)| o > 0 && i > 0 && o % 2 == 0)
        .ok_or_else(|| anyhow::anyhow!("--shape {shape:?}: expected OUTxIN with an even OUT, e.g. 2048x2048"))
}

fn kernels(a: &Args, threads: usize, probe: &Probe) -> Result<()> {
    let (cout, cin) = parse_shape(&a.shape)?;
    let mut s = 1u64;
    let mut rnd = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let x: Vec<f32> = (0..cin).map(|_| (rnd() % 2000) as f32 / 1000.0 - 1.0).collect();
    let cold = cold_bytes();
    let mut rows = Vec::new();
    let mut probes = Vec::new();
    // Each format in the integer-dot layout (codebooks on the 8-bit grid, as the quantizer
    // writes them) and in the float tile layout (any codebook).
    let mut cases: Vec<(Format, bool)> = Vec::new();
    for f in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        cases.push((f, true));
    }
    for f in [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Int8] {
        cases.push((f, false));
    }
    for (f, int_dot) in cases {
        let p = match (synthetic(f, cout, cin, 0x5eed), int_dot) {
            (Synthetic::Int8(m), true) => PackedMatrix::from_int8(&m),
            (Synthetic::Int8(m), false) => PackedMatrix::tiles_from_int8(&m),
            (Synthetic::Lut(m), true) => PackedMatrix::from_lut(&m),
            (Synthetic::Lut(m), false) => PackedMatrix::tiles_from_lut(&m),
        };
        anyhow::ensure!(p.is_int_dot() == int_dot, "{}: unexpected kernel layout", f.name());
        let bytes = p.packed_bytes() as f64;
        // Copies of the matrix, called in turn, so that each call reads its weights from memory
        // as a model's layers do: one 17408×5120 matrix (22–89 MB) fits in a large last-level
        // cache (105 MiB on one Xeon, 480 MiB on another), and calling it alone measured cache.
        let ps: Vec<std::sync::Arc<PackedMatrix>> =
            (0..(cold as f64 / bytes).ceil().max(1.0) as usize).map(|_| std::sync::Arc::new(p.clone())).collect();
        // The copies' own pages, read as the probe reads its buffer: a fresh buffer's speed
        // depends on where its pages lie (1 GiB buffers of one process read 24.6–31.3 GB/s on
        // the 2-vCPU Xeon), and the kernels can be no faster than a plain pass over their bytes.
        let pages = WeightProbe::of_matrices(ps.iter().cloned());
        // Timed inside a spinning team, as a model's forward pass runs its calls (`team`): with
        // rayon's sleeping workers each call would also pay for waking them.
        let time = |b: Backend, t: usize| {
            forge_kernels::team::with_team(|| {
                let xs: Vec<f32> = x.iter().cycle().take(t * cin).copied().collect();
                let mut y = vec![0f32; t * cout];
                ps[0].matmul_with(b, &xs, t, &mut y);
                // About 0.3 s per measurement, at least 3 calls.
                let t0 = Instant::now();
                ps[0].matmul_with(b, &xs, t, &mut y);
                let once = t0.elapsed().as_secs_f64();
                let reps = ((0.3 / once) as usize).clamp(3, 500);
                let t0 = Instant::now();
                for i in 0..reps {
                    ps[(i + 1) % ps.len()].matmul_with(b, &xs, t, &mut y);
                }
                t0.elapsed().as_secs_f64() / reps as f64
            })
        };
        // Decode in three rounds, each after a probe pass: its share of the bandwidth is the
        // median of the rounds' ratios.
        let (mut t1, mut share, mut own, mut own_share) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            let bw = probe.pass();
            let pw = (!pages.is_empty()).then(|| pages.pass());
            let t = time(Backend::best(), 1);
            probes.push(bw);
            share.push(bytes / t / 1e9 / bw);
            if let Some(pw) = pw {
                own.push(pw);
                own_share.push(bytes / t / 1e9 / pw);
            }
            t1.push(t);
        }
        let fast1 = median(t1);
        let (own, own_share) = if own.is_empty() { (None, None) } else { (Some(median(own)), Some(median(own_share))) };
        let (ref1, fast8) = (time(Backend::Scalar, 1), time(Backend::best(), 8));
        // Prefill: 64 rows, counted in multiply-adds (weights decoded to f32 and FMA tiles).
        let fast64 = time(Backend::best(), 64);
        rows.push(json!({
            "format": f.name(),
            "layout": if int_dot { "int-dot" } else { "tiles" },
            "bytes": ps[0].packed_bytes(),
            "gb_s_t1": bytes / fast1 / 1e9,
            "gweights_s_t1": (cout * cin) as f64 / fast1 / 1e9,
            "scalar_gb_s_t1": bytes / ref1 / 1e9,
            "speedup_vs_scalar": ref1 / fast1,
            "gb_s_t8": bytes / fast8 / 1e9,
            "gmac_s_t64": (64 * cout * cin) as f64 / fast64 / 1e9,
            "fraction_of_bandwidth_t1": median(share),
            "pages_gb_s": own,
            "fraction_of_pages_t1": own_share,
        }));
    }
    let bw = median(probes);
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({ "threads": threads, "shape": [cout, cin], "cold_bytes": cold, "bandwidth_gb_s": bw, "isa": forge_kernels::lutmm::intdot::isa(), "kernels": rows })
            )?
        );
    } else {
        println!(
            "kernels on {cout}×{cin} (copies cycled through {} MiB), {threads} threads, read bandwidth {bw:.2} GB/s (median of the probe passes run before each decode round; % of bw is the median of the rounds' ratios; pages: a pass over the copies' own index rows before each round, and the rounds' share of it); {}",
            cold >> 20,
            forge_kernels::lutmm::intdot::isa()
        );
        println!(
            "{:<8} {:<8} {:>8} {:>11} {:>9} {:>10} {:>10} {:>8} {:>12} {:>9} {:>11} {:>14}",
            "format",
            "layout",
            "MB",
            "GB/s T=1",
            "% of bw",
            "pages GB/s",
            "% of pages",
            "Gw/s",
            "scalar GB/s",
            "speedup",
            "GB/s T=8",
            "Gmac/s T=64"
        );
        for r in rows {
            let g = |k: &str| r[k].as_f64().unwrap_or(0.0);
            let (pages, share) = match (r["pages_gb_s"].as_f64(), r["fraction_of_pages_t1"].as_f64()) {
                (Some(p), Some(f)) => (format!("{p:.2}"), format!("{:.0}%", 100.0 * f)),
                _ => ("-".to_string(), "-".to_string()),
            };
            println!(
                "{:<8} {:<8} {:>8.2} {:>11.2} {:>8.0}% {:>10} {:>10} {:>8.2} {:>12.3} {:>9.1} {:>11.2} {:>14.1}",
                r["format"].as_str().unwrap_or(""),
                r["layout"].as_str().unwrap_or(""),
                g("bytes") / 1e6,
                g("gb_s_t1"),
                100.0 * g("fraction_of_bandwidth_t1"),
                pages,
                share,
                g("gweights_s_t1"),
                g("scalar_gb_s_t1"),
                g("speedup_vs_scalar"),
                g("gb_s_t8"),
                g("gmac_s_t64"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("491520K"), Some(491520 << 10));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size("12x"), None);
        assert!(cold_bytes() >= 512 << 20);
    }
}
