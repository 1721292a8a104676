//! `forge serve --print-config AGENT`: every agent's configuration parses in its own format and
//! carries the host, port, model id and key of the invocation; nothing is loaded or fetched; an
//! unknown agent is a one-line error listing the known ones. (docs/agents.md records each client
//! run against a live server with these configurations.)

mod common;

use common::{expect_error, tmpdir};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::process::Command;

const AGENTS: [&str; 5] = ["opencode", "continue", "llm", "aider", "openai-env"];

/// Runs `forge serve --print-config AGENT ARGS…` with `FORGE_API_KEY` as given (never inherited):
/// (stdout, stderr); fails the test if the command fails.
fn print_config(agent: &str, args: &[&str], env_key: Option<&str>) -> (String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forge"));
    cmd.args(["serve", "--print-config", agent]).args(args).env_remove("FORGE_API_KEY");
    if let Some(k) = env_key {
        cmd.env("FORGE_API_KEY", k);
    }
    let out = cmd.output().unwrap();
    let (so, se) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "{agent} {args:?} failed: {se}");
    assert!(!se.contains("serving"), "{agent}: the server started: {se}");
    (so, se)
}

/// A light YAML check: two-space indentation, no tabs, and every `key: value` (also after a
/// list's `- `) with double-quoted values unquoted. Keys repeat across list items, so all values
/// are kept.
fn yaml(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')) {
        assert!(!line.contains('\t'), "tab in YAML: {line:?}");
        let indent = line.len() - line.trim_start().len();
        assert_eq!(indent % 2, 0, "odd indentation: {line:?}");
        let item = line.trim_start().strip_prefix("- ");
        let Some((k, v)) = item.unwrap_or(line.trim_start()).split_once(':') else {
            assert!(item.is_some_and(|i| !i.contains(' ')), "not `key: value` nor a list item: {line:?}");
            continue;
        };
        let v = v.trim();
        let v = if v.starts_with('"') {
            serde_json::from_str::<String>(v).unwrap_or_else(|e| panic!("bad quoted value in {line:?}: {e}"))
        } else {
            assert!(!v.contains(": ") && !v.contains(" #"), "unquoted value needs quotes: {line:?}");
            v.to_string()
        };
        m.entry(k.trim().to_string()).or_default().push(v);
    }
    m
}

fn one<'a>(m: &'a BTreeMap<String, Vec<String>>, k: &str) -> &'a str {
    let v = m.get(k).unwrap_or_else(|| panic!("no '{k}' in {m:?}"));
    assert_eq!(v.len(), 1, "'{k}' more than once: {v:?}");
    &v[0]
}

