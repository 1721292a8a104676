//! Request bodies of the OpenAI API, checked field by field: a known field with the wrong type or
//! out of range is a 400 naming it (`param`); unknown fields are ignored, as clients send many.

use crate::error::ApiError;
use crate::penalties::Penalties;
use serde_json::{Map, Value as Json};

type Obj = Map<String, Json>;

/// Bounds on a request's lists, beyond any real conversation; the body limit bounds the total,
/// these name the field instead of letting the template and tokenizer take the whole body.
pub const MAX_MESSAGES: usize = 1 << 16;
pub const MAX_CONTENT_PARTS: usize = 1 << 12;
pub const MAX_TOOL_CALLS: usize = 1 << 10;
/// Bytes of one DRY sequence breaker.
pub const MAX_BREAKER_BYTES: usize = 256;

/// Server-wide generation defaults; requests override them field by field.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// `enable_thinking` when the request does not say.
    pub think: bool,
    /// temperature, top_p, top_k, min_p without thinking.
    pub plain: (f32, f32, usize, f32),
    /// The same with thinking on.
    pub thinking: (f32, f32, usize, f32),
    pub presence_penalty: f32,
    pub repetition_penalty: f32,
    pub max_tokens: usize,
    pub thinking_budget: Option<usize>,
    pub loop_guard: usize,
}

impl Defaults {
    /// Per model family: Qwen3.x follows its model card (thinking off by default, 0.7/0.8/20;
    /// thinking on 1.0/0.95/20); others get `forge generate`'s defaults.
    pub fn for_model_type(model_type: &str) -> Self {
        let qwen3 = model_type.starts_with("qwen3");
        Defaults {
            think: false,
            plain: if qwen3 { (0.7, 0.8, 20, 0.0) } else { (0.7, 0.95, 40, 0.0) },
            thinking: if qwen3 { (1.0, 0.95, 20, 0.0) } else { (0.7, 0.95, 40, 0.0) },
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            max_tokens: 4096,
            thinking_budget: None,
            loop_guard: 256,
        }
    }
}

/// Server flags that replace the family defaults.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub think: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
    pub thinking_budget: Option<usize>,
    pub loop_guard: Option<usize>,
}

impl Overrides {
    pub fn apply(&self, d: &mut Defaults) {
        if let Some(t) = self.think {
            d.think = t;
        }
        for s in [&mut d.plain, &mut d.thinking] {
            if let Some(v) = self.temperature {
                s.0 = v;
            }
            if let Some(v) = self.top_p {
                s.1 = v;
            }
            if let Some(v) = self.top_k {
                s.2 = v;
            }
            if let Some(v) = self.min_p {
                s.3 = v;
            }
        }
        if let Some(v) = self.presence_penalty {
            d.presence_penalty = v;
        }
        if let Some(v) = self.repetition_penalty {
            d.repetition_penalty = v;
        }
        if let Some(v) = self.max_tokens {
            d.max_tokens = v;
        }
        if self.thinking_budget.is_some() {
            d.thinking_budget = self.thinking_budget;
        }
        if let Some(v) = self.loop_guard {
            d.loop_guard = v;
        }
    }
}

/// Fields shared by chat and text completions.
#[derive(Clone, Debug)]
pub struct Common {
    pub stream: bool,
    pub include_usage: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub penalties: Penalties,
    pub presence_set: bool,
    pub repetition_set: bool,
    pub stop: Vec<String>,
    pub max_tokens: Option<usize>,
    pub thinking_budget: Option<usize>,
    /// Loop-guard span for this request (0 = off); the server default otherwise.
    pub loop_guard: Option<usize>,
    /// Test hook (only honoured when the server enables test hooks).
    pub forced_output: Option<String>,
    /// `false` turns speculative decoding off for this request (Forge's field).
    pub speculative: Option<bool>,
    /// Keep generating past end-of-turn tokens, to `max_tokens` (vLLM's and llama.cpp's field,
    /// for benchmarks: every request then decodes its full length).
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: Common,
    /// Normalised for the template (see [`normalize_messages`]).
    pub messages: Json,
    /// Tools for the template and the parser (absent when `tool_choice` is "none").
    pub tools: Option<Vec<Json>>,
    pub template_kwargs: Obj,
    pub enable_thinking: Option<bool>,
    /// Chosen-token log-probs, with this many alternatives.
    pub logprobs: Option<usize>,
}

