//! HF chat templates (Jinja) rendered with minijinja, configured to behave like the jinja2
//! environment of transformers' `apply_chat_template`, so templates from the Hub work unchanged.
//!
//! What is mirrored from transformers (`utils/chat_template_utils.py`, 5.x):
//! * `trim_blocks` / `lstrip_blocks` on, trailing newline of the source dropped, lenient undefined;
//! * `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter equal to
//!   `json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)`;
//! * Python `str`/`dict` methods (`startswith`, `split`, `items`, `get`, ...) via minijinja-contrib;
//! * Python-style printing of non-strings (`True`, `None`, `['a', 1]`, `2.0`) and `|string`;
//! * render variables `messages`, `tools` (none when absent), `documents` (none),
//!   `add_generation_prompt`, `bos_token`/`eos_token`, plus caller kwargs;
//! * message normalisation: top-level `null` fields are dropped and `reasoning_content` /
//!   `thinking` / `reasoning` are aliased to each other.
//!
//! Known differences: `~` and `+` on non-strings use minijinja's formatting (`true`, not `True`);
//! JSON object keys arrive sorted because serde_json/minijinja are built without
//! `preserve_order`, so `tool | tojson` lists keys alphabetically; `strftime_now` uses UTC.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};
use serde_json::Value as Json;

const TEMPLATE_NAME: &str = "chat_template";

/// Template instructions one render may execute. The templates shipped with models spend about a
/// hundred per message (see the `chat_fuel_per_message` test), so this is room for hundreds of
/// thousands of messages while a template that loops without end stops within seconds.
pub const MAX_RENDER_FUEL: u64 = 100_000_000;
/// Bytes one render may produce: far more than any context holds, while a template that prints
/// without end stops before it exhausts memory.
pub const MAX_RENDER_BYTES: usize = 64 << 20;

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported with their line.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_fuel(Some(MAX_RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(py_formatter);
        env.add_filter("tojson", tojson_filter);
        env.add_filter("string", py_string_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("invalid chat template: {}", describe(&e)))?;
        Ok(Self { env, bos_token, eos_token })
    }

    /// Locates the template in a HF model directory, in transformers' order of precedence:
    /// `chat_template.jinja`, then `chat_template.json` (`{"chat_template": ...}`), then the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list of `{name, template}` from
    /// which "default" is used). `Ok(None)` when the model has no template.
    pub fn from_dir(dir: &Path, bos: Option<String>, eos: Option<String>) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if let Some(source) = read_optional(&jinja)? {
            return Self::new(&source, bos, eos).with_context(|| format!("in {}", jinja.display())).map(Some);
        }
        for (file, field_required) in [("chat_template.json", true), ("tokenizer_config.json", false)] {
            let path = dir.join(file);
            let Some(text) = read_optional(&path)? else {
                continue;
            };
            let doc: Json =
                serde_json::from_str(&text).with_context(|| format!("failed to parse {}", path.display()))?;
            let source = match doc.get("chat_template") {
                None | Some(Json::Null) if field_required => {
                    bail!("{} has no \"chat_template\" field", path.display())
                }
                None | Some(Json::Null) => continue,
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(list)) => {
                    pick_default_template(list).with_context(|| format!("in {}", path.display()))?
                }
                Some(_) => {
                    bail!("{}: \"chat_template\" must be a string or a list of {{name, template}}", path.display())
                }
            };
            return Self::new(&source, bos, eos).with_context(|| format!("in {}", path.display())).map(Some);
        }
        Ok(None)
    }

    /// Renders a conversation. `messages` is a JSON array of OpenAI-style messages, `tools` an
    /// optional JSON array of tool schemas, `extra` additional template variables such as
    /// `{"enable_thinking": false}` (they override `bos_token`/`eos_token` like HF kwargs do).
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        self.render_counted(messages, tools, add_generation_prompt, extra).map(|(text, _)| text)
    }

    /// [`Self::render`] and the template instructions it executed.
    fn render_counted(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<(String, u64)> {
        let messages = normalize_messages(messages)?;
        let mut ctx: Vec<(String, Value)> = Vec::new();
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token".into(), Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token".into(), Value::from(eos.as_str())));
        }
        for (k, v) in extra {
            ctx.push((k.clone(), Value::from_serialize(v)));
        }
        // Pushed last so they win over same-named extras (Python would reject the duplicate).
        ctx.push(("messages".into(), Value::from_serialize(&messages)));
        ctx.push(("tools".into(), tools.map_or(Value::from(()), Value::from_serialize)));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));
        // Later entries replace earlier ones with the same key.
        let ctx = Value::from_iter(ctx);

        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        let mut out = CappedWriter { buf: Vec::new(), overflow: false };
        let fuel = match template.render_captured_to(ctx, &mut out) {
            Ok(captured) => captured.state().fuel_levels().map_or(0, |(consumed, _)| consumed),
            Err(_) if out.overflow => {
                bail!("chat template rendering stopped: the prompt exceeds {MAX_RENDER_BYTES} bytes")
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => bail!(
                "chat template rendering stopped after {MAX_RENDER_FUEL} template instructions \
                 (a loop that does not end?)"
            ),
            Err(e) => bail!("chat template rendering failed: {}", describe(&e)),
        };
        let text = String::from_utf8(out.buf).map_err(|_| anyhow!("chat template rendering produced invalid UTF-8"))?;
        Ok((text, fuel))
    }
}

