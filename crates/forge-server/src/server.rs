//! The HTTP side: axum routes, authentication, request → job, engine events → OpenAI responses
//! (one JSON body, or SSE chunks ending in `data: [DONE]`).

use crate::engine::{Engine, EngineConfig, Event, Finish, GenParams, Job, RunStats, SubmitError, TokenLogprob};
use crate::error::ApiError;
use crate::parser::{Delta, OutputParser, Parsed, ToolSchemas};
use crate::prompt::{fresh_seed, Frontend, Prepared};
use crate::request::{self, Defaults, Overrides};
use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use forge_model::load::Loaded;
use serde_json::{json, Value as Json};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Required as `Authorization: Bearer KEY` on the API routes when set.
    pub api_key: Option<String>,
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    pub engine: EngineConfig,
    pub overrides: Overrides,
    /// Honour `x_forced_output` (tests drive the output parsers through the real server with it).
    pub test_hooks: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            model_id: "forge".into(),
            engine: EngineConfig::default(),
            overrides: Overrides::default(),
            test_hooks: false,
        }
    }
}

pub struct App {
    pub engine: Engine,
    pub front: Frontend,
    pub model_id: String,
    pub model_path: String,
    pub model_type: String,
    pub vocab_size: usize,
    /// The KV cache type of the model's sessions.
    pub kv_dtype: forge_model::session::KvDtype,
    /// KV cache bytes a position takes, and positions a cache page holds.
    kv_position_bytes: usize,
    kv_page_rows: usize,
    pub api_key: Option<String>,
    pub max_body: usize,
    started: Instant,
}

impl App {
    /// Starts the engine on a loaded model.
    pub fn new(loaded: Loaded, cfg: ServerConfig) -> Result<Arc<App>> {
        Self::with_draft(loaded, None, cfg)
    }

    /// [`App::new`] with a draft model for speculative decoding (`cfg.engine.speculation`).
    pub fn with_draft(loaded: Loaded, draft: Option<forge_model::Model>, cfg: ServerConfig) -> Result<Arc<App>> {
        let Loaded { model, tokenizer, template, path } = loaded;
        let tok = Arc::new(tokenizer.with_context(|| format!("{}: the server needs a tokenizer", path.display()))?);
        let model_type = model.cfg.model_type.clone();
        let vocab_size = model.cfg.vocab_size;
        let hybrid = model.is_hybrid();
        let kv_dtype = model.kv_dtype();
        let kv_position_bytes = forge_model::Session::kv_bytes_per_position(&model.cfg, kv_dtype);
        let kv_page_rows = model.kv_page_rows();
        let mut defaults = Defaults::for_model_type(&model_type);
        cfg.overrides.apply(&mut defaults);
        let ctx = cfg.engine.ctx.max(2);
        let engine = Engine::start_with_draft(model, draft, tok.clone(), EngineConfig { ctx, ..cfg.engine.clone() })?;
        let front = Frontend { tok, template, hybrid, defaults, ctx, test_hooks: cfg.test_hooks };
        Ok(Arc::new(App {
            engine,
            front,
            model_id: cfg.model_id,
            model_path: path.display().to_string(),
            model_type,
            vocab_size,
            kv_dtype,
            kv_position_bytes,
            kv_page_rows,
            api_key: cfg.api_key.filter(|k| !k.is_empty()),
            max_body: body_limit(ctx),
            started: Instant::now(),
        }))
    }

    pub fn ctx(&self) -> usize {
        self.front.ctx
    }
}

/// Request bodies of at least this many bytes are accepted, whatever the context.
pub const MIN_BODY_BYTES: usize = 2 << 20;
/// No request body may exceed this, whatever the context.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// The request body limit for a context of `ctx` tokens: a prompt that fills the context is a few
/// bytes per token and JSON and tool schemas add more, so 64 bytes per token, within
/// [`MIN_BODY_BYTES`]..=[`MAX_BODY_BYTES`]. A larger body is refused with 413 (an OpenAI error,
/// code `request_too_large`) as soon as it passes the limit, without reading the rest.
pub fn body_limit(ctx: usize) -> usize {
    ctx.saturating_mul(64).clamp(MIN_BODY_BYTES, MAX_BODY_BYTES)
}

pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/apply-template", post(apply_template))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(app.max_body))
        .with_state(app)
}

async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "unknown endpoint")
        .with_code("unknown_url")
        .into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed for this endpoint")
        .into_response()
}