#[derive(Clone, Debug)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: PromptInput,
    pub echo: bool,
    pub logprobs: Option<usize>,
}

fn type_err(param: &str, what: &str) -> ApiError {
    ApiError::param(param, format!("'{param}' must be {what}"))
}

fn get<'a>(o: &'a Obj, key: &str) -> Option<&'a Json> {
    o.get(key).filter(|v| !v.is_null())
}

fn opt_f32(o: &Obj, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x >= lo as f64 && x <= hi as f64 => Ok(Some(x as f32)),
            _ => Err(type_err(key, &format!("a number between {lo} and {hi}"))),
        },
    }
}

fn opt_int(o: &Obj, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => {
            // 3.0 is accepted as 3, as Python clients sometimes send floats.
            let n = v.as_i64().or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9e15).map(|f| f as i64));
            match n {
                Some(x) if x >= lo && x <= hi => Ok(Some(x)),
                _ => Err(type_err(key, &format!("an integer between {lo} and {hi}"))),
            }
        }
    }
}

fn opt_bool(o: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    match get(o, key) {
        None => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(type_err(key, "a boolean")),
    }
}

fn parse_stop(o: &Obj) -> Result<Vec<String>, ApiError> {
    match get(o, "stop") {
        None => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![s.clone()]),
        Some(Json::Array(a)) if a.len() <= 16 => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| type_err("stop", "a string or a list of strings")))
            .collect(),
        Some(Json::Array(_)) => Err(ApiError::param("stop", "'stop' may hold at most 16 strings")),
        Some(_) => Err(type_err("stop", "a string or a list of strings")),
    }
    .and_then(|v: Vec<String>| {
        if v.iter().any(|s| s.len() > 512) {
            Err(ApiError::param("stop", "stop strings are limited to 512 bytes"))
        } else {
            Ok(v)
        }
    })
}