/// A POSIX shell word: bare, or single-quoted pieces joined by `\'`.
fn shell_word(w: &str) -> String {
    let (mut out, mut rest) = (String::new(), w);
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('\'') {
            let end = r.find('\'').unwrap_or_else(|| panic!("unclosed quote in {w:?}"));
            out.push_str(&r[..end]);
            rest = &r[end + 1..];
        } else if let Some(r) = rest.strip_prefix("\\'") {
            out.push('\'');
            rest = r;
        } else {
            let c = rest.chars().next().unwrap();
            assert!(!" \"$`\\;&|<>()*?!#~".contains(c), "unquoted {c:?} in {w:?}");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn env_lines(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(|l| {
            let l = l.strip_prefix("export ").unwrap_or_else(|| panic!("not an export line: {l:?}"));
            let (k, v) = l.split_once('=').unwrap();
            assert!(k.chars().all(|c| c.is_ascii_uppercase() || c == '_'), "{k}");
            (k.to_string(), shell_word(v))
        })
        .collect()
}

/// What one agent's configuration says: (base URL, model id, API key or None).
fn parsed(agent: &str, out: &str) -> (String, String, Option<String>) {
    match agent {
        "opencode" => {
            let j: Json = serde_json::from_str(out).unwrap_or_else(|e| panic!("opencode JSON: {e}\n{out}"));
            let p = &j["provider"]["forge"];
            assert_eq!(p["npm"], "@ai-sdk/openai-compatible");
            let models = p["models"].as_object().unwrap();
            assert_eq!(models.len(), 1);
            let (id, m) = models.iter().next().unwrap();
            assert_eq!(j["model"], format!("forge/{id}"));
            assert!(m["limit"]["output"].as_u64().unwrap() <= m["limit"]["context"].as_u64().unwrap());
            let key = p["options"]["apiKey"].as_str().unwrap().to_string();
            (p["options"]["baseURL"].as_str().unwrap().into(), id.clone(), Some(key))
        }
        "continue" => {
            let y = yaml(out);
            assert_eq!(one(&y, "schema"), "v1");
            assert_eq!(one(&y, "provider"), "openai");
            assert!(out.contains("capabilities:\n      - tool_use\n"), "{out}");
            let ctx: usize = one(&y, "contextLength").parse().unwrap();
            assert!(one(&y, "maxTokens").parse::<usize>().unwrap() <= ctx);
            (one(&y, "apiBase").into(), one(&y, "model").into(), Some(one(&y, "apiKey").into()))
        }
        "llm" => {
            assert!(out.starts_with("- model_id: forge\n"), "{out}");
            let y = yaml(out);
            assert_eq!(one(&y, "supports_tools"), "true");
            let key = y.get("api_key_name").map(|_| one(&y, "api_key_name").to_string());
            (one(&y, "api_base").into(), one(&y, "model_name").into(), key)
        }
        "aider" => {
            let y = yaml(out);
            let model = one(&y, "model").strip_prefix("openai/").expect("aider model is openai/ID").to_string();
            (one(&y, "openai-api-base").into(), model, Some(one(&y, "openai-api-key").into()))
        }
        "openai-env" => {
            let e = env_lines(out);
            assert_eq!(e["OPENAI_BASE_URL"], e["OPENAI_API_BASE"]);
            (e["OPENAI_BASE_URL"].clone(), e["OPENAI_MODEL"].clone(), Some(e["OPENAI_API_KEY"].clone()))
        }
        _ => unreachable!(),
    }
}

/// One invocation and what every configuration must then say.
struct Case {
    args: &'static [&'static str],
    /// `FORGE_API_KEY` for the run.
    env_key: Option<&'static str>,
    url: &'static str,
    id: &'static str,
    /// The server's key (None: it takes none, and any placeholder will do).
    key: Option<&'static str>,
}

#[test]
fn every_agent_gets_the_address_model_and_key() {
    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen35_tiny_mm");
    let cases = [
        Case {
            args: &["--port", "18123", "--model-name", "coder"],
            env_key: None,
            url: "http://127.0.0.1:18123/v1",
            id: "coder",
            key: None,
        },
        Case {
            args: &["--host", "0.0.0.0", "--port", "9000", "--model-name", "it's mine", "--api-key", "k-1"],
            env_key: None,
            url: "http://127.0.0.1:9000/v1",
            id: "it's mine",
            key: Some("k-1"),
        },
        Case {
            args: &["--host", "::", "--port", "8080", "--model-name", "m"],
            env_key: Some("env-key"),
            url: "http://[::1]:8080/v1",
            id: "m",
            key: Some("env-key"),
        },
        Case {
            args: &["--host", "localhost", "--port", "80", "--model-name", "a: b #c"],
            env_key: None,
            url: "http://localhost:80/v1",
            id: "a: b #c",
            key: None,
        },
        // The id as the server reports it, found without loading: a directory by its name.
        Case {
            args: &["--model", FIXTURE],
            env_key: None,
            url: "http://127.0.0.1:8765/v1",
            id: "qwen35_tiny_mm",
            key: None,
        },
    ];
    for Case { args, env_key, url, id, key } in cases {
        for agent in AGENTS {
            let (out, err) = print_config(agent, args, env_key);
            let (got_url, got_id, got_key) = parsed(agent, &out);
            assert_eq!((got_url.as_str(), got_id.as_str()), (url, id), "{agent} {args:?}:\n{out}");
            match (key, agent) {
                // llm keeps keys in its own store: the config names it and the hint says how.
                (Some(_), "llm") => {
                    assert_eq!(got_key.as_deref(), Some("forge"), "{out}");
                    assert!(err.contains("llm keys set forge"), "{err}");
                }
                (Some(k), _) => assert_eq!(got_key.as_deref(), Some(k), "{agent} {args:?}:\n{out}"),
                (None, "llm") => assert_eq!(got_key, None, "{out}"),
                (None, _) => assert!(got_key.is_some_and(|k| !k.is_empty()), "{agent}: clients need some key"),
            }
            assert!(err.starts_with("forge: ") && err.lines().count() == 1, "{agent}: one hint line on stderr: {err}");
        }
    }
}

#[test]
fn short_names_are_reported_as_given_without_fetching() {
    // An empty model cache: `serve` would fetch SmolLM2 first; --print-config must not.
    let home = tmpdir("agent-configs-home");
    for agent in AGENTS {
        let out = Command::new(env!("CARGO_BIN_EXE_forge"))
            .args(["serve", "--print-config", agent, "--model", "smollm2", "--port", "8765"])
            .env("FORGE_HOME", &home)
            .env_remove("FORGE_API_KEY")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let (url, id, _) = parsed(agent, &String::from_utf8_lossy(&out.stdout));
        assert_eq!((url.as_str(), id.as_str()), ("http://127.0.0.1:8765/v1", "smollm2"), "{agent}");
    }
    assert_eq!(std::fs::read_dir(&home).unwrap().count(), 0, "something was written to FORGE_HOME");
}

#[test]
fn unknown_agents_and_port_zero_are_errors() {
    let mut needles = vec!["unknown agent 'vim'"];
    needles.extend(AGENTS);
    expect_error(&["serve", "--print-config", "vim", "--port", "1"], &needles);
    expect_error(&["serve", "--print-config", "opencode", "--port", "0"], &["--print-config", "--port"]);
}
