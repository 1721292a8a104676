//! `forge serve --print-config AGENT`: a client's configuration for this server, filled in with
//! the address and model id the server will have (docs/agents.md says how each was tried).
//!
//! The configuration goes to stdout, exactly as the client reads it (JSON, YAML or shell lines);
//! where to save it and how to start the client go to stderr.

use anyhow::{bail, Result};
use std::fmt::Write as _;

/// The agents `--print-config` knows, with what each prints.
pub const AGENTS: &[(&str, &str)] = &[
    ("opencode", "opencode.json for OpenCode"),
    ("continue", "config.yaml for the Continue CLI (cn) and IDE extensions"),
    ("llm", "extra-openai-models.yaml for Simon Willison's llm"),
    ("aider", ".aider.conf.yml for Aider"),
    ("openai-env", "OPENAI_* environment variables for the openai SDKs and other clients"),
];

/// What a client needs to know about the server.
pub struct Target {
    /// `--host` as given (an unspecified address is reached on loopback).
    pub host: String,
    pub port: u16,
    /// The id `/v1/models` reports.
    pub model_id: String,
    /// `--api-key` / `FORGE_API_KEY`, when the server requires one.
    pub api_key: Option<String>,
    /// Context length of one request (prompt + completion).
    pub ctx: usize,
    /// Completion budget the client should ask for (within `ctx`).
    pub max_tokens: usize,
}

/// A configuration and the hint that goes with it.
pub struct Printed {
    pub config: String,
    pub hint: String,
}

/// Key for clients that insist on one when the server takes none (any value is accepted then).
const NO_KEY: &str = "forge";

impl Target {
    /// `http://HOST:PORT/v1` as a client on this machine reaches it.
    pub fn base_url(&self) -> String {
        let h = self.host.trim_start_matches('[').trim_end_matches(']');
        let h = match h {
            "" | "0.0.0.0" => "127.0.0.1".to_string(),
            "::" => "[::1]".to_string(),
            h if h.contains(':') => format!("[{h}]"),
            h => h.to_string(),
        };
        format!("http://{h}:{}/v1", self.port)
    }

    fn key(&self) -> &str {
        self.api_key.as_deref().unwrap_or(NO_KEY)
    }
}

fn known() -> String {
    AGENTS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// Checks the name before anything else happens.
pub fn check(agent: &str) -> Result<()> {
    if !AGENTS.iter().any(|(n, _)| *n == agent) {
        bail!("--print-config: unknown agent '{agent}'; known agents: {}", known());
    }
    Ok(())
}

/// A YAML scalar: a JSON string is a valid YAML double-quoted one.
fn y(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// A shell word: bare when it is safe, else single-quoted.
fn sh(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "_-./:@%+=,[]".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

pub fn render(agent: &str, t: &Target) -> Result<Printed> {
    check(agent)?;
    let url = t.base_url();
    let id = &t.model_id;
    let (config, hint) = match agent {
        "opencode" => {
            let mut model = serde_json::Map::new();
            model.insert(
                id.clone(),
                serde_json::json!({
                    "name": format!("{id} (Forge)"),
                    "tool_call": true,
                    "limit": {"context": t.ctx, "output": t.max_tokens},
                }),
            );
            let v = serde_json::json!({
                "$schema": "https://opencode.ai/config.json",
                "provider": {"forge": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "Forge",
                    "options": {"baseURL": url, "apiKey": t.key()},
                    "models": model,
                }},
                "model": format!("forge/{id}"),
            });
            let hint = format!(
                "save as ./opencode.json (or ~/.config/opencode/opencode.json), then: opencode run {} 'hello'",
                sh(&format!("--model=forge/{id}"))
            );
            (serde_json::to_string_pretty(&v)? + "\n", hint)
        }
        "continue" => {
            let mut s = String::new();
            writeln!(s, "name: {}", y("Forge"))?;
            writeln!(s, "version: 1.0.0")?;
            writeln!(s, "schema: v1")?;
            writeln!(s, "models:")?;
            writeln!(s, "  - name: {}", y(&format!("{id} (Forge)")))?;
            writeln!(s, "    provider: openai")?;
            writeln!(s, "    model: {}", y(id))?;
            writeln!(s, "    apiBase: {}", y(&url))?;
            writeln!(s, "    apiKey: {}", y(t.key()))?;
            writeln!(s, "    roles:\n      - chat\n      - edit\n      - apply")?;
            writeln!(s, "    capabilities:\n      - tool_use")?;
            writeln!(s, "    defaultCompletionOptions:")?;
            writeln!(s, "      contextLength: {}", t.ctx)?;
            writeln!(s, "      maxTokens: {}", t.max_tokens)?;
            (s, "save as ~/.continue/config.yaml (or any file), then: cn --config FILE -p 'hello'".into())
        }
        "llm" => {
            let mut s = String::new();
            writeln!(s, "- model_id: forge")?;
            writeln!(s, "  model_name: {}", y(id))?;
            writeln!(s, "  api_base: {}", y(&url))?;
            if t.api_key.is_some() {
                writeln!(s, "  api_key_name: forge")?;
            }
            writeln!(s, "  can_stream: true")?;
            writeln!(s, "  supports_tools: true")?;
            let key = if t.api_key.is_some() { "; store the key once: llm keys set forge" } else { "" };
            let hint = format!(
                "append to \"$(dirname \"$(llm logs path)\")/extra-openai-models.yaml\"{key}; then: llm -m forge 'hello'"
            );
            (s, hint)
        }
        "aider" => {
            let mut s = String::new();
            writeln!(s, "model: {}", y(&format!("openai/{id}")))?;
            writeln!(s, "openai-api-base: {}", y(&url))?;
            writeln!(s, "openai-api-key: {}", y(t.key()))?;
            writeln!(s, "show-model-warnings: false")?;
            writeln!(s, "check-update: false")?;
            writeln!(s, "analytics-disable: true")?;
            (s, "save as .aider.conf.yml in the repository (or ~), then: aider --message 'hello' FILE".into())
        }
        "openai-env" => {
            let mut s = String::new();
            for (k, v) in [
                ("OPENAI_BASE_URL", url.as_str()),
                ("OPENAI_API_BASE", url.as_str()),
                ("OPENAI_API_KEY", t.key()),
                ("OPENAI_MODEL", id.as_str()),
            ] {
                writeln!(s, "export {k}={}", sh(v))?;
            }
            (s, "load with: eval \"$(forge serve --print-config openai-env ...)\"".into())
        }
        _ => unreachable!("checked above"),
    };
    Ok(Printed { config, hint })
}
