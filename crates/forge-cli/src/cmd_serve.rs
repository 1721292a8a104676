mod agent_config;

use anyhow::{bail, Result};
use forge_server::engine::{EngineConfig, Speculation};
use forge_server::request::Overrides;
use forge_server::{App, ServerConfig};

/// Flags shared by `serve` and `chat`: the model, the context, and the generation defaults that
/// replace the model family's.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// Model: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Context length (prompt + completion) of one request.
    #[arg(long, visible_alias = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Requests served at once (continuous batching: their decode steps run together). Default:
    /// 4, fewer where the memory their caches take at --ctx is not there.
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Prompt cache budget in MiB (model states kept for reuse by later requests).
    #[arg(long, default_value_t = 1024)]
    pub cache_mb: usize,
    /// Thinking on by default (requests override with chat_template_kwargs.enable_thinking).
    #[arg(long)]
    pub think: bool,
    /// Default temperature (0 = greedy), instead of the model family's.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Default nucleus (top-p) cutoff.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Default top-k (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Default min-p (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Default presence penalty.
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// Default repetition penalty (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Default max_tokens when a request gives none.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Close thinking after this many tokens by inserting </think>.
    #[arg(long)]
    pub thinking_budget: Option<usize>,
    /// End generation when the last N tokens are one short block repeated (0 = off).
    #[arg(long, default_value_t = 256)]
    pub loop_guard: usize,
    #[command(flatten)]
    pub spec: crate::spec_args::SpecArgs,
}

impl EngineArgs {
    pub fn load(
        &self,
        api_key: Option<String>,
        model_name: Option<String>,
        test_hooks: bool,
    ) -> Result<std::sync::Arc<App>> {
        let path = crate::cmd_bundle::resolve(&self.model)?;
        let mut loaded = forge_model::load::load(&path)?;
        crate::configure(&mut loaded.model);
        let spec = self.spec.config()?;
        let draft = self.spec.load_draft(&path)?.map(|d| d.model);
        let speculation = if self.spec.lookup {
            Speculation::Lookup { min_n: self.spec.lookup_min, max_n: self.spec.lookup_max }
        } else if draft.is_some() {
            Speculation::Draft(crate::kv_dtype())
        } else {
            Speculation::Off
        };
        let model_id = model_name.unwrap_or_else(|| reported_id(&self.model, &path));
        let parallel = match self.parallel {
            Some(0) => bail!("--parallel 0: at least one request must be served at once"),
            Some(n) => n,
            None => default_parallel(&loaded.model, self.ctx),
        };
        let cfg = ServerConfig {
            api_key,
            model_id,
            engine: EngineConfig {
                ctx: self.ctx,
                cache_bytes: self.cache_mb << 20,
                // With several requests at once a new prompt delays the others' next token by
                // at most one chunk.
                prefill_chunk: crate::prefill_chunk().unwrap_or(512),
                parallel,
                speculation,
                spec,
                ..EngineConfig::default()
            },
            overrides: Overrides {
                think: self.think.then_some(true),
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                min_p: self.min_p,
                presence_penalty: self.presence_penalty,
                repetition_penalty: self.repetition_penalty,
                max_tokens: self.max_tokens,
                thinking_budget: self.thinking_budget,
                loop_guard: Some(self.loop_guard),
            },
            test_hooks,
        };
        App::with_draft(loaded, draft, cfg)
    }

    /// The id `/v1/models` will report, found without loading, fetching or verifying the model.
    pub fn model_id(&self, model_name: Option<String>) -> Result<String> {
        if let Some(n) = model_name {
            return Ok(n);
        }
        match forge_core::hub::resolve_model_with(&self.model, false, false) {
            Ok(path) => Ok(reported_id(&self.model, &path)),
            // A short name whose model is not fetched yet (`serve` fetches it).
            Err(_) if std::path::Path::new(&self.model).components().count() == 1 => Ok(self.model.clone()),
            Err(e) => Err(e),
        }
    }
}

/// Four slots where the memory is there: their caches at `ctx` positions take at most half of
/// the available memory.
fn default_parallel(model: &forge_model::Model, ctx: usize) -> usize {
    let per_slot = forge_model::Session::bytes_at(&model.cfg, model.kv_dtype(), ctx).max(1) as u64;
    let fit = crate::cmd_doctor::available_memory().map_or(4, |m| m / 2 / per_slot) as usize;
    fit.clamp(1, 4)
}

/// The id for a `--model` argument that resolved to `path`: a plain path by its file (or
/// directory) name without the extension, a short name or a bundle as given.
fn reported_id(arg: &str, path: &std::path::Path) -> String {
    // A bundle is known by the name its release.json gives it.
    if let Ok(rel) = forge_core::release::Release::read(std::path::Path::new(arg)) {
        return rel.name;
    }
    if path.to_string_lossy() == arg {
        path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| arg.to_string())
    } else {
        arg.to_string()
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on (loopback by default; use --api-key when exposing it).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8765)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on the API routes (or set FORGE_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Model name reported by /v1/models (default: the --model argument).
    #[arg(long)]
    model_name: Option<String>,
    /// Honour the x_forced_output request field (scripted output, for tests only).
    #[arg(long, hide = true)]
    test_hooks: bool,
    /// Print a client's configuration for this server (address, model id, key) and exit without
    /// loading the model: opencode, continue, llm, aider or openai-env (docs/agents.md).
    #[arg(long, value_name = "AGENT")]
    print_config: Option<String>,
}

pub fn run(a: Args) -> Result<()> {
    let api_key = a.api_key.or_else(|| std::env::var("FORGE_API_KEY").ok()).filter(|k| !k.is_empty());
    if let Some(agent) = &a.print_config {
        agent_config::check(agent)?;
        if a.port == 0 {
            bail!("--print-config needs a fixed --port (0 picks a free port only when the server starts)");
        }
        let ctx = a.engine.ctx.max(2);
        let target = agent_config::Target {
            host: a.host.clone(),
            port: a.port,
            model_id: a.engine.model_id(a.model_name.clone())?,
            api_key,
            ctx,
            // The server refuses max_tokens beyond the context; leave room for the prompt.
            max_tokens: a.engine.max_tokens.unwrap_or(ctx / 4).clamp(1, ctx),
        };
        let p = agent_config::render(agent, &target)?;
        print!("{}", p.config);
        eprintln!("forge: {}", p.hint);
        return Ok(());
    }
    let app = a.engine.load(api_key, a.model_name, a.test_hooks)?;
    forge_server::server::run(app, &a.host, a.port)
}
