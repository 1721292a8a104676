//! Incremental parsing of generated text into what the OpenAI API returns: reasoning
//! (`<think>…</think>` → `reasoning_content`), visible content, and tool calls in the Qwen
//! families' formats:
//!
//! * Qwen3.5 / Qwen3-Coder XML style:
//!   `<tool_call><function=NAME><parameter=P>value</parameter>…</function></tool_call>`; values are
//!   raw text, typed here by the tool's JSON schema;
//! * Qwen2.5 / Qwen3 JSON style: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
//!
//! The parser is fed text in arbitrary pieces (whatever the detokenizer releases) and emits
//! [`Delta`]s as soon as they are certain; text that might still turn into a tag is held back. The
//! concatenation of its output does not depend on how the input was split, which the tests check.

use serde_json::{Map, Value as Json};
use std::collections::HashMap;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNC_OPEN: &str = "<function=";
const FUNC_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// A `<function=NAME>` or `<parameter=NAME>` header longer than this is not a tag; neither is a
/// `<tool_call>` whose body starts after more whitespace than this.
const MAX_TAG: usize = 256;
/// [`OutputParser::push`] feeds its text through in pieces of about this many bytes, so that the
/// buffers stay small and consuming from their front stays cheap however large one push is.
const PUSH_PIECE: usize = 1024;

#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// A tool call begins: its index in `tool_calls`, its id and its function name.
    ToolStart {
        index: usize,
        id: String,
        name: String,
    },
    /// The next piece of a tool call's JSON `arguments` string.
    ToolArgs {
        index: usize,
        fragment: String,
    },
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Everything a complete response carries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Parsed {
    pub fn add(&mut self, d: &Delta) {
        match d {
            Delta::Reasoning(s) => self.reasoning.push_str(s),
            Delta::Content(s) => self.content.push_str(s),
            Delta::ToolStart { index, id, name } => {
                while self.tool_calls.len() <= *index {
                    self.tool_calls.push(ToolCall::default());
                }
                self.tool_calls[*index].id = id.clone();
                self.tool_calls[*index].name = name.clone();
            }
            Delta::ToolArgs { index, fragment } => {
                if let Some(c) = self.tool_calls.get_mut(*index) {
                    c.arguments.push_str(fragment);
                }
            }
        }
    }
}

/// Parameter schemas of the request's tools: function name → (parameter → JSON schema).
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    map: HashMap<String, Map<String, Json>>,
}

impl ToolSchemas {
    /// From an OpenAI `tools` array (entries without a usable schema simply get no typing).
    pub fn from_tools(tools: &[Json]) -> Self {
        let mut map = HashMap::new();
        for t in tools {
            let f = t.get("function").unwrap_or(t);
            if let Some(name) = f.get("name").and_then(Json::as_str) {
                let props = f
                    .get("parameters")
                    .and_then(|p| p.get("properties"))
                    .and_then(Json::as_object)
                    .cloned()
                    .unwrap_or_default();
                map.insert(name.to_string(), props);
            }
        }
        ToolSchemas { map }
    }

