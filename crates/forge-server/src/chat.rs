//! `forge chat`: an interactive conversation in the terminal on the same engine as the server
//! (same templates, prompt cache, sampling and reasoning split), without HTTP.

use crate::engine::{Event, Job};
use crate::parser::{Delta, OutputParser};
use crate::request;
use crate::server::App;
use anyhow::{anyhow, Result};
use serde_json::{json, Value as Json};
use std::io::{BufRead, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    pub system: Option<String>,
    /// Start with thinking on/off (default: the model family's default).
    pub think: Option<bool>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    /// A terminal: show a prompt and dim the reasoning. Otherwise reasoning goes to `err` and
    /// `out` carries only the answers.
    pub interactive: bool,
}

const HELP: &str = "commands: /reset (new conversation), /think (toggle thinking), /quit";

fn system_history(opts: &ChatOptions) -> Vec<Json> {
    opts.system.iter().map(|s| json!({"role": "system", "content": s})).collect()
}

/// Runs the conversation until `/quit` or end of input.
pub fn run_chat(
    app: &App,
    input: impl BufRead,
    out: &mut dyn Write,
    err: &mut dyn Write,
    opts: &ChatOptions,
) -> Result<()> {
    let mut history = system_history(opts);
    let mut think = opts.think.unwrap_or(app.front.defaults.think);
    if opts.interactive {
        writeln!(err, "forge chat: {} (ctx {}, thinking {}) — {HELP}", app.model_id, app.ctx(), on_off(think))?;
    }
    let mut lines = input.lines();
    loop {
        if opts.interactive {
            write!(out, "> ")?;
            out.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let cmd = line.trim();
        if cmd.is_empty() {
            continue;
        }
        match cmd {
            "/quit" | "/exit" => break,
            "/reset" => {
                history = system_history(opts);
                writeln!(err, "(new conversation)")?;
                continue;
            }
            "/think" => {
                think = !think;
                writeln!(err, "(thinking {})", on_off(think))?;
                continue;
            }
            "/help" => {
                writeln!(err, "{HELP}")?;
                continue;
            }
            c if c.starts_with('/') => {
                writeln!(err, "unknown command {c}; {HELP}")?;
                continue;
            }
            _ => {}
        }
        history.push(json!({"role": "user", "content": line}));
        match answer(app, &history, think, out, err, opts)? {
            Some(msg) => history.push(msg),
            // Not answered (e.g. the conversation outgrew the context): forget the question.
            None => {
                history.pop();
            }
        }
    }
    Ok(())
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// One turn: streams the answer to `out`, prints the stats line to `err`, returns the assistant
/// message for the history.
fn answer(
    app: &App,
    history: &[Json],
    think: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
    opts: &ChatOptions,
) -> Result<Option<Json>> {
    let mut body = json!({"messages": history, "chat_template_kwargs": {"enable_thinking": think}});
    for (k, v) in [
        ("max_tokens", opts.max_tokens.map(Json::from)),
        ("temperature", opts.temperature.map(Json::from)),
        ("top_p", opts.top_p.map(Json::from)),
        ("top_k", opts.top_k.map(Json::from)),
        ("min_p", opts.min_p.map(Json::from)),
        ("seed", opts.seed.map(Json::from)),
    ] {
        if let Some(v) = v {
            body[k] = v;
        }
    }
    let prepared = request::parse_chat(&body, app.ctx())
        .and_then(|req| {
            let p = app.front.chat_prompt(&req)?;
            let g = app.front.gen_params(&req.common, &p, None, "messages")?;
            Ok((p, g))
        })
        .map_err(|e| e.message);
    let (prepared, params) = match prepared {
        Ok(x) => x,
        Err(msg) => {
            writeln!(err, "forge: {msg} (/reset starts a new conversation)")?;
            return Ok(None);
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job::new(prepared.tokens.clone(), prepared.snapshots.clone(), params, cancel, tx);
    app.engine.submit(job).map_err(|_| anyhow!("the engine is not running"))?;
    let mut parser = OutputParser::new(prepared.starts_in_reasoning, None, "call_");
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut in_reasoning = false;
    let mut show = |deltas: Vec<Delta>, out: &mut dyn Write, err: &mut dyn Write| -> Result<()> {
        for d in deltas {
            match d {
                Delta::Reasoning(r) => {
                    reasoning.push_str(&r);
                    if opts.interactive {
                        write!(out, "\x1b[2m{r}\x1b[0m")?;
                        in_reasoning = true;
                    } else {
                        write!(err, "{r}")?;
                    }
                }
                Delta::Content(c) => {
                    if in_reasoning {
                        writeln!(out, "\n")?;
                        in_reasoning = false;
                    }
                    content.push_str(&c);
                    write!(out, "{c}")?;
                }
                _ => {}
            }
        }
        out.flush()?;
        Ok(())
    };
    let stats = loop {
        match rx.blocking_recv() {
            Some(Event::Started) => {}
            Some(Event::Token { text, .. }) | Some(Event::Text(text)) => show(parser.push(&text), out, err)?,
            Some(Event::Done(stats)) => break stats,
            Some(Event::Error(e)) => {
                writeln!(err, "forge: generation failed: {e}")?;
                return Ok(None);
            }
            None => return Err(anyhow!("the engine stopped")),
        }
    };
    show(parser.finish(), out, err)?;
    writeln!(out)?;
    if !reasoning.is_empty() && !opts.interactive {
        writeln!(err)?;
    }
    writeln!(
        err,
        "[prompt {} tokens ({} cached) {:.1} tok/s | answer {} tokens {:.1} tok/s | first token {:.2} s | {}]",
        stats.prompt_tokens,
        stats.cached_tokens,
        stats.prefill_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
        stats.ttft_s,
        stats.finish.as_str()
    )?;
    let mut msg = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        msg["reasoning_content"] = json!(reasoning);
    }
    Ok(Some(msg))
}