/// Constant-time comparison, so the key cannot be guessed byte by byte from response times.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let h = req.headers();
        let given = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.strip_prefix("Bearer ").or_else(|| s.strip_prefix("bearer ")))
            .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        if !given.is_some_and(|g| same_secret(g, key)) {
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "missing or incorrect API key")
                .with_code("invalid_api_key")
                .into_response();
        }
    }
    next.run(req).await
}

/// A JSON body (axum's `json` feature would pull in serde_path_to_error for nothing).
fn json_response(v: Json) -> JsonResponse {
    JsonResponse(v)
}

struct JsonResponse(Json);

impl IntoResponse for JsonResponse {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.0).unwrap_or_default();
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn model_object(app: &App) -> Json {
    json!({"id": app.model_id, "object": "model", "created": app.started_secs(), "owned_by": "forge",
           "meta": {"context_length": app.ctx(), "model_type": app.model_type, "vocab_size": app.vocab_size}})
}

impl App {
    fn started_secs(&self) -> u64 {
        now_secs().saturating_sub(self.started.elapsed().as_secs())
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

async fn model_one(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.model_id {
        json_response(model_object(&app)).into_response()
    } else {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("model '{id}' does not exist"))
            .with_param("model")
            .with_code("model_not_found")
            .into_response()
    }
}

fn stats_json(s: &RunStats) -> Json {
    json!({
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
        "prefill_tokens": s.prompt_tokens - s.cached_tokens, "prefill_s": s.prefill_s,
        "prefill_tok_s": s.prefill_tok_s(), "generated_tokens": s.generated_tokens, "decode_s": s.decode_s,
        "decode_tok_s": s.decode_tok_s(), "ttft_s": s.ttft_s, "queue_s": s.queue_s, "finish": s.finish.as_str(),
    })
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let st = &app.engine.status;
    let last = st.last.lock().map(|l| l.clone()).unwrap_or(None);
    json_response(json!({
        "status": "ok",
        "model": app.model_id,
        "path": app.model_path,
        "model_type": app.model_type,
        "hybrid": app.front.hybrid,
        "ctx": app.ctx(),
        "kv_cache_dtype": app.kv_dtype.name(),
        "threads": rayon::current_num_threads(),
        "queue": st.queued.load(Ordering::SeqCst),
        "busy": st.active.load(Ordering::SeqCst) > 0,
        "slots": app.engine.config.parallel,
        "active": st.active.load(Ordering::SeqCst),
        "batching": batching_json(&app.engine.scheduler.stats),
        "served": st.served.load(Ordering::SeqCst),
        "kv_cache": kv_cache_json(&app),
        "prompt_cache": {"entries": st.cache_entries.load(Ordering::SeqCst), "bytes": st.cache_bytes.load(Ordering::SeqCst)},
        "last": last.as_ref().map(stats_json),
        "uptime_s": app.started.elapsed().as_secs_f64(),
    }))
    .into_response()
}

/// The KV caches of the requests being served: bytes of the positions they hold, and of the
/// pages holding them (the cache grows a page at a time).
fn kv_cache_json(app: &App) -> Json {
    let positions: Vec<usize> = app.engine.status.slot_positions.iter().map(|p| p.load(Ordering::Relaxed)).collect();
    let page = app.kv_page_rows.max(1);
    let used: usize = positions.iter().sum();
    let held: usize = positions.iter().map(|p| p.div_ceil(page) * page).sum();
    json!({
        "positions": used,
        "used_bytes": used * app.kv_position_bytes,
        "reserved_bytes": held * app.kv_position_bytes,
        "page_positions": page,
    })
}

fn batching_json(s: &crate::batch::SchedStats) -> Json {
    let n = |v: &AtomicU64| v.load(Ordering::Relaxed);
    json!({
        "cycles": n(&s.cycles), "passes": n(&s.passes), "rows": n(&s.rows), "batched_passes": n(&s.batched),
        "prompt_chunks": n(&s.long), "prompt_chunks_beside_decoding": n(&s.long_beside_short),
        "max_chunks_a_decode_waited": n(&s.long_waits),
        "run_s": n(&s.run_ns) as f64 * 1e-9, "gather_s": n(&s.gather_ns) as f64 * 1e-9,
    })
}

fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<Json, ApiError> {
    let bytes = body.map_err(|r| {
        let e = ApiError::new(r.status(), "invalid_request_error", r.body_text());
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            e.with_code("request_too_large")
        } else {
            e
        }
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("could not parse the JSON body: {e}")).with_code("invalid_json"))
}