pub fn parse_common(o: &Obj, max_allowed_tokens: usize) -> Result<Common, ApiError> {
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match get(o, "stream_options") {
        None => false,
        Some(Json::Object(so)) => match get(so, "include_usage") {
            None => false,
            Some(Json::Bool(b)) => *b,
            Some(_) => return Err(type_err("stream_options.include_usage", "a boolean")),
        },
        Some(_) => return Err(type_err("stream_options", "an object")),
    };
    if let Some(n) = opt_int(o, "n", 1, i64::MAX).map_err(|_| ApiError::param("n", "only n = 1 is supported"))? {
        if n != 1 {
            return Err(ApiError::param("n", "only n = 1 is supported"));
        }
    }
    opt_int(o, "best_of", 1, 1).map_err(|_| ApiError::param("best_of", "only best_of = 1 is supported"))?;
    let max_tokens = match opt_int(o, "max_completion_tokens", 1, i64::MAX)? {
        Some(m) => Some(m),
        None => opt_int(o, "max_tokens", 1, i64::MAX)?,
    };
    let max_tokens = match max_tokens {
        Some(m) if m as u64 > max_allowed_tokens as u64 => {
            let p = if o.contains_key("max_completion_tokens") { "max_completion_tokens" } else { "max_tokens" };
            return Err(ApiError::param(
                p,
                format!("'{p}' is {m}, more than the context length of {max_allowed_tokens} tokens"),
            )
            .with_code("context_length_exceeded"));
        }
        m => m.map(|m| m as usize),
    };
    let top_k = opt_int(o, "top_k", -1, 1 << 30)?.map(|k| k.max(0) as usize);
    let seed = opt_int(o, "seed", i64::MIN, i64::MAX)
        .or_else(|e| match get(o, "seed").and_then(Json::as_u64) {
            Some(u) => Ok(Some(u as i64)),
            None => Err(e),
        })?
        .map(|s| s as u64);
    let d = Penalties::default();
    let presence = opt_f32(o, "presence_penalty", -2.0, 2.0)?;
    let repetition = opt_f32(o, "repetition_penalty", 0.01, 10.0)?;
    let breakers = match get(o, "dry_sequence_breakers") {
        None => d.dry_breakers.clone(),
        Some(Json::Array(a)) if a.len() <= 64 => a
            .iter()
            .map(|s| s.as_str().filter(|s| s.len() <= MAX_BREAKER_BYTES).map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                type_err("dry_sequence_breakers", &format!("a list of strings of at most {MAX_BREAKER_BYTES} bytes"))
            })?,
        Some(_) => return Err(type_err("dry_sequence_breakers", "a list of at most 64 strings")),
    };
    let last_n = |key: &str, default: usize| -> Result<usize, ApiError> {
        // -1 = the whole context (llama.cpp's convention), stored as 0.
        Ok(opt_int(o, key, -1, 1 << 30)?.map_or(default, |n| if n < 0 { 0 } else { n as usize }))
    };
    let penalties = Penalties {
        presence: presence.unwrap_or(0.0),
        frequency: opt_f32(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        repetition: repetition.unwrap_or(1.0),
        repeat_last_n: last_n("repeat_last_n", d.repeat_last_n)?,
        dry_multiplier: opt_f32(o, "dry_multiplier", 0.0, 100.0)?.unwrap_or(0.0),
        dry_base: opt_f32(o, "dry_base", 1.0, 100.0)?.unwrap_or(d.dry_base),
        dry_allowed_length: opt_int(o, "dry_allowed_length", 0, 1 << 20)?.map_or(d.dry_allowed_length, |n| n as usize),
        dry_last_n: last_n("dry_penalty_last_n", d.dry_last_n)?,
        dry_breakers: breakers,
    };
    let forced_output = match get(o, "x_forced_output") {
        None => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(_) => return Err(type_err("x_forced_output", "a string")),
    };
    Ok(Common {
        stream,
        include_usage,
        temperature: opt_f32(o, "temperature", 0.0, 2.0)?,
        top_p: opt_f32(o, "top_p", 0.0, 1.0)?,
        top_k,
        min_p: opt_f32(o, "min_p", 0.0, 1.0)?,
        seed,
        penalties,
        presence_set: presence.is_some(),
        repetition_set: repetition.is_some(),
        stop: parse_stop(o)?,
        max_tokens,
        thinking_budget: opt_int(o, "thinking_budget", 0, 1 << 30)?.map(|n| n as usize),
        loop_guard: opt_int(o, "loop_guard", 0, 1 << 20)?.map(|n| n as usize),
        forced_output,
        speculative: opt_bool(o, "speculative")?,
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
    })
}

/// Text of an OpenAI `content`: a string, or a list of parts of which only text is supported.
fn content_text(v: &Json, param: &str) -> Result<Json, ApiError> {
    match v {
        Json::Null => Ok(Json::Null),
        Json::String(_) => Ok(v.clone()),
        Json::Array(parts) if parts.len() > MAX_CONTENT_PARTS => {
            Err(ApiError::param(param, format!("at most {MAX_CONTENT_PARTS} content parts are supported")))
        }
        Json::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, p) in parts.iter().enumerate() {
                let pp = format!("{param}[{i}]");
                let Json::Object(po) = p else {
                    return Err(type_err(&pp, "a content part object"));
                };
                match po.get("type").and_then(Json::as_str) {
                    Some("text") | Some("input_text") => match po.get("text") {
                        Some(Json::String(t)) => texts.push(t.clone()),
                        _ => return Err(type_err(&format!("{pp}.text"), "a string")),
                    },
                    Some(other) => {
                        return Err(ApiError::param(
                            &format!("{pp}.type"),
                            format!("content parts of type '{other}' are not supported (text-only model)"),
                        ))
                    }
                    None => return Err(type_err(&format!("{pp}.type"), "a string")),
                }
            }
            Ok(Json::String(texts.join("\n")))
        }
        _ => Err(type_err(param, "a string or a list of content parts")),
    }
}

