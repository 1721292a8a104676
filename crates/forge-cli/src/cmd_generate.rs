use anyhow::{Context, Result};
use forge_core::tokenizer::StreamDecoder;
use forge_model::generate::generate;
use forge_model::sampling::{Sampler, SamplingParams};
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    /// Model: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
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
}

pub fn run(a: Args) -> Result<()> {
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let loaded = forge_model::load::load(&path)?;
    let tok = loaded.tokenizer()?;
    let text = if a.chat {
        let tpl = loaded.template.as_ref().with_context(|| format!("{}: no chat template", path.display()))?;
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(serde_json::json!({"role": "system", "content": s}));
        }
        msgs.push(serde_json::json!({"role": "user", "content": a.prompt}));
        tpl.render(&serde_json::Value::Array(msgs), None, true, &serde_json::Map::new())?
    } else {
        a.prompt.clone()
    };
    // A chat template writes its own BOS when it wants one.
    let prompt = tok.encode(&text, tok.add_bos() && !a.chat)?;
    let params =
        SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, min_p: a.min_p, seed: a.seed };
    let mut sampler = Sampler::new(params);
    let mut session = loaded.model.new_session();
    let mut dec = StreamDecoder::new(tok);
    let mut out = std::io::stdout().lock();
    let stats = generate(&loaded.model, &mut session, &prompt, a.max_tokens, &mut sampler, tok.stop_ids(), |t| {
        let s = dec.push(t)?;
        out.write_all(s.as_bytes())?;
        out.flush()?;
        Ok(true)
    })?;
    let rest = dec.finish()?;
    writeln!(out, "{rest}")?;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | threads {}",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
        rayon::current_num_threads()
    );
    Ok(())
}
