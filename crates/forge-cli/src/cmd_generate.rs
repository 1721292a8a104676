use crate::spec_args::SpecArgs;
use anyhow::{bail, Context, Result};
use forge_core::tokenizer::StreamDecoder;
use forge_model::generate::generate_with;
use forge_model::sampling::{Sampler, SamplingParams};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, required_unless_present = "prompt_ids", conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// The prompt as token ids (whitespace- or comma-separated, as `forge logits --tokens`):
    /// models without a tokenizer can be decoded.
    #[arg(long, value_name = "FILE")]
    prompt_ids: Option<PathBuf>,
    /// Write the generated token ids to FILE (one line, space-separated).
    #[arg(long, value_name = "FILE")]
    output_ids: Option<PathBuf>,
    /// Wrap the prompt as a user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Positions the session may hold, prompt and generated tokens (default: the model's
    /// max_position_embeddings): generation stops there.
    #[arg(long)]
    ctx_size: Option<usize>,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    spec: SpecArgs,
}

pub fn run(a: Args) -> Result<()> {
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let spec = a.spec.config()?;
    let kv = crate::kv_dtype();
    let mut loaded = forge_model::load::load(&path)?;
    crate::configure(&mut loaded.model);
    let draft = a.spec.load_draft(&path)?;
    let vocab = loaded.model.cfg.vocab_size;
    let (prompt, tok) = match (&a.prompt_ids, &a.prompt) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("{}: cannot read", f.display()))?;
            let ids = crate::cmd_logits::parse_tokens(&text, f)?;
            if ids.is_empty() {
                bail!("{}: no token ids", f.display());
            }
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                bail!("{}: token id {bad} is out of range for vocabulary size {vocab}", f.display());
            }
            (ids, loaded.tokenizer().ok())
        }
        (None, Some(p)) => {
            let tok = loaded.tokenizer()?;
            let text = if a.chat {
                let tpl = loaded.template.as_ref().with_context(|| format!("{}: no chat template", path.display()))?;
                let mut msgs = Vec::new();
                if let Some(s) = &a.system {
                    msgs.push(serde_json::json!({"role": "system", "content": s}));
                }
                msgs.push(serde_json::json!({"role": "user", "content": p}));
                tpl.render(&serde_json::Value::Array(msgs), None, true, &serde_json::Map::new())?
            } else {
                p.clone()
            };
            // A chat template writes its own BOS when it wants one.
            (tok.encode(&text, tok.add_bos() && !a.chat)?, Some(tok))
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let ctx = a.ctx_size.unwrap_or(loaded.model.cfg.max_position_embeddings);
    if prompt.len() >= ctx {
        bail!("the prompt's {} tokens leave no room within --ctx-size {ctx}", prompt.len());
    }
    let max_tokens = a.max_tokens.min(ctx - prompt.len());
    if max_tokens < a.max_tokens {
        eprintln!("note: --max-tokens {} cut to {max_tokens}: --ctx-size {ctx} holds the prompt's {} tokens and {max_tokens} more", a.max_tokens, prompt.len());
    }
    let params =
        SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, min_p: a.min_p, seed: a.seed };
    let drafter = a.spec.drafter(draft.as_ref().map(|d| &d.model), &params, vocab, kv);
    let mut sampler = Sampler::new(params);
    let mut session = loaded.model.new_session_with_kv(kv);
    let mut dec = tok.map(StreamDecoder::new);
    let mut out = std::io::stdout().lock();
    let mut ids = Vec::new();
    let stop_ids = tok.map_or(&[][..], |t| t.stop_ids());
    let stats =
        generate_with(&loaded.model, &mut session, &prompt, max_tokens, &mut sampler, stop_ids, drafter, spec, |t| {
            ids.push(t);
            match dec.as_mut() {
                Some(d) => out.write_all(d.push(t)?.as_bytes())?,
                None => write!(out, "{t} ")?,
            }
            out.flush()?;
            Ok(true)
        })?;
    let rest = match dec.as_mut() {
        Some(d) => d.finish()?,
        None => String::new(),
    };
    writeln!(out, "{rest}")?;
    if let Some(f) = &a.output_ids {
        let line = ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ");
        forge_core::fsutil::write_atomic(f, format!("{line}\n").as_bytes())?;
    }
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | threads {}",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
        rayon::current_num_threads()
    );
    if a.spec.enabled() {
        let s = &stats.spec;
        eprintln!(
            "speculative: drafted {}, accepted {} ({:.1} %), {:.2} tokens per verify, {} verifies, {} plain steps",
            s.drafted,
            s.accepted,
            100.0 * s.acceptance_rate(),
            s.tokens_per_verify(),
            s.verifies,
            s.plain_steps
        );
    }
    Ok(())
}