/// OpenAI messages → what HF chat templates expect: `developer` becomes `system`, content part
/// lists become text, and assistant `tool_calls` get their JSON-string `arguments` parsed into
/// objects (templates iterate over them). `reasoning_content` is kept for templates that replay it.
pub fn normalize_messages(v: Option<&Json>) -> Result<Json, ApiError> {
    let Some(Json::Array(list)) = v else {
        return Err(match v {
            None => ApiError::param("messages", "'messages' is required"),
            Some(_) => type_err("messages", "a list of messages"),
        });
    };
    if list.is_empty() {
        return Err(ApiError::param("messages", "'messages' must not be empty"));
    }
    if list.len() > MAX_MESSAGES {
        return Err(ApiError::param("messages", format!("at most {MAX_MESSAGES} messages are supported")));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Json::Object(mo) = m else {
            return Err(type_err(&p, "an object"));
        };
        let role = match mo.get("role").and_then(Json::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some("function") => "tool",
            Some(other) => {
                return Err(ApiError::param(&format!("{p}.role"), format!("unknown role '{other}'")));
            }
            None => return Err(type_err(&format!("{p}.role"), "a string")),
        };
        let mut nm = Obj::new();
        nm.insert("role".into(), Json::String(role.into()));
        let content = content_text(mo.get("content").unwrap_or(&Json::Null), &format!("{p}.content"))?;
        let has_calls = matches!(mo.get("tool_calls"), Some(Json::Array(a)) if !a.is_empty());
        if content.is_null() && !(role == "assistant" && (has_calls || mo.contains_key("reasoning_content"))) {
            if role == "assistant" {
                nm.insert("content".into(), Json::String(String::new()));
            } else {
                return Err(ApiError::param(&format!("{p}.content"), "'content' is required"));
            }
        } else {
            nm.insert("content".into(), if content.is_null() { Json::String(String::new()) } else { content });
        }
        for (k, v) in mo {
            match k.as_str() {
                "role" | "content" => {}
                "reasoning_content" | "reasoning" | "thinking" => match v {
                    Json::Null => {}
                    Json::String(_) => {
                        nm.insert("reasoning_content".into(), v.clone());
                    }
                    _ => return Err(type_err(&format!("{p}.{k}"), "a string")),
                },
                "tool_calls" => {
                    if v.is_null() {
                        continue;
                    }
                    nm.insert("tool_calls".into(), normalize_tool_calls(v, &format!("{p}.tool_calls"))?);
                }
                "name" | "tool_call_id" => match v {
                    Json::Null => {}
                    Json::String(_) => {
                        nm.insert(k.clone(), v.clone());
                    }
                    _ => return Err(type_err(&format!("{p}.{k}"), "a string")),
                },
                // Other fields (e.g. `refusal`, `annotations`) mean nothing to a template.
                _ => {}
            }
        }
        out.push(Json::Object(nm));
    }
    Ok(Json::Array(out))
}