/// Sets the job's cancel flag when dropped: the handler future or the response stream went away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn submit(
    app: &App,
    prepared: &Prepared,
    params: GenParams,
) -> Result<(UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job::new(prepared.tokens.clone(), prepared.snapshots.clone(), params, cancel.clone(), tx);
    match app.engine.submit(job) {
        Ok(()) => Ok((rx, CancelOnDrop(cancel))),
        Err(SubmitError::QueueFull) => Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the request queue is full; retry later",
        )
        .with_code("queue_full")),
        Err(SubmitError::Stopped) => {
            Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped"))
        }
    }
}

/// CPU work (template, tokenizer) off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("request worker failed: {e}")))?
}

pub fn usage_json(s: &RunStats) -> Json {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": s.reasoning_tokens,
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
        },
    })
}

/// llama.cpp-style timings, which several clients display.
pub fn timings_json(s: &RunStats) -> Json {
    json!({
        "queue_ms": s.queue_s * 1e3,
        "cache_n": s.cached_tokens,
        "prompt_n": s.prompt_tokens - s.cached_tokens,
        "prompt_ms": s.prefill_s * 1e3,
        "prompt_per_second": s.prefill_tok_s(),
        "predicted_n": s.generated_tokens,
        "predicted_ms": s.decode_s * 1e3,
        "predicted_per_second": s.decode_tok_s(),
        "ttft_ms": s.ttft_s * 1e3,
    })
}

fn bytes_of(s: &str) -> Json {
    Json::Array(s.bytes().map(Json::from).collect())
}

fn logprob_json(lp: &TokenLogprob) -> Json {
    json!({
        "token": lp.token, "logprob": lp.logprob, "bytes": bytes_of(&lp.token),
        "top_logprobs": lp.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": bytes_of(t)})).collect::<Vec<_>>(),
    })
}

/// Turns engine output into one API's chunks and final body.
trait Output: Send + 'static {
    /// Chunks for newly generated text (empty when nothing is certain yet).
    fn text(&mut self, text: &str, lp: Option<TokenLogprob>) -> Vec<Json>;
    /// The last chunks (rest of the text, finish reason, usage).
    fn done(&mut self, stats: &RunStats) -> Vec<Json>;
    /// The non-streaming body.
    fn response(&mut self, stats: &RunStats) -> Json;
    /// Chunks to send as soon as the job starts.
    fn start(&mut self) -> Vec<Json> {
        Vec::new()
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    streaming: bool,
}

struct ChatOutput {
    meta: Meta,
    parser: OutputParser,
    parsed: Parsed,
    logprobs: bool,
    pending_lp: Vec<Json>,
    all_lp: Vec<Json>,
}

