//! From a parsed request to what the engine runs: the rendered, tokenized prompt, the snapshot
//! points for the prompt cache, and the generation parameters with the server defaults filled in.

use crate::engine::GenParams;
use crate::error::ApiError;
use crate::request::{ChatRequest, Common, CompletionRequest, Defaults, PromptInput};
use forge_core::chat::ChatTemplate;
use forge_core::tokenizer::Tokenizer;
use forge_model::sampling::SamplingParams;
use serde_json::{Map, Value as Json};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct Frontend {
    pub tok: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The model has recurrent state: the cache needs snapshots (see `cache`).
    pub hybrid: bool,
    pub defaults: Defaults,
    pub ctx: usize,
    /// Honour the `x_forced_output` test hook.
    pub test_hooks: bool,
}

#[derive(Clone, Debug)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub text: String,
    pub snapshots: Vec<usize>,
    /// The rendered prompt ends inside an open `<think>`.
    pub starts_in_reasoning: bool,
    pub thinking: bool,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A seed for requests that give none: different for every request.
pub fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    forge_model::sampling::Rng::new(t ^ n.rotate_left(32)).next_u64()
}

impl Frontend {
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&[Json]>,
        kwargs: &Map<String, Json>,
        add_generation_prompt: bool,
    ) -> Result<String, ApiError> {
        let tpl = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid("this model has no chat template; use /v1/completions with a raw prompt")
        })?;
        let tools = tools.map(|t| Json::Array(t.to_vec()));
        // Template errors (e.g. `raise_exception("roles must alternate")`) are the client's to fix.
        tpl.render(messages, tools.as_ref(), add_generation_prompt, kwargs)
            .map_err(|e| ApiError::param("messages", format!("{e:#}")))
    }

    pub fn thinking(&self, req: &ChatRequest) -> bool {
        req.enable_thinking.unwrap_or(self.defaults.think)
    }

    fn kwargs(&self, req: &ChatRequest) -> Map<String, Json> {
        let mut kw = req.template_kwargs.clone();
        kw.insert("enable_thinking".into(), Json::Bool(self.thinking(req)));
        kw
    }

    /// Renders the conversation (with its tools) and tokenizes it. For hybrid models also finds
    /// the positions later requests are likely to return to (see `cache`): the end of the system
    /// prompt, and the end of the conversation before the generation prompt (the next turn
    /// re-renders this answer, often differently, e.g. without its reasoning, but shares all before).
    pub fn chat_prompt(&self, req: &ChatRequest) -> Result<Prepared, ApiError> {
        let kw = self.kwargs(req);
        let tools = req.tools.as_deref();
        let text = self.render(&req.messages, tools, &kw, true)?;
        // The template writes BOS itself when the model wants one (as `forge generate --chat`).
        let tokens = self.tok.encode(&text, false).map_err(|e| ApiError::internal(format!("tokenizer: {e:#}")))?;
        let mut snapshots = Vec::new();
        if self.hybrid {
            let msgs = req.messages.as_array().map(Vec::as_slice).unwrap_or(&[]);
            let n_sys = msgs.iter().take_while(|m| m["role"] == "system").count();
            let mut probes = Vec::new();
            if n_sys > 0 && n_sys < msgs.len() {
                // Some templates refuse a conversation without a user turn, so the system prompt
                // is rendered with a stand-in user message; the common prefix ends before it.
                let mut m = msgs[..n_sys].to_vec();
                m.push(serde_json::json!({"role": "user", "content": "\u{1}forge-probe"}));
                probes.push(Json::Array(m));
            }
            probes.push(req.messages.clone());
            for m in probes {
                if let Ok(t) = self.render(&m, tools, &kw, false) {
                    if let Ok(ids) = self.tok.encode(&t, false) {
                        let b = common_prefix(&ids, &tokens);
                        if b > 0 {
                            snapshots.push(b);
                        }
                    }
                }
            }
            snapshots.push(tokens.len());
            snapshots.sort_unstable();
            snapshots.dedup();
        }
        let starts_in_reasoning = text.trim_end().ends_with("<think>");
        Ok(Prepared { tokens, text, snapshots, starts_in_reasoning, thinking: self.thinking(req) })
    }

    pub fn completion_prompt(&self, req: &CompletionRequest) -> Result<Prepared, ApiError> {
        let (tokens, text) = match &req.prompt {
            PromptInput::Text(t) => {
                let ids = self
                    .tok
                    .encode(t, self.tok.add_bos())
                    .map_err(|e| ApiError::internal(format!("tokenizer: {e:#}")))?;
                (ids, t.clone())
            }
            PromptInput::Tokens(ids) => {
                let text = self.tok.decode(ids, false).map_err(|e| ApiError::param("prompt", format!("{e:#}")))?;
                (ids.clone(), text)
            }
        };
        if tokens.is_empty() {
            return Err(ApiError::param("prompt", "the prompt is empty after tokenization"));
        }
        let snapshots = if self.hybrid { vec![tokens.len()] } else { Vec::new() };
        Ok(Prepared { tokens, text, snapshots, starts_in_reasoning: false, thinking: false })
    }

    /// Generation parameters: request fields over server defaults; `max_tokens` bounded by what
    /// the context leaves after the prompt.
    pub fn gen_params(
        &self,
        c: &Common,
        prompt: &Prepared,
        logprobs: Option<usize>,
        param: &str,
    ) -> Result<GenParams, ApiError> {
        let n = prompt.tokens.len();
        if n >= self.ctx {
            return Err(ApiError::param(
                param,
                format!(
                    "This model's maximum context length is {} tokens. However, your prompt has {n} tokens, \
                     leaving no room for a completion.",
                    self.ctx
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let d = &self.defaults;
        let base = if prompt.thinking { d.thinking } else { d.plain };
        let sampling = SamplingParams {
            temperature: c.temperature.unwrap_or(base.0),
            top_p: c.top_p.unwrap_or(base.1),
            top_k: c.top_k.unwrap_or(base.2),
            min_p: c.min_p.unwrap_or(base.3),
            seed: c.seed.unwrap_or_else(fresh_seed),
        };
        let mut penalties = c.penalties.clone();
        if !c.presence_set {
            penalties.presence = d.presence_penalty;
        }
        if !c.repetition_set {
            penalties.repetition = d.repetition_penalty;
        }
        let forced_output = match &c.forced_output {
            None => None,
            Some(_) if !self.test_hooks => {
                return Err(ApiError::param("x_forced_output", "test hooks are disabled on this server"))
            }
            Some(s) => Some(self.tok.encode(s, false).map_err(|e| ApiError::internal(format!("tokenizer: {e:#}")))?),
        };
        Ok(GenParams {
            max_tokens: c.max_tokens.unwrap_or(d.max_tokens).min(self.ctx - n),
            sampling,
            penalties,
            stop: c.stop.clone(),
            logprobs,
            starts_in_reasoning: prompt.starts_in_reasoning,
            thinking_budget: c.thinking_budget.or(d.thinking_budget),
            loop_guard: c.loop_guard.unwrap_or(d.loop_guard),
            forced_output,
            speculative: c.speculative.unwrap_or(true),
            ignore_eos: c.ignore_eos,
        })
    }
}