fn normalize_tool_calls(v: &Json, p: &str) -> Result<Json, ApiError> {
    let Json::Array(calls) = v else {
        return Err(type_err(p, "a list of tool calls"));
    };
    if calls.len() > MAX_TOOL_CALLS {
        return Err(ApiError::param(p, format!("at most {MAX_TOOL_CALLS} tool calls per message are supported")));
    }
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let cp = format!("{p}[{j}]");
        let Json::Object(co) = c else {
            return Err(type_err(&cp, "an object"));
        };
        let Some(Json::Object(f)) = co.get("function") else {
            return Err(type_err(&format!("{cp}.function"), "an object"));
        };
        let Some(Json::String(name)) = f.get("name") else {
            return Err(type_err(&format!("{cp}.function.name"), "a string"));
        };
        let args = match f.get("arguments") {
            None | Some(Json::Null) => Json::Object(Obj::new()),
            // Templates iterate over the arguments, so a JSON object string is parsed; other
            // strings are passed through as they are.
            Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
                Ok(o @ Json::Object(_)) => o,
                _ => Json::String(s.clone()),
            },
            Some(o @ Json::Object(_)) => o.clone(),
            Some(_) => return Err(type_err(&format!("{cp}.function.arguments"), "a JSON string")),
        };
        let mut func = Obj::new();
        func.insert("name".into(), Json::String(name.clone()));
        func.insert("arguments".into(), args);
        let mut nc = Obj::new();
        if let Some(id) = co.get("id").filter(|x| x.is_string()) {
            nc.insert("id".into(), id.clone());
        }
        nc.insert("type".into(), Json::String("function".into()));
        nc.insert("function".into(), Json::Object(func));
        out.push(Json::Object(nc));
    }
    Ok(Json::Array(out))
}

fn parse_tools(o: &Obj) -> Result<Option<Vec<Json>>, ApiError> {
    let Some(v) = get(o, "tools") else { return Ok(None) };
    let Json::Array(a) = v else {
        return Err(type_err("tools", "a list of tools"));
    };
    if a.len() > 512 {
        return Err(ApiError::param("tools", "at most 512 tools are supported"));
    }
    for (i, t) in a.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Json::Object(to) = t else {
            return Err(type_err(&p, "an object"));
        };
        match to.get("type").and_then(Json::as_str) {
            Some("function") | None => {}
            Some(other) => {
                return Err(ApiError::param(&format!("{p}.type"), format!("tool type '{other}' is not supported")))
            }
        }
        let Some(Json::Object(f)) = to.get("function") else {
            return Err(type_err(&format!("{p}.function"), "an object"));
        };
        if !matches!(f.get("name"), Some(Json::String(n)) if !n.is_empty()) {
            return Err(type_err(&format!("{p}.function.name"), "a non-empty string"));
        }
        if let Some(params) = f.get("parameters") {
            if !params.is_object() && !params.is_null() {
                return Err(type_err(&format!("{p}.function.parameters"), "a JSON schema object"));
            }
        }
    }
    Ok(if a.is_empty() { None } else { Some(a.clone()) })
}

pub fn parse_chat(v: &Json, max_allowed_tokens: usize) -> Result<ChatRequest, ApiError> {
    let Json::Object(o) = v else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    let common = parse_common(o, max_allowed_tokens)?;
    let messages = normalize_messages(o.get("messages"))?;
    let mut tools = parse_tools(o)?;
    match get(o, "tool_choice") {
        None => {}
        Some(Json::String(s)) => match s.as_str() {
            "none" => tools = None,
            // Without constrained decoding "required" and named choices are best effort: the
            // model sees the tools and its calls are parsed.
            "auto" | "required" => {}
            other => return Err(ApiError::param("tool_choice", format!("unknown tool_choice '{other}'"))),
        },
        Some(Json::Object(_)) => {}
        Some(_) => return Err(type_err("tool_choice", "a string or an object")),
    }
    let template_kwargs = match get(o, "chat_template_kwargs") {
        None => Obj::new(),
        Some(Json::Object(k)) => k.clone(),
        Some(_) => return Err(type_err("chat_template_kwargs", "an object")),
    };
    let enable_thinking = match template_kwargs.get("enable_thinking") {
        None | Some(Json::Null) => opt_bool(o, "enable_thinking")?,
        Some(Json::Bool(b)) => Some(*b),
        Some(_) => return Err(type_err("chat_template_kwargs.enable_thinking", "a boolean")),
    };
    let logprobs = match opt_bool(o, "logprobs")? {
        Some(true) => Some(opt_int(o, "top_logprobs", 0, 20)?.unwrap_or(0) as usize),
        _ => {
            opt_int(o, "top_logprobs", 0, 20)?;
            None
        }
    };
    Ok(ChatRequest { common, messages, tools, template_kwargs, enable_thinking, logprobs })
}