fn delta_json(d: &Delta) -> Json {
    match d {
        Delta::Reasoning(s) => json!({"reasoning_content": s}),
        Delta::Content(s) => json!({"content": s}),
        Delta::ToolStart { index, id, name } => json!({"tool_calls": [{
            "index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
        Delta::ToolArgs { index, fragment } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        }
    }
}

/// One of OpenAI's values only: litellm (so Aider) fails on any other, and the AI SDK (so
/// OpenCode) takes an unknown one for an unfinished turn and asks again. The loop guard's cut is
/// `length` here; `/health`'s `last.finish` still says `repetition`.
fn finish_reason(finish: Finish, tool_calls: bool) -> &'static str {
    match finish {
        Finish::Stop | Finish::Cancelled if tool_calls => "tool_calls",
        Finish::Stop | Finish::Cancelled => "stop",
        Finish::Length | Finish::Repetition => "length",
    }
}

impl ChatOutput {
    fn chunk(&self, delta: Json, finish: Option<&str>, logprobs: Option<Json>) -> Json {
        let mut c = json!({
            "id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
            "model": self.meta.model, "system_fingerprint": "forge",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.meta.include_usage {
            c["usage"] = Json::Null;
        }
        c
    }

    fn deltas_to_chunks(&mut self, deltas: Vec<Delta>) -> Vec<Json> {
        for d in &deltas {
            self.parsed.add(d);
        }
        if !self.meta.streaming {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(deltas.len());
        for d in deltas {
            let lp = (!self.pending_lp.is_empty()).then(|| json!({"content": std::mem::take(&mut self.pending_lp)}));
            out.push(self.chunk(delta_json(&d), None, lp));
        }
        out
    }
}

impl Output for ChatOutput {
    fn start(&mut self) -> Vec<Json> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None, None)]
    }

    fn text(&mut self, text: &str, lp: Option<TokenLogprob>) -> Vec<Json> {
        if let (true, Some(lp)) = (self.logprobs, lp) {
            let j = logprob_json(&lp);
            self.all_lp.push(j.clone());
            self.pending_lp.push(j);
        }
        let deltas = self.parser.push(text);
        self.deltas_to_chunks(deltas)
    }

    fn done(&mut self, stats: &RunStats) -> Vec<Json> {
        let deltas = self.parser.finish();
        let mut out = self.deltas_to_chunks(deltas);
        let lp = (!self.pending_lp.is_empty()).then(|| json!({"content": std::mem::take(&mut self.pending_lp)}));
        let reason = finish_reason(stats.finish, !self.parsed.tool_calls.is_empty());
        let mut last = self.chunk(json!({}), Some(reason), lp);
        last["timings"] = timings_json(stats);
        out.push(last);
        if self.meta.include_usage {
            out.push(json!({
                "id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
                "model": self.meta.model, "system_fingerprint": "forge", "choices": [], "usage": usage_json(stats),
            }));
        }
        out
    }

    fn response(&mut self, stats: &RunStats) -> Json {
        let deltas = self.parser.finish();
        self.deltas_to_chunks(deltas);
        let p = &self.parsed;
        let mut msg = json!({"role": "assistant"});
        msg["content"] = if p.content.is_empty() && !p.tool_calls.is_empty() { Json::Null } else { json!(p.content) };
        if !p.reasoning.is_empty() {
            msg["reasoning_content"] = json!(p.reasoning);
        }
        if !p.tool_calls.is_empty() {
            msg["tool_calls"] = p
                .tool_calls
                .iter()
                .map(
                    |c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}),
                )
                .collect();
        }
        let logprobs = self.logprobs.then(|| json!({"content": self.all_lp}));
        json!({
            "id": self.meta.id, "object": "chat.completion", "created": self.meta.created, "model": self.meta.model,
            "system_fingerprint": "forge",
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs,
                         "finish_reason": finish_reason(stats.finish, !p.tool_calls.is_empty())}],
            "usage": usage_json(stats),
            "timings": timings_json(stats),
        })
    }
}

struct CompletionOutput {
    meta: Meta,
    echo: Option<String>,
    text: String,
    logprobs: bool,
    lp_tokens: Vec<Json>,
    lp_values: Vec<Json>,
    lp_top: Vec<Json>,
    lp_offsets: Vec<Json>,
    lp_offset: usize,
    pending: usize,
}