/// The render's output, refused past [`MAX_RENDER_BYTES`].
struct CappedWriter {
    buf: Vec<u8>,
    overflow: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > MAX_RENDER_BYTES {
            self.overflow = true;
            return Err(std::io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("failed to read {}", path.display())),
    }
}

fn pick_default_template(list: &[Json]) -> Result<String> {
    let mut names = Vec::new();
    for entry in list {
        let name = entry.get("name").and_then(Json::as_str);
        let template = entry.get("template").and_then(Json::as_str);
        match (name, template) {
            (Some("default"), Some(t)) => return Ok(t.to_string()),
            (Some(n), Some(_)) => names.push(n.to_string()),
            _ => {
                bail!("\"chat_template\" list entries must be {{\"name\": ..., \"template\": ...}}")
            }
        }
    }
    bail!("no chat template named \"default\" (available: {})", names.join(", "))
}

/// minijinja's error plus the chain of causes (a `raise_exception` message lives in the detail).
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

/// What transformers does to messages before rendering: each must be an object; keys whose value
/// is null are dropped (templates handle a missing key but often print "None"); reasoning given
/// under any of its names is exposed as both `reasoning_content` and `thinking`.
fn normalize_messages(messages: &Json) -> Result<Json> {
    let Json::Array(list) = messages else {
        bail!("chat messages must be a JSON array");
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Json::Object(obj) = m else {
            bail!("chat message {i} is not a JSON object");
        };
        let mut obj: serde_json::Map<String, Json> =
            obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| obj.get(*k).cloned());
        if let Some(r) = reasoning {
            obj.entry("thinking").or_insert_with(|| r.clone());
            obj.insert("reasoning_content".into(), r);
        }
        out.push(Json::Object(obj));
    }
    Ok(Json::Array(out))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python-style printing for values jinja2 would print via `str()`; strings and undefined keep
/// minijinja's behaviour (no auto-escaping is configured for this template name).
fn py_formatter(out: &mut minijinja::Output, state: &minijinja::State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, &mut s)?;
            out.write_str(&s)?;
            Ok(())
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// `|string` as Python's `str()`.
fn py_string_filter(value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => Ok(value.clone()),
        ValueKind::Undefined => Ok(Value::from("")),
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, &mut s)?;
            Ok(Value::from(s))
        }
        _ => Ok(Value::from(value.to_string())),
    }
}

/// Python `repr()` of JSON-like values (`str()` of containers uses repr for their items).
fn py_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&py_float(f, false));
            }
        }
        ValueKind::String => py_repr_str(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn py_repr_str(s: &str, out: &mut String) {
    // Python prefers single quotes unless the string contains one and no double quote.
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let cp = c as u32;
                let _ = match cp {
                    0..=0xff => write!(out, "\\x{cp:02x}"),
                    0x100..=0xffff => write!(out, "\\u{cp:04x}"),
                    _ => write!(out, "\\U{cp:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Approximation of Python's `str.isprintable` (no Unicode tables here): control, format,
/// separator and private-use characters that repr escapes.
fn py_printable(c: char) -> bool {
    let cp = c as u32;
    !(cp < 0x20
        || (0x7f..=0xa0).contains(&cp)
        || cp == 0xad
        || cp == 0x1680
        || (0x2000..=0x200f).contains(&cp)
        || (0x2028..=0x202f).contains(&cp)
        || (0x205f..=0x206f).contains(&cp)
        || cp == 0x3000
        || cp == 0xfeff
        || (0xe000..=0xf8ff).contains(&cp)
        || (0xfff9..=0xfffb).contains(&cp)
        || cp >= 0xf0000)
}

/// Python's `repr(float)` (shortest round-trip digits, exponent form outside 1e-4..1e16);
/// `json` selects json.dumps' spelling of non-finite values.
fn py_float(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{s}") } else { s.into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if digits.len() <= point as usize {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Options of Python's `json.dumps` that HF's `tojson` exposes.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
/// Unlike jinja2's built-in filter it does not HTML-escape `<`, `>`, `&` or `'`.
fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = i64::try_from(v)?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"))?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"))
                }
            }
        }
        // Python's defaults: no space before newlines when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