pub fn parse_completion(v: &Json, max_allowed_tokens: usize) -> Result<CompletionRequest, ApiError> {
    let Json::Object(o) = v else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    let common = parse_common(o, max_allowed_tokens)?;
    let bad = || type_err("prompt", "a string, a list of one string, or a list of token ids");
    let ids = |a: &[Json]| -> Result<Vec<u32>, ApiError> {
        if a.len() > max_allowed_tokens {
            return Err(ApiError::param(
                "prompt",
                format!("the prompt has {} tokens, more than the context length of {max_allowed_tokens}", a.len()),
            )
            .with_code("context_length_exceeded"));
        }
        a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(bad)).collect()
    };
    let prompt = match get(o, "prompt") {
        None => return Err(ApiError::param("prompt", "'prompt' is required")),
        Some(Json::String(s)) => PromptInput::Text(s.clone()),
        Some(Json::Array(a)) => match a.as_slice() {
            [Json::String(s)] => PromptInput::Text(s.clone()),
            [Json::Array(inner)] => PromptInput::Tokens(ids(inner)?),
            items if !items.is_empty() && items.iter().all(Json::is_number) => PromptInput::Tokens(ids(items)?),
            _ => return Err(ApiError::param("prompt", "exactly one prompt per request is supported")),
        },
        Some(_) => return Err(bad()),
    };
    if let PromptInput::Tokens(t) = &prompt {
        if t.is_empty() {
            return Err(ApiError::param("prompt", "'prompt' must not be empty"));
        }
    }
    let logprobs = opt_int(o, "logprobs", 0, 20)?.map(|n| n as usize);
    Ok(CompletionRequest { common, prompt, echo: opt_bool(o, "echo")?.unwrap_or(false), logprobs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wrong_types_name_their_field() {
        let cases = [
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e9}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "n": 2}), "n"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": [1]}), "stop"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}}),
                "chat_template_kwargs.enable_thinking",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": true}),
                "top_logprobs",
            ),
        ];
        for (body, param) in cases {
            let e = parse_chat(&body, 4096).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(e.status, 400);
        }
        assert!(parse_chat(&json!([1]), 4096).is_err());
    }

    #[test]
    fn messages_are_normalised_for_templates() {
        let body = json!({"messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}]},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "reasoning_content": "look it up",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        ], "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
           "seed": -1, "top_k": -1, "chat_template_kwargs": {"enable_thinking": true}, "logprobs": true, "top_logprobs": 3});
        let r = parse_chat(&body, 4096).unwrap();
        let m = &r.messages;
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief.\nReally."}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], json!({"city": "Oslo"}));
        assert_eq!(m[2]["content"], "");
        assert_eq!(m[2]["reasoning_content"], "look it up");
        assert_eq!(m[3]["tool_call_id"], "c1");
        assert_eq!(r.tools.as_ref().unwrap().len(), 1);
        assert_eq!(r.enable_thinking, Some(true));
        assert_eq!(r.common.seed, Some(u64::MAX));
        assert_eq!(r.common.top_k, Some(0));
        assert_eq!(r.logprobs, Some(3));
        let none = parse_chat(
            &json!({"messages": [{"role": "user", "content": "x"}], "tools": body["tools"], "tool_choice": "none"}),
            4096,
        );
        assert!(none.unwrap().tools.is_none());
    }

    #[test]
    fn completion_prompts() {
        let r = parse_completion(&json!({"prompt": [1, 2, 3], "max_tokens": 4}), 4096).unwrap();
        assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[1, 2, 3]));
        let r = parse_completion(&json!({"prompt": ["a"]}), 4096).unwrap();
        assert!(matches!(r.prompt, PromptInput::Text(ref t) if t == "a"));
        assert_eq!(
            parse_completion(&json!({"prompt": ["a", "b"]}), 4096).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert_eq!(parse_completion(&json!({"prompt": [-1]}), 4096).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(parse_completion(&json!({}), 4096).unwrap_err().param.as_deref(), Some("prompt"));
    }

    #[test]
    fn absurd_sizes_are_refused_naming_the_field() {
        let user = json!({"role": "user", "content": "x"});
        let chat = |extra: Json| {
            let mut body = json!({"messages": [user.clone()]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse_chat(&body, 4096).expect_err(&body.to_string())
        };
        let cases = [
            (json!({"max_tokens": 1e300}), "max_tokens"),
            (json!({"max_tokens": u64::MAX}), "max_tokens"),
            (json!({"max_completion_tokens": i64::MAX}), "max_completion_tokens"),
            (json!({"n": 1_000_000_000}), "n"),
            (json!({"n": -1}), "n"),
            (json!({"best_of": 1e20}), "best_of"),
            (json!({"top_logprobs": 1_000_000, "logprobs": true}), "top_logprobs"),
            (json!({"top_k": 1u64 << 40}), "top_k"),
            (json!({"repeat_last_n": 1u64 << 40}), "repeat_last_n"),
            (json!({"dry_allowed_length": u64::MAX}), "dry_allowed_length"),
            (json!({"thinking_budget": 1e19}), "thinking_budget"),
            (json!({"stop": vec!["x"; 100_000]}), "stop"),
            (json!({"stop": "x".repeat(1 << 20)}), "stop"),
            (json!({"tools": vec![json!({"type": "function", "function": {"name": "f"}}); 100_000]}), "tools"),
            (json!({"dry_sequence_breakers": vec!["x"; 100_000]}), "dry_sequence_breakers"),
            (json!({"dry_sequence_breakers": ["x".repeat(1 << 20)]}), "dry_sequence_breakers"),
            (json!({"messages": vec![user.clone(); MAX_MESSAGES + 1]}), "messages"),
            (
                json!({"messages": [{"role": "user", "content": vec![json!({"type": "text", "text": "x"}); MAX_CONTENT_PARTS + 1]}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": null,
                    "tool_calls": vec![json!({"function": {"name": "f"}}); MAX_TOOL_CALLS + 1]}]}),
                "messages[0].tool_calls",
            ),
        ];
        for (extra, param) in cases {
            let e = chat(extra.clone());
            assert_eq!(e.param.as_deref(), Some(param), "{}: {}", param, e.message);
            assert_eq!(e.status, 400);
        }
        let e = parse_completion(&json!({"prompt": vec![1; 4097]}), 4096).unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("prompt"), Some("context_length_exceeded")));
        let e = parse_completion(&json!({"prompt": [vec![1; 1 << 20]]}), 4096).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // At the bounds the request is accepted.
        assert!(parse_chat(&json!({"messages": vec![user.clone(); MAX_MESSAGES]}), 4096).is_ok());
        assert!(parse_completion(&json!({"prompt": vec![1; 4096]}), 4096).is_ok());
    }

    #[test]
    fn overrides_replace_family_defaults() {
        let mut d = Defaults::for_model_type("qwen3_5");
        assert_eq!((d.think, d.plain, d.thinking), (false, (0.7, 0.8, 20, 0.0), (1.0, 0.95, 20, 0.0)));
        Overrides { temperature: Some(0.0), think: Some(true), ..Default::default() }.apply(&mut d);
        assert_eq!((d.think, d.plain.0, d.thinking.0), (true, 0.0, 0.0));
    }
}