impl CompletionOutput {
    fn chunk(&self, text: &str, finish: Option<&str>, logprobs: Option<Json>) -> Json {
        let mut c = json!({
            "id": self.meta.id, "object": "text_completion", "created": self.meta.created, "model": self.meta.model,
            "system_fingerprint": "forge",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.meta.include_usage {
            c["usage"] = Json::Null;
        }
        c
    }

    /// Legacy `logprobs` object over entries `from..`.
    fn lp_since(&self, from: usize) -> Option<Json> {
        self.logprobs.then(|| {
            json!({"tokens": self.lp_tokens[from..], "token_logprobs": self.lp_values[from..],
                   "top_logprobs": self.lp_top[from..], "text_offset": self.lp_offsets[from..]})
        })
    }
}

impl Output for CompletionOutput {
    fn start(&mut self) -> Vec<Json> {
        match self.echo.take() {
            Some(e) if self.meta.streaming => vec![self.chunk(&e, None, None)],
            Some(e) => {
                self.text.push_str(&e);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    fn text(&mut self, text: &str, lp: Option<TokenLogprob>) -> Vec<Json> {
        if let (true, Some(lp)) = (self.logprobs, lp) {
            self.lp_tokens.push(json!(lp.token));
            self.lp_values.push(json!(lp.logprob));
            let top: serde_json::Map<String, Json> = lp.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect();
            self.lp_top.push(Json::Object(top));
            self.lp_offsets.push(json!(self.lp_offset));
            self.lp_offset += lp.token.len();
        }
        if !self.meta.streaming {
            self.text.push_str(text);
            return Vec::new();
        }
        if text.is_empty() {
            return Vec::new();
        }
        let lp = self.lp_since(self.pending);
        self.pending = self.lp_tokens.len();
        vec![self.chunk(text, None, lp)]
    }

    fn done(&mut self, stats: &RunStats) -> Vec<Json> {
        let lp = if self.pending < self.lp_tokens.len() { self.lp_since(self.pending) } else { None };
        let mut last = self.chunk("", Some(finish_reason(stats.finish, false)), lp);
        last["timings"] = timings_json(stats);
        let mut out = vec![last];
        if self.meta.include_usage {
            out.push(json!({
                "id": self.meta.id, "object": "text_completion", "created": self.meta.created,
                "model": self.meta.model, "choices": [], "usage": usage_json(stats),
            }));
        }
        out
    }

    fn response(&mut self, stats: &RunStats) -> Json {
        json!({
            "id": self.meta.id, "object": "text_completion", "created": self.meta.created, "model": self.meta.model,
            "system_fingerprint": "forge",
            "choices": [{"index": 0, "text": self.text, "logprobs": self.lp_since(0),
                         "finish_reason": finish_reason(stats.finish, false)}],
            "usage": usage_json(stats),
            "timings": timings_json(stats),
        })
    }
}

fn sse(chunks: &[Json]) -> Bytes {
    let mut s = String::new();
    for c in chunks {
        s.push_str("data: ");
        s.push_str(&c.to_string());
        s.push_str("\n\n");
    }
    Bytes::from(s)
}

struct StreamState<O: Output> {
    rx: UnboundedReceiver<Event>,
    out: O,
    _cancel: CancelOnDrop,
    done: bool,
}

/// Streams (SSE) or collects the job's events into the response.
async fn respond<O: Output>(
    mut rx: UnboundedReceiver<Event>,
    mut out: O,
    cancel: CancelOnDrop,
    stream: bool,
) -> Result<Response, ApiError> {
    if !stream {
        let _cancel = cancel;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Started => {
                    out.start();
                }
                Event::Token { text, logprob } => {
                    out.text(&text, logprob);
                }
                Event::Text(t) => {
                    out.text(&t, None);
                }
                Event::Done(stats) => return Ok(json_response(out.response(&stats)).into_response()),
                Event::Error(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
            }
        }
        return Err(ApiError::internal("the engine stopped before finishing the request"));
    }
    let state = StreamState { rx, out, _cancel: cancel, done: false };
    let body = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            let chunks = match st.rx.recv().await {
                Some(Event::Started) => st.out.start(),
                Some(Event::Token { text, logprob }) => st.out.text(&text, logprob),
                Some(Event::Text(t)) => st.out.text(&t, None),
                Some(Event::Done(stats)) => {
                    st.done = true;
                    let mut b = sse(&st.out.done(&stats)).to_vec();
                    b.extend_from_slice(b"data: [DONE]\n\n");
                    return Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(b)), st));
                }
                Some(Event::Error(e)) => {
                    st.done = true;
                    let err = ApiError::internal(format!("generation failed: {e}"));
                    let mut b = sse(&[err.body()]).to_vec();
                    b.extend_from_slice(b"data: [DONE]\n\n");
                    return Some((Ok(Bytes::from(b)), st));
                }
                None => {
                    st.done = true;
                    let err = ApiError::internal("the engine stopped before finishing the request");
                    return Some((Ok(sse(&[err.body()])), st));
                }
            };
            if !chunks.is_empty() {
                return Some((Ok(sse(&chunks)), st));
            }
        }
    });
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().expect("static header"));
    headers.insert(header::CACHE_CONTROL, "no-cache".parse().expect("static header"));
    Ok((headers, Body::from_stream(body)).into_response())
}

fn meta(app: &App, prefix: &str, include_usage: bool, streaming: bool) -> Meta {
    Meta {
        id: format!("{prefix}-{:016x}", fresh_seed()),
        created: now_secs(),
        model: app.model_id.clone(),
        include_usage,
        streaming,
    }
}