fn write_json(value: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value is undefined (Object of type Undefined is not JSON serializable)",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                out.push_str(&py_float(f64::try_from(value.clone())?, true));
            }
        }
        ValueKind::String => write_json_str(value.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json_str(k, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                write_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of type {kind}"),
            ))
        }
    }
    Ok(())
}

/// Object keys as json.dumps converts them (str, int, float, bool, None).
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => py_float(f64::try_from(key.clone())?, true),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// A JSON string literal as Python's json module writes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `strftime_now(fmt)`: the current time formatted like Python's `datetime.strftime`. Uses UTC
/// (no time-zone database here); covers the directives chat templates use.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    Ok(Value::from(strftime(secs, &fmt)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

fn strftime(unix_secs: i64, fmt: &str) -> String {
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // glibc's "%-d" style flag: no zero padding.
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if pad {
                format!("{n:0width$}")
            } else {
                n.to_string()
            }
        };
        let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b' | 'h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            // Unknown directives are kept verbatim, as glibc does.
            Some(other) => {
                out.push('%');
                if !pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        template: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
        messages: Json,
        tools: Option<Json>,
        add_generation_prompt: bool,
        extra: serde_json::Map<String, Json>,
        expected: Option<String>,
        expected_error: Option<String>,
    }

    fn load_json(path: &str) -> Json {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn chat_matches_jinja2_fixtures() {
        let doc = load_json(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/chat_templates.json"));
        let cases: Vec<Case> = serde_json::from_value(doc).unwrap();
        assert!(cases.len() >= 5);
        for c in cases {
            let t = ChatTemplate::new(&c.template, c.bos_token, c.eos_token).unwrap();
            let got = t.render(&c.messages, c.tools.as_ref(), c.add_generation_prompt, &c.extra);
            match (c.expected, c.expected_error) {
                (Some(expected), _) => {
                    let got = got.unwrap_or_else(|e| panic!("{}: {e:#}", c.name));
                    assert_eq!(got, expected, "case {}", c.name);
                }
                (None, Some(msg)) => {
                    let err = format!("{:#}", got.expect_err(&c.name));
                    assert!(err.contains(&msg), "case {}: error {err:?} lacks {msg:?}", c.name);
                }
                (None, None) => panic!("case {} has no expectation", c.name),
            }
        }
    }

    #[test]
    fn chat_smollm2_template_matches_transformers() {
        let doc = load_json(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/smollm2_vocab.json"));
        let source = doc["chat_template"].as_str().unwrap();
        let t = ChatTemplate::new(source, Some("<|im_start|>".into()), Some("<|im_end|>".into())).unwrap();
        let examples = doc["chat_examples"].as_array().unwrap();
        assert!(!examples.is_empty());
        for ex in examples {
            let got = t
                .render(&ex["messages"], None, ex["add_generation_prompt"].as_bool().unwrap(), &Default::default())
                .unwrap();
            assert_eq!(got, ex["expected"].as_str().unwrap());
        }
    }

    #[test]
    fn chat_extra_kwargs_and_thread_safety() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();

        let t = ChatTemplate::new("{{ bos_token }}{{ messages|length }}{{ tools }}", Some("<s>".into()), None).unwrap();
        let extra = json!({"bos_token": "X", "messages": "ignored"});
        let out =
            t.render(&json!([{"role": "user", "content": "a"}]), None, false, extra.as_object().unwrap()).unwrap();
        // Caller kwargs override special tokens but not the conversation; absent tools are None.
        assert_eq!(out, "X1None");
    }

    #[test]
    fn chat_compile_error_is_reported() {
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(format!("{err:#}").contains("invalid chat template"), "{err:#}");
    }

    #[test]
    fn chat_bad_messages_are_errors() {
        let t = ChatTemplate::new("{{ messages }}", None, None).unwrap();
        let extra = serde_json::Map::new();
        assert!(t.render(&json!({"role": "user"}), None, false, &extra).is_err());
        assert!(t.render(&json!(["hi"]), None, false, &extra).is_err());
        // Null fields are dropped and reasoning is aliased, like transformers.
        let t = ChatTemplate::new(
            "{{ messages[0].content is defined }}|{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}",
            None,
            None,
        )
        .unwrap();
        let out =
            t.render(&json!([{"role": "assistant", "content": null, "reasoning": "r"}]), None, false, &extra).unwrap();
        assert_eq!(out, "False|r|r");
    }

    #[test]
    fn chat_from_dir_precedence_and_errors() {
        let dir = std::env::temp_dir().join(format!("forge-chat-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("tokenizer_config.json");
        let jinja = dir.join("chat_template.jinja");
        let _ = std::fs::remove_file(&jinja);

        assert!(ChatTemplate::from_dir(&dir, None, None).unwrap().is_none());

        std::fs::write(
            &cfg,
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_dir(&dir, Some("<s>".into()), None).unwrap().unwrap();
        assert_eq!(t.render(&json!([]), None, false, &Default::default()).unwrap(), "D<s>");

        std::fs::write(&jinja, "J\n").unwrap();
        let t = ChatTemplate::from_dir(&dir, None, None).unwrap().unwrap();
        // keep_trailing_newline=false, as jinja2's default.
        assert_eq!(t.render(&json!([]), None, false, &Default::default()).unwrap(), "J");

        std::fs::remove_file(&jinja).unwrap();
        std::fs::write(&cfg, "{not json").unwrap();
        let err = format!("{:#}", ChatTemplate::from_dir(&dir, None, None).unwrap_err());
        assert!(err.contains("tokenizer_config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chat_strftime() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime(t, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(
            strftime(t, "%d %b %Y|%B %-d, %Y|%A %a|%I%p|%j|%%|%Q"),
            "29 Feb 2024|February 29, 2024|Thursday Thu|01PM|060|%|%Q"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
    }

    #[test]
    fn chat_py_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-7, "1e-07"),
            (1e20, "1e+20"),
            (123456789.125, "123456789.125"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-300, "-2.5e-300"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f, false), want, "{f}");
        }
    }

    fn qwen35() -> ChatTemplate {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/templates/Qwen3.5-4B.jinja");
        ChatTemplate::new(&std::fs::read_to_string(path).unwrap(), None, None).unwrap()
    }

    #[test]
    fn chat_fuel_per_message() {
        // What a real template spends per message, with tools and reasoning: MAX_RENDER_FUEL is
        // sized from it.
        let t = qwen35();
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let turn = |i: usize| {
            vec![
                json!({"role": "user", "content": format!("question {i}")}),
                json!({"role": "assistant", "content": "answer", "reasoning_content": "thought",
                       "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "sunny"}),
            ]
        };
        let mut per_message = 0;
        for n in [10, 100, 1000] {
            let messages: Vec<Json> = (0..n).flat_map(turn).collect();
            let (text, fuel) =
                t.render_counted(&Json::Array(messages), Some(&tools), true, &Default::default()).unwrap();
            assert!(text.contains("question 9"));
            per_message = per_message.max(fuel / (3 * n as u64));
        }
        eprintln!("Qwen3.5 template: {per_message} instructions per message");
        assert!(per_message > 0 && per_message < 500, "{per_message} instructions per message");
        assert!(MAX_RENDER_FUEL / per_message >= 100_000, "{per_message}");
    }

    #[test]
    fn chat_template_that_loops_or_floods_is_stopped() {
        let m = json!([{"role": "user", "content": "hi"}]);
        let none = serde_json::Map::new();
        // 10^10 iterations: stopped by the fuel bound.
        let loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% if i == j %}.{% endif %}{% endfor %}{% endfor %}";
        let t = std::time::Instant::now();
        let e = ChatTemplate::new(loops, None, None).unwrap().render(&m, None, false, &none).unwrap_err().to_string();
        assert!(e.contains("template instructions") && e.contains("loop"), "{e}");
        assert!(t.elapsed().as_secs() < 30, "{:?}", t.elapsed());
        // 100 GB of output in few instructions: stopped by the output bound.
        let floods = "{% for i in range(1000) %}{{ 'x' * 99999999 }}{% endfor %}";
        let e = ChatTemplate::new(floods, None, None).unwrap().render(&m, None, false, &none).unwrap_err().to_string();
        assert!(e.contains("exceeds 67108864 bytes"), "{e}");
        // Unbounded recursion: stopped by minijinja's recursion limit.
        let recurses = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        let e =
            ChatTemplate::new(recurses, None, None).unwrap().render(&m, None, false, &none).unwrap_err().to_string();
        assert!(e.contains("recursion"), "{e}");
        // Adversarial messages through a real template: bounded output, no error.
        let long = "<|im_start|>{{ x }}{% for %}".repeat(10_000);
        let m = json!([{"role": "system", "content": long}, {"role": "user", "content": "\u{0}\u{ffff}"},
                       {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": {"a": "</tool_call>"}}}]}]);
        let out = qwen35().render(&m, None, true, &none).unwrap();
        assert!(out.len() > long.len());
    }
}