    fn param(&self, func: &str, param: &str) -> Option<&Json> {
        self.map.get(func)?.get(param)
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of `marker` (text to hold back
/// because the next piece may complete the marker).
fn partial_suffix(buf: &str, marker: &str) -> usize {
    let max = buf.len().min(marker.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| buf.is_char_boundary(buf.len() - k) && marker.starts_with(&buf[buf.len() - k..]))
        .unwrap_or(0)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ThinkState {
    /// Nothing but whitespace seen yet: the output may still open with `<think>`.
    Start,
    Think,
    Content,
}

/// Splits `<think>…</think>` from the answer. Whitespace around the reasoning and at the start of
/// the answer after it is dropped (templates put newlines there).
struct ReasoningSplitter {
    state: ThinkState,
    buf: String,
    /// Still at the start of the reasoning or of the answer after it: drop whitespace.
    trim_lead: bool,
    /// `buf[..ws]` is whitespace already looked at (leading whitespace before a possible
    /// `<think>`, or reasoning's trailing whitespace held back): not scanned again.
    ws: usize,
}

enum Seg {
    Reasoning(String),
    Content(String),
}

impl ReasoningSplitter {
    fn new(starts_in_reasoning: bool) -> Self {
        let state = if starts_in_reasoning { ThinkState::Think } else { ThinkState::Start };
        ReasoningSplitter { state, buf: String::new(), trim_lead: starts_in_reasoning, ws: 0 }
    }

    fn push(&mut self, text: &str, out: &mut Vec<Seg>) {
        self.buf.push_str(text);
        loop {
            match self.state {
                ThinkState::Start => {
                    let t = self.buf[self.ws..].trim_start();
                    self.ws = self.buf.len() - t.len();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.state = ThinkState::Think;
                        self.trim_lead = true;
                        self.ws = 0;
                    } else if THINK_OPEN.starts_with(t) {
                        return;
                    } else {
                        self.state = ThinkState::Content;
                        self.ws = 0;
                    }
                }
                ThinkState::Think => {
                    if self.trim_lead {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        self.trim_lead = false;
                    }
                    // No tag starts in the whitespace held back.
                    if let Some(p) = self.buf[self.ws..].find(THINK_CLOSE).map(|p| p + self.ws) {
                        let r = self.buf[..p].trim_end();
                        if !r.is_empty() {
                            out.push(Seg::Reasoning(r.to_string()));
                        }
                        self.buf = self.buf[p + THINK_CLOSE.len()..].to_string();
                        self.state = ThinkState::Content;
                        self.trim_lead = true;
                        self.ws = 0;
                        continue;
                    }
                    let body = self.buf.len() - partial_suffix(&self.buf, THINK_CLOSE);
                    let known = self.ws.min(body);
                    let tail = self.buf[known..body].trim_end().len();
                    let e = if tail == 0 { 0 } else { known + tail };
                    if e > 0 {
                        out.push(Seg::Reasoning(self.buf[..e].to_string()));
                        self.buf.drain(..e);
                    }
                    self.ws = body - e;
                    return;
                }
                ThinkState::Content => {
                    if self.trim_lead {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        self.trim_lead = false;
                    }
                    if !self.buf.is_empty() {
                        out.push(Seg::Content(std::mem::take(&mut self.buf)));
                    }
                    return;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Seg>) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            ThinkState::Start if !rest.is_empty() => out.push(Seg::Content(rest)),
            ThinkState::Think => {
                let r = rest.trim_end();
                if !r.is_empty() {
                    out.push(Seg::Reasoning(r.to_string()));
                }
            }
            _ => {}
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum CallStyle {
    /// After `<tool_call>`, before its first non-space character.
    Unknown,
    Json,
    Xml,
}

/// An XML-style call in progress.
#[derive(Clone, Debug)]
struct XmlCall {
    index: usize,
    name: String,
    params: usize,
    /// `</function>` seen: arguments closed.
    closed: bool,
}

/// Pulls tool calls out of the answer text.
struct ToolParser {
    schemas: ToolSchemas,
    id_prefix: String,
    in_call: bool,
    /// The call was opened by `<tool_call>` (else by a bare `<function=`; it ends at `</function>`).
    wrapped: bool,
    style: CallStyle,
    xml: Option<XmlCall>,
    buf: String,
    /// Trailing whitespace of the text, held until we know whether a call follows.
    ws: String,
    /// A call just ended: whitespace up to the next text is the template's separator.
    after_call: bool,
    calls: usize,
    /// Set when a search for a closing tag (`</tool_call>`, `</parameter>`) failed: the length of
    /// `buf` then, so that the next search, after more text is appended, resumes near its end.
    /// Only the step right after the failed search may use it (see [`Self::step_call`]).
    scanned: usize,
}

impl ToolParser {
    fn new(schemas: ToolSchemas, id_prefix: String) -> Self {
        ToolParser {
            schemas,
            id_prefix,
            in_call: false,
            wrapped: false,
            style: CallStyle::Unknown,
            xml: None,
            buf: String::new(),
            ws: String::new(),
            after_call: false,
            calls: 0,
            scanned: 0,
        }
    }

    /// Plain answer text. Whitespace around calls is noise the templates insert: trailing
    /// whitespace is held back (and dropped when a call follows), whitespace after a call dropped.
    fn text(&mut self, s: &str, out: &mut Vec<Delta>) {
        let mut s = s;
        if self.after_call {
            // `ws` holds whitespace only: dropped with the separator.
            self.ws.clear();
            s = s.trim_start();
            if s.is_empty() {
                return;
            }
            self.after_call = false;
        }
        let e = s.trim_end().len();
        if e > 0 {
            let mut content = std::mem::take(&mut self.ws);
            content.push_str(&s[..e]);
            out.push(Delta::Content(content));
        }
        self.ws.push_str(&s[e..]);
    }

    /// Where `marker` starts in `buf[from..]` (as an index into `buf`), looking only past the
    /// part that the failed search of the previous step covered (`resume`, 0 for none).
    fn find_close(&self, from: usize, resume: usize, marker: &str) -> Option<usize> {
        let mut start = from.max(resume.saturating_sub(marker.len() - 1)).min(self.buf.len());
        while !self.buf.is_char_boundary(start) {
            start -= 1;
        }
        self.buf[start..].find(marker).map(|p| start + p)
    }

    fn start_call(&mut self, name: String, out: &mut Vec<Delta>) -> usize {
        self.ws.clear();
        let index = self.calls;
        self.calls += 1;
        out.push(Delta::ToolStart { index, id: format!("{}{index}", self.id_prefix), name });
        index
    }

    fn push(&mut self, text: &str, out: &mut Vec<Delta>) {
        self.buf.push_str(text);
        loop {
            if !self.in_call {
                let found = [CALL_OPEN, FUNC_OPEN]
                    .iter()
                    .filter_map(|m| self.buf.find(m).map(|p| (p, *m)))
                    .min_by_key(|&(p, _)| p);
                if let Some((p, marker)) = found {
                    let pre = self.buf[..p].to_string();
                    self.text(&pre, out);
                    self.in_call = true;
                    self.xml = None;
                    if marker == CALL_OPEN {
                        self.wrapped = true;
                        self.style = CallStyle::Unknown;
                        self.buf.drain(..p + CALL_OPEN.len());
                    } else {
                        self.wrapped = false;
                        self.style = CallStyle::Xml;
                        self.buf.drain(..p);
                    }
                    continue;
                }
                let hold = partial_suffix(&self.buf, CALL_OPEN).max(partial_suffix(&self.buf, FUNC_OPEN));
                let emit: String = self.buf.drain(..self.buf.len() - hold).collect();
                self.text(&emit, out);
                return;
            }
            if !self.step_call(out, false) {
                return;
            }
        }
    }

    /// Advances the call in progress; true when it made progress and should be called again.
    fn step_call(&mut self, out: &mut Vec<Delta>, at_end: bool) -> bool {
        // Valid only if the previous step ended in a failed search and `buf` has only grown since.
        let resume = std::mem::take(&mut self.scanned);
        match self.style {
            CallStyle::Unknown => {
                let t = self.buf.trim_start();
                let lead = self.buf.len() - t.len();
                if lead <= MAX_TAG && t.starts_with('{') {
                    self.style = CallStyle::Json;
                } else if lead <= MAX_TAG && t.starts_with(FUNC_OPEN) {
                    self.style = CallStyle::Xml;
                } else if !at_end && lead <= MAX_TAG && (t.is_empty() || FUNC_OPEN.starts_with(t)) {
                    return false;
                } else {
                    // Not a call after all: give the text back.
                    self.in_call = false;
                    if at_end {
                        let raw = format!("{CALL_OPEN}{}", std::mem::take(&mut self.buf));
                        self.text(&raw, out);
                        return false;
                    }
                    // The opening tag is text; the rest is rescanned for another call.
                    self.text(CALL_OPEN, out);
                }
                true
            }
            CallStyle::Json => {
                let end = self.find_close(0, resume, CALL_CLOSE);
                if end.is_none() && !at_end {
                    self.scanned = self.buf.len();
                    return false;
                }
                let body_end = end.unwrap_or(self.buf.len());
                let parsed = parse_json_call(self.buf[..body_end].trim());
                let consumed = end.map_or(self.buf.len(), |p| p + CALL_CLOSE.len());
                let raw: String = self.buf.drain(..consumed).collect();
                self.in_call = false;
                match parsed {
                    Some((name, args)) => {
                        let index = self.start_call(name, out);
                        out.push(Delta::ToolArgs { index, fragment: args });
                        self.after_call = true;
                    }
                    None => {
                        let text = format!("{CALL_OPEN}{raw}");
                        self.text(&text, out);
                    }
                }
                !at_end
            }
            CallStyle::Xml => self.step_xml(out, at_end, resume),
        }
    }

    fn close_args(&mut self, out: &mut Vec<Delta>) {
        if let Some(x) = self.xml.as_mut() {
            if !x.closed {
                x.closed = true;
                let fragment = if x.params == 0 { "{}" } else { "}" }.to_string();
                out.push(Delta::ToolArgs { index: x.index, fragment });
            }
        }
    }

    fn end_call(&mut self, out: &mut Vec<Delta>) {
        self.close_args(out);
        self.xml = None;
        self.in_call = false;
        self.after_call = true;
    }

    fn step_xml(&mut self, out: &mut Vec<Delta>, at_end: bool, resume: usize) -> bool {
        let mut resume = resume;
        if self.xml.is_some() {
            // Inside a call whitespace between tags means nothing: dropped as it arrives, so
            // that a long run of it is not scanned again at every step.
            let lead = self.buf.len() - self.buf.trim_start().len();
            if lead > 0 {
                self.buf.drain(..lead);
                resume = 0;
            }
        }
        let lead = self.buf.len() - self.buf.trim_start().len();
        let t = &self.buf[lead..];
        let open_fn = self.xml.as_ref().is_none_or(|x| x.closed);
        if open_fn && t.starts_with(FUNC_OPEN) {
            let Some(gt) = tag_end(t) else {
                if at_end || t.len() >= MAX_TAG {
                    return self.xml_garbage(out, at_end);
                }
                return false;
            };
            let name = t[FUNC_OPEN.len()..gt].trim().to_string();
            let consumed = lead + gt + 1;
            self.buf.drain(..consumed);
            self.close_args(out);
            let index = self.start_call(name.clone(), out);
            self.xml = Some(XmlCall { index, name, params: 0, closed: false });
            return true;
        }
        if !open_fn && t.starts_with(PARAM_OPEN) {
            let gt = tag_end(t);
            let close = gt.and_then(|g| self.find_close(lead + g + 1, resume, PARAM_CLOSE)).map(|c| c - lead);
            let t = &self.buf[lead..];
            let (Some(gt), Some(close)) = (gt, close) else {
                if gt.is_none() && t.len() >= MAX_TAG {
                    return self.xml_garbage(out, at_end);
                }
                if at_end {
                    // Generation stopped inside a parameter: keep what was written.
                    if let Some(gt) = gt {
                        let (pname, value) = (t[PARAM_OPEN.len()..gt].trim().to_string(), t[gt + 1..].to_string());
                        self.buf.clear();
                        self.emit_param(&pname, &value, out);
                    } else {
                        self.buf.clear();
                    }
                } else if gt.is_some() {
                    self.scanned = self.buf.len();
                }
                return false;
            };
            let pname = t[PARAM_OPEN.len()..gt].trim().to_string();
            let value = t[gt + 1..close].to_string();
            let consumed = lead + close + PARAM_CLOSE.len();
            self.buf.drain(..consumed);
            self.emit_param(&pname, &value, out);
            return true;
        }
        if t.starts_with(FUNC_CLOSE) {
            self.buf.drain(..lead + FUNC_CLOSE.len());
            self.close_args(out);
            if !self.wrapped {
                self.end_call(out);
            }
            return true;
        }
        if t.starts_with(CALL_CLOSE) {
            self.buf.drain(..lead + CALL_CLOSE.len());
            self.end_call(out);
            return true;
        }
        let tags = [FUNC_OPEN, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE];
        if !at_end && (t.is_empty() || tags.iter().any(|tag| tag.starts_with(t))) {
            return false;
        }
        self.xml_garbage(out, at_end)
    }

    /// Text inside a call that is not one of its tags: skip to the next tag, or give up on a call
    /// that never started.
    fn xml_garbage(&mut self, out: &mut Vec<Delta>, at_end: bool) -> bool {
        if self.xml.is_none() {
            // Nothing parsed: this was not a call.
            self.in_call = false;
            if at_end {
                let raw = std::mem::take(&mut self.buf);
                let text = if self.wrapped { format!("{CALL_OPEN}{raw}") } else { raw };
                self.text(&text, out);
                return false;
            }
            // Its opening tag is text; the rest is scanned again for calls, as it would be had it
            // arrived later.
            if self.wrapped {
                self.text(CALL_OPEN, out);
            } else {
                self.buf.drain(..FUNC_OPEN.len());
                self.text(FUNC_OPEN, out);
            }
            return true;
        }
        if at_end {
            self.buf.clear();
            self.end_call(out);
            return false;
        }
        // Skip up to the next '<' after the first character.
        match self.buf.char_indices().skip(1).find(|&(_, c)| c == '<') {
            Some((i, _)) => {
                self.buf.drain(..i);
                true
            }
            None => {
                self.buf.clear();
                false
            }
        }
    }

    fn emit_param(&mut self, pname: &str, raw: &str, out: &mut Vec<Delta>) {
        let Some(x) = self.xml.as_mut() else { return };
        let value = typed_value(raw, self.schemas.param(&x.name, pname));
        let key = serde_json::to_string(pname).unwrap_or_else(|_| "\"\"".into());
        let val = serde_json::to_string(&value).unwrap_or_else(|_| "null".into());
        let sep = if x.params == 0 { "{" } else { ", " };
        x.params += 1;
        out.push(Delta::ToolArgs { index: x.index, fragment: format!("{sep}{key}: {val}") });
    }

    fn finish(&mut self, out: &mut Vec<Delta>) {
        // Bounded: each step either consumes input or ends the call.
        for _ in 0..10_000 {
            if !self.in_call {
                break;
            }
            if !self.step_call(out, true) && self.in_call {
                self.buf.clear();
                self.end_call(out);
            }
        }
        if !self.in_call {
            let rest = std::mem::take(&mut self.buf);
            if !rest.is_empty() {
                self.text(&rest, out);
            }
        }
        let ws = std::mem::take(&mut self.ws);
        if self.calls == 0 && !ws.is_empty() {
            out.push(Delta::Content(ws));
        }
    }
}

/// The `>` closing a tag header, looked for only within [`MAX_TAG`] bytes so that the decision
/// does not depend on how much text has arrived.
fn tag_end(t: &str) -> Option<usize> {
    t.as_bytes().iter().take(MAX_TAG).position(|&b| b == b'>')
}

/// `{"name": …, "arguments": {…}}` (or `"parameters"`, or arguments as a JSON string) → name and
/// the arguments as a compact JSON string.
fn parse_json_call(s: &str) -> Option<(String, String)> {
    let v: Json = serde_json::from_str(s).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Json::Null) => "{}".to_string(),
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(parsed) => parsed.to_string(),
            Err(_) => s.clone(),
        },
        Some(other) => other.to_string(),
    };
    Some((name, args))
}

/// The JSON value of an XML parameter's raw text, by its schema `type`: strings stay verbatim,
/// numbers/booleans/null/objects/arrays are parsed, and anything that does not parse as its
/// declared type stays a string. Without a schema, JSON-looking text is parsed.
pub fn typed_value(raw: &str, schema: Option<&Json>) -> Json {
    // The templates write `<parameter=p>\nVALUE\n</parameter>`.
    let raw = raw.strip_prefix('\n').unwrap_or(raw);
    let raw = raw.strip_suffix('\n').unwrap_or(raw);
    let types: Vec<&str> = match schema.and_then(|s| s.get("type")) {
        Some(Json::String(t)) => vec![t.as_str()],
        Some(Json::Array(a)) => a.iter().filter_map(Json::as_str).collect(),
        _ => Vec::new(),
    };
    let t = raw.trim();
    if types.is_empty() {
        return match serde_json::from_str::<Json>(t) {
            Ok(v) if !t.is_empty() => v,
            _ => Json::String(raw.to_string()),
        };
    }
    for ty in &types {
        let v = match *ty {
            "string" => continue,
            "integer" => t.parse::<i64>().ok().map(Json::from),
            "number" => t
                .parse::<i64>()
                .ok()
                .map(Json::from)
                .or_else(|| t.parse::<f64>().ok().and_then(serde_json::Number::from_f64).map(Json::Number)),
            "boolean" => match t.to_ascii_lowercase().as_str() {
                "true" => Some(Json::Bool(true)),
                "false" => Some(Json::Bool(false)),
                _ => None,
            },
            "null" => matches!(t, "null" | "None" | "").then_some(Json::Null),
            "object" => serde_json::from_str::<Json>(t).ok().filter(Json::is_object),
            "array" => serde_json::from_str::<Json>(t).ok().filter(Json::is_array),
            _ => None,
        };
        if let Some(v) = v {
            return v;
        }
    }
    Json::String(raw.to_string())
}

/// Reasoning split followed (when the request has tools) by tool-call parsing.
pub struct OutputParser {
    reasoning: ReasoningSplitter,
    tools: Option<ToolParser>,
}

impl OutputParser {
    /// `starts_in_reasoning`: the prompt already opened `<think>`. `tools`: parse tool calls typed
    /// by these schemas, with ids `{id_prefix}{index}`.
    pub fn new(starts_in_reasoning: bool, tools: Option<ToolSchemas>, id_prefix: &str) -> Self {
        OutputParser {
            reasoning: ReasoningSplitter::new(starts_in_reasoning),
            tools: tools.map(|s| ToolParser::new(s, id_prefix.to_string())),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(PUSH_PIECE);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let mut segs = Vec::new();
            self.reasoning.push(&rest[..cut], &mut segs);
            out.extend(self.route(segs, false));
            rest = &rest[cut..];
        }
        coalesce(out)
    }

    pub fn finish(&mut self) -> Vec<Delta> {
        let mut segs = Vec::new();
        self.reasoning.finish(&mut segs);
        self.route(segs, true)
    }

    fn route(&mut self, segs: Vec<Seg>, at_end: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        for s in segs {
            match s {
                Seg::Reasoning(r) => out.push(Delta::Reasoning(r)),
                Seg::Content(c) => match self.tools.as_mut() {
                    Some(t) => t.push(&c, &mut out),
                    None => out.push(Delta::Content(c)),
                },
            }
        }
        if at_end {
            if let Some(t) = self.tools.as_mut() {
                t.finish(&mut out);
            }
        }
        coalesce(out)
    }

    /// Whether any tool call was emitted.
    pub fn has_tool_calls(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.calls > 0)
    }
}

/// Merges neighbouring deltas of the same kind (fewer, larger stream chunks).
fn coalesce(v: Vec<Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::with_capacity(v.len());
    for d in v {
        match (out.last_mut(), d) {
            (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
            (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
            (Some(Delta::ToolArgs { index: i, fragment: a }), Delta::ToolArgs { index: j, fragment: b }) if *i == j => {
                a.push_str(&b)
            }
            (_, d) => out.push(d),
        }
    }
    out
}

/// One-shot parse of a complete output.
pub fn parse_all(text: &str, starts_in_reasoning: bool, tools: Option<ToolSchemas>, id_prefix: &str) -> Parsed {
    let mut p = OutputParser::new(starts_in_reasoning, tools, id_prefix);
    let mut out = Parsed::default();
    for d in p.push(text).iter().chain(p.finish().iter()) {
        out.add(d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> ToolSchemas {
        ToolSchemas::from_tools(&[
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
                "note": {"type": ["null", "string"]}}}}}),
            json!({"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}),
        ])
    }

    fn args(p: &Parsed, i: usize) -> Json {
        serde_json::from_str(&p.tool_calls[i].arguments)
            .unwrap_or_else(|e| panic!("arguments {:?}: {e}", p.tool_calls[i].arguments))
    }

    /// Splits `text` at every char boundary pattern derived from `seed` and checks the streamed
    /// parse equals the one-shot parse.
    fn chunked(text: &str, think: bool, tools: Option<ToolSchemas>, seed: u64) -> Parsed {
        let mut rng = forge_model::sampling::Rng::new(seed);
        let mut p = OutputParser::new(think, tools, "call_");
        let mut out = Parsed::default();
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let mut i = 0;
        while i < chars.len() {
            let n = 1 + (rng.next_u64() % 7) as usize;
            let j = (i + n).min(chars.len());
            let end = if j == chars.len() { text.len() } else { chars[j].0 };
            for d in p.push(&text[chars[i].0..end]) {
                out.add(&d);
            }
            i = j;
        }
        for d in p.finish() {
            out.add(&d);
        }
        out
    }

    fn check_stream_equals_oneshot(text: &str, think: bool, with_tools: bool) -> Parsed {
        let t = || with_tools.then(tools);
        let one = parse_all(text, think, t(), "call_");
        for seed in 0..60 {
            assert_eq!(chunked(text, think, t(), seed), one, "seed {seed} for {text:?}");
        }
        one
    }

    #[test]
    fn reasoning_split() {
        let p = check_stream_equals_oneshot("<think>\nLet me think.\n</think>\n\nParis.", false, false);
        assert_eq!(p.reasoning, "Let me think.");
        assert_eq!(p.content, "Paris.");
        // The template opened <think>: the output starts inside it.
        let p = check_stream_equals_oneshot("\nhmm, so\n\n</think>\n\nThe answer", true, false);
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("hmm, so", "The answer"));
        // No think block: everything is content, whitespace kept.
        let p = check_stream_equals_oneshot("  The capital <b>is</b> Paris.\n", false, false);
        assert_eq!(p.content, "  The capital <b>is</b> Paris.\n");
        assert_eq!(p.reasoning, "");
        // Unterminated thinking (budget or max_tokens hit): all reasoning.
        let p = check_stream_equals_oneshot("<think>still going </thi", false, false);
        assert_eq!(p.reasoning, "still going </thi");
        assert_eq!(p.content, "");
        // Text that starts like <think> but is not.
        let p = check_stream_equals_oneshot("<thinking>x", false, false);
        assert_eq!(p.content, "<thinking>x");
        // Empty think block (thinking disabled style).
        let p = check_stream_equals_oneshot("<think>\n\n</think>\n\nHi ünïcödé 🙂", false, false);
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("", "Hi ünïcödé 🙂"));
    }

    #[test]
    fn xml_tool_calls_are_typed_by_schema() {
        let text = "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n\
            <parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n\
            <parameter=note>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>";
        let p = check_stream_equals_oneshot(text, false, true);
        assert_eq!(p.content, "I'll check.");
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(p.tool_calls[0].id, "call_0");
        assert_eq!(
            args(&p, 0),
            json!({"city": "San Francisco, CA", "days": 3, "metric": true, "scale": 1.5, "opts": {"a": [1, 2]},
                   "tags": ["x"], "note": "42"})
        );
        assert_eq!(p.tool_calls[1].name, "noop");
        assert_eq!(args(&p, 1), json!({}));
    }

    #[test]
    fn xml_values_that_do_not_fit_their_type_stay_strings() {
        let text =
            "<tool_call><function=get_weather><parameter=days>three</parameter><parameter=city>\n12\n</parameter>\
            <parameter=unknown>[1,2]</parameter><parameter=other>plain text</parameter></function></tool_call>";
        let p = check_stream_equals_oneshot(text, false, true);
        assert_eq!(args(&p, 0), json!({"days": "three", "city": "12", "unknown": [1, 2], "other": "plain text"}));
    }

    #[test]
    fn json_tool_calls() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n\
            <tool_call>\n{\"name\": \"noop\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>";
        let p = check_stream_equals_oneshot(text, false, true);
        assert_eq!(p.content, "");
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(args(&p, 0), json!({"city": "Paris", "days": 2}));
        assert_eq!(args(&p, 1), json!({"x": 1}));
        // After reasoning, with a JSON call that never closes (stopped at </tool_call>'s stop token).
        let text = "<think>need weather</think>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}";
        let p = check_stream_equals_oneshot(text, false, true);
        assert_eq!(p.reasoning, "need weather");
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(args(&p, 0), json!({}));
    }

    #[test]
    fn malformed_calls_become_content() {
        let p = check_stream_equals_oneshot("a <tool_call>not json</tool_call> b", false, true);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, "a <tool_call>not json</tool_call> b");
        let p = check_stream_equals_oneshot("x <tool_call>{\"name\": oops}</tool_call>", false, true);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, "x <tool_call>{\"name\": oops}</tool_call>");
        // Without tools in the request nothing is parsed.
        let p = check_stream_equals_oneshot("<tool_call>{\"name\": \"noop\"}</tool_call>", false, false);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, "<tool_call>{\"name\": \"noop\"}</tool_call>");
    }

    #[test]
    fn bare_function_and_truncated_xml() {
        // Some Qwen outputs omit the <tool_call> wrapper.
        let p = check_stream_equals_oneshot("<function=noop>\n</function>\ntrailing", false, true);
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.content, "trailing");
        // Cut off inside a parameter: keep what was written, arguments still valid JSON.
        let p = check_stream_equals_oneshot("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo", false, true);
        assert_eq!(args(&p, 0), json!({"city": "Oslo"}));
        let p = check_stream_equals_oneshot("<tool_call>\n<function=get_weather>\n<parameter=ci", false, true);
        assert_eq!(args(&p, 0), json!({}));
        // Only a wrapper.
        let p = check_stream_equals_oneshot("<tool_call>", false, true);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.content, "<tool_call>");
    }

    #[test]
    fn stream_deltas_name_the_call_before_its_arguments() {
        let mut p = OutputParser::new(false, Some(tools()), "c");
        let mut seen = Vec::new();
        for piece in
            ["<tool_call>\n<function=get", "_weather>\n<parameter=city>\nRome\n</param", "eter>\n", "</function>"]
        {
            seen.extend(p.push(piece));
        }
        seen.extend(p.finish());
        assert_eq!(seen[0], Delta::ToolStart { index: 0, id: "c0".into(), name: "get_weather".into() });
        assert_eq!(seen[1], Delta::ToolArgs { index: 0, fragment: "{\"city\": \"Rome\"".into() });
        assert_eq!(seen[2], Delta::ToolArgs { index: 0, fragment: "}".into() });
        assert!(p.has_tool_calls());
    }

    #[test]
    fn random_texts_stream_equal_oneshot() {
        // Fragments glued at random: whatever the text, streaming must agree with one-shot parsing.
        let parts = [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<function=get_weather>",
            "<function=noop>",
            "</function>",
            "<parameter=city>",
            "<parameter=days>",
            "</parameter>",
            "\n",
            "  ",
            "Paris",
            "7",
            "{\"name\": \"noop\"}",
            "<",
            ">",
            "é",
            "🙂",
            "<tool",
            "</thi",
            "text ",
        ];
        let mut rng = forge_model::sampling::Rng::new(99);
        let (mut with_calls, mut with_reasoning) = (0, 0);
        for case in 0..300 {
            let n = 1 + (rng.next_u64() % 12) as usize;
            let text: String = (0..n).map(|_| parts[(rng.next_u64() % parts.len() as u64) as usize]).collect();
            for (think, tools) in [(false, true), (true, true), (false, false)] {
                let one = parse_all(&text, think, tools.then(self::tools), "call_");
                for seed in 0..8 {
                    let s = chunked(&text, think, tools.then(self::tools), seed * 1000 + case);
                    assert_eq!(s, one, "case {case} seed {seed} think {think} tools {tools}: {text:?}");
                }
                with_calls += usize::from(!one.tool_calls.is_empty());
                with_reasoning += usize::from(!one.reasoning.is_empty());
                for c in &one.tool_calls {
                    assert!(serde_json::from_str::<Json>(&c.arguments).is_ok(), "{text:?} → {:?}", c.arguments);
                }
            }
        }
        // The generator must actually reach the interesting states.
        assert!(with_calls > 50 && with_reasoning > 50, "calls {with_calls}, reasoning {with_reasoning}");
    }

    #[test]
    fn a_function_tag_without_its_end_is_text_and_what_follows_is_still_parsed() {
        // Found by the `tool_parser` fuzz target: a `<function=` whose `>` does not come within
        // MAX_TAG bytes was handed back as text with everything after it when the text arrived
        // in one piece, but only with what had arrived when streamed, so a call after it was
        // parsed in one case and not the other.
        let head = format!("<function=noop?\n</fun{}\n</parameter>\n", "\u{fffd}".repeat(100));
        for wrap in ["", "<tool_call>\n"] {
            let text = format!("{wrap}{head}<function=noop></function>");
            let p = check_stream_equals_oneshot(&text, false, true);
            assert_eq!(p.content, format!("{wrap}{head}").trim_end(), "{text:?}");
            assert_eq!(p.tool_calls.len(), 1, "{text:?}");
            assert_eq!((p.tool_calls[0].name.as_str(), args(&p, 0)), ("noop", json!({})));
        }
    }

    #[test]
    fn adversarial_outputs_parse_in_linear_time() {
        // Each text makes some buffer grow without end while the parser waits for a tag. Parsing
        // 1 MiB streamed in 3-byte pieces, or in one piece, must take about as long as reading
        // it: a rescan of the buffer at every piece would take minutes.
        let mib = 1 << 20;
        let texts = [
            " ".repeat(mib),
            format!("<think>a{}", "\n".repeat(mib)),
            format!("<think>{}</think>", "a ".repeat(mib / 2)),
            format!("text{}", " ".repeat(mib)),
            format!("<tool_call>{}", " ".repeat(mib)),
            format!("<tool_call>{{\"name\": \"noop\", \"arguments\": {{\"x\": \"{}", "a".repeat(mib)),
            format!("<tool_call><function=get_weather><parameter=city>{}", "a".repeat(mib)),
            format!("<tool_call><function=get_weather>{}", " \n".repeat(mib / 2)),
            "<tool_call>x".repeat(mib / 12),
            "<tool_call>{\"name\": \"noop\"}</tool_call>".repeat(mib / 36),
            "<function=noop></function>".repeat(mib / 26),
            format!("<tool_call><function=noop>{}", "<".repeat(mib)),
        ];
        for text in &texts {
            for think in [false, true] {
                let t = std::time::Instant::now();
                let one = parse_all(text, think, Some(tools()), "call_");
                let mut p = OutputParser::new(think, Some(tools()), "call_");
                let mut streamed = Parsed::default();
                let mut rest = text.as_str();
                while !rest.is_empty() {
                    let mut cut = rest.len().min(3);
                    while !rest.is_char_boundary(cut) {
                        cut += 1;
                    }
                    for d in p.push(&rest[..cut]) {
                        streamed.add(&d);
                    }
                    rest = &rest[cut..];
                }
                for d in p.finish() {
                    streamed.add(&d);
                }
                let took = t.elapsed();
                assert_eq!(streamed, one, "{:?}…", &text[..40]);
                assert!(took.as_secs_f64() < 3.0, "{:?}… took {took:?}", &text[..40]);
            }
        }
    }
}