async fn chat_completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(app, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(app: Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let v = parse_body(body)?;
    let a = app.clone();
    let (req, prepared, params) = blocking(move || {
        let req = request::parse_chat(&v, a.ctx())?;
        let prepared = a.front.chat_prompt(&req)?;
        let params = a.front.gen_params(&req.common, &prepared, req.logprobs, "messages")?;
        Ok((req, prepared, params))
    })
    .await?;
    let (rx, cancel) = submit(&app, &prepared, params)?;
    let m = meta(&app, "chatcmpl", req.common.include_usage, req.common.stream);
    let schemas = req.tools.as_ref().map(|t| ToolSchemas::from_tools(t));
    let id_prefix = format!("call_{}_", &m.id[m.id.len() - 8..]);
    let out = ChatOutput {
        parser: OutputParser::new(prepared.starts_in_reasoning, schemas, &id_prefix),
        meta: m,
        parsed: Parsed::default(),
        logprobs: req.logprobs.is_some(),
        pending_lp: Vec::new(),
        all_lp: Vec::new(),
    };
    respond(rx, out, cancel, req.common.stream).await
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    completion_inner(app, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completion_inner(app: Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let v = parse_body(body)?;
    let a = app.clone();
    let (req, prepared, params) = blocking(move || {
        let req = request::parse_completion(&v, a.ctx())?;
        let prepared = a.front.completion_prompt(&req)?;
        if let Some(bad) = prepared.tokens.iter().find(|&&t| t as usize >= a.vocab_size) {
            return Err(ApiError::param("prompt", format!("token id {bad} is outside the vocabulary")));
        }
        let params = a.front.gen_params(&req.common, &prepared, req.logprobs, "prompt")?;
        Ok((req, prepared, params))
    })
    .await?;
    let (rx, cancel) = submit(&app, &prepared, params)?;
    let out = CompletionOutput {
        meta: meta(&app, "cmpl", req.common.include_usage, req.common.stream),
        echo: req.echo.then(|| prepared.text.clone()),
        text: String::new(),
        logprobs: req.logprobs.is_some(),
        lp_tokens: Vec::new(),
        lp_values: Vec::new(),
        lp_top: Vec::new(),
        lp_offsets: Vec::new(),
        lp_offset: 0,
        pending: 0,
    };
    respond(rx, out, cancel, req.common.stream).await
}

/// The prompt a chat request renders to (a debugging aid, as llama.cpp's endpoint of that name).
async fn apply_template(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let v = parse_body(body)?;
        let a = app.clone();
        blocking(move || {
            let req = request::parse_chat(&v, a.ctx())?;
            let p = a.front.chat_prompt(&req)?;
            Ok(json!({"prompt": p.text, "tokens": p.tokens.len(), "thinking": p.thinking,
                      "starts_in_reasoning": p.starts_in_reasoning}))
        })
        .await
    }
    .await;
    match r {
        Ok(j) => json_response(j).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A server running on its own runtime thread (tests, embedding); stops when dropped.
pub struct Background {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // Two I/O threads are plenty: the model runs on the scheduler thread and rayon's pool.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("forge-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))
}

async fn serve_until(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    use axum::serve::ListenerExt;
    // Stream chunks are small; Nagle would hold them back.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(app)).with_graceful_shutdown(shutdown).await.context("server failed")
}

/// Starts serving on `addr` (port 0 picks a free port) in a background thread.
pub fn spawn_background(app: Arc<App>, addr: &str) -> Result<Background> {
    let rt = runtime()?;
    let listener = rt.block_on(bind(addr))?;
    let local = listener.local_addr().context("listener address")?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("forge-server".into())
        .spawn(move || {
            let r = rt.block_on(serve_until(listener, app, async {
                let _ = rx.await;
            }));
            if let Err(e) = r {
                eprintln!("forge: server error: {e:#}");
            }
            rt.shutdown_background();
        })
        .context("cannot start the server thread")?;
    Ok(Background { addr: local, shutdown: Some(tx), thread: Some(thread) })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("forge: shutting down");
    // Streams in flight get a moment to finish; then the process ends regardless.
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(3));
        std::process::exit(0);
    });
}

/// Serves until Ctrl-C or SIGTERM (the `forge serve` command).
pub fn run(app: Arc<App>, host: &str, port: u16) -> Result<()> {
    let rt = runtime()?;
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let listener = rt.block_on(bind(&addr))?;
    let local = listener.local_addr().context("listener address")?;
    if !local.ip().is_loopback() && app.api_key.is_none() {
        eprintln!("forge: warning: listening on {} without --api-key: anyone who can reach it can use it", local.ip());
    }
    eprintln!(
        "forge: serving {} ({}, ctx {}, {} threads) on http://{local} — endpoints /v1/chat/completions, /v1/completions, /v1/models, /health",
        app.model_id,
        app.model_type,
        app.ctx(),
        rayon::current_num_threads()
    );
    rt.block_on(serve_until(listener, app, shutdown_signal()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_limit_scales_with_the_context_within_bounds() {
        assert_eq!(body_limit(0), MIN_BODY_BYTES);
        assert_eq!(body_limit(4096), MIN_BODY_BYTES);
        assert_eq!(body_limit(262_144), 16 << 20);
        assert_eq!(body_limit(1 << 30), MAX_BODY_BYTES);
        assert_eq!(body_limit(usize::MAX), MAX_BODY_BYTES);
    }
}
