//! Requests rendered with the Qwen3.5 and Qwen3 chat templates (on SmolLM2's weights and tokenizer,
//! which is all these checks need): tools reach the template, tool calls are replayed in each
//! family's format, thinking on/off changes the generation prompt and the reasoning split, and the
//! prompt-cache snapshot points of a hybrid model fall where the conversation can be resumed.

mod common;

use common::*;
use forge_core::chat::ChatTemplate;
use forge_server::prompt::Frontend;
use forge_server::request::{parse_chat, Defaults};
use forge_server::{App, ServerConfig};
use serde_json::{json, Value as Json};
use std::sync::{Arc, OnceLock};

fn template(name: &str, tok: &forge_core::tokenizer::Tokenizer) -> ChatTemplate {
    let src = std::fs::read_to_string(fixtures().join("templates").join(name)).unwrap();
    ChatTemplate::new(&src, tok.bos_token(), tok.eos_token()).unwrap()
}

/// A server whose model speaks the Qwen3.5 template.
fn qwen35_server() -> &'static (Arc<App>, forge_server::Background) {
    static S: OnceLock<(Arc<App>, forge_server::Background)> = OnceLock::new();
    S.get_or_init(|| {
        let mut loaded = forge_model::load::load(&smollm2()).unwrap();
        loaded.template = Some(template("Qwen3.5-4B.jinja", loaded.tokenizer.as_ref().unwrap()));
        let cfg = ServerConfig { model_id: "qwen-ish".into(), test_hooks: true, ..ServerConfig::default() };
        let app = App::new(loaded, cfg).unwrap();
        let bg = forge_server::spawn_background(app.clone(), "127.0.0.1:0").unwrap();
        (app, bg)
    })
}

fn tools() -> Json {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

fn apply(body: Json) -> Json {
    let r = post(qwen35_server().1.addr, "/apply-template", &body, None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[test]
fn tools_and_thinking_reach_the_template() {
    let msgs = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let with = apply(json!({"messages": msgs, "tools": tools()}));
    let p = with["prompt"].as_str().unwrap();
    assert!(p.contains("<tools>") && p.contains("\"name\": \"get_weather\""), "{p}");
    let without = apply(json!({"messages": msgs}));
    assert!(!without["prompt"].as_str().unwrap().contains("<tools>"));
    let none = apply(json!({"messages": msgs, "tools": tools(), "tool_choice": "none"}));
    assert!(!none["prompt"].as_str().unwrap().contains("<tools>"));
    // Thinking is off by default (the Qwen3.x serving default); the template closes it.
    assert!(without["prompt"].as_str().unwrap().ends_with("<think>\n\n</think>\n\n"));
    assert_eq!(without["starts_in_reasoning"], false);
    let think = apply(json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": true}}));
    assert!(think["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\n<think>\n"));
    assert_eq!(think["starts_in_reasoning"], true);
}

#[test]
fn tool_calls_are_replayed_in_the_xml_format() {
    let msgs = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]);
    let p = apply(json!({"messages": msgs, "tools": tools()}));
    let p = p["prompt"].as_str().unwrap();
    assert!(
        p.contains(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
        ),
        "{p}"
    );
    assert!(p.contains("<tool_response>\nsunny, 21 C\n</tool_response>"), "{p}");
}

#[test]
fn thinking_output_is_split_when_the_template_opened_it() {
    let (_, bg) = qwen35_server();
    let body = json!({"messages": [{"role": "user", "content": "Capital of France?"}],
        "chat_template_kwargs": {"enable_thinking": true},
        "x_forced_output": "The user wants the capital.\n</think>\n\nParis.", "tools": tools()});
    let r = post(bg.addr, "/v1/chat/completions", &body, None).json();
    let m = &r["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "The user wants the capital.");
    assert_eq!(m["content"], "Paris.");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // A reasoning model that then calls a tool in the XML format.
    let mut body = body;
    body["x_forced_output"] =
        json!("Need the weather tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>");
    body["stream"] = json!(true);
    let chunks = post(bg.addr, "/v1/chat/completions", &body, None).chunks();
    let reasoning: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["reasoning_content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(reasoning, "Need the weather tool.");
    let args: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"].get(0)?["delta"]["tool_calls"].get(0)?["function"]["arguments"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(serde_json::from_str::<Json>(&args).unwrap(), json!({"city": "Oslo"}));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn qwen3_json_style_replay() {
    let loaded_tok = forge_model::load::load(&smollm2()).unwrap().tokenizer.unwrap();
    let tpl = template("Qwen-Qwen3-0.6B.jinja", &loaded_tok);
    let req = parse_chat(
        &json!({"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}], "tools": tools()}),
        4096,
    )
    .unwrap();
    let front = Frontend {
        tok: Arc::new(loaded_tok),
        template: Some(tpl),
        hybrid: false,
        defaults: Defaults::for_model_type("qwen3"),
        ctx: 4096,
        test_hooks: false,
    };
    let p = front.chat_prompt(&req).unwrap();
    assert!(
        p.text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
        "{}",
        p.text
    );
    assert!(p.snapshots.is_empty(), "attention-only models need no snapshots");
}

#[test]
fn hybrid_snapshot_points_are_prefixes_where_turns_resume() {
    let tok = forge_model::load::load(&smollm2()).unwrap().tokenizer.unwrap();
    let tpl = template("Qwen3.5-4B.jinja", &tok);
    let front = Frontend {
        tok: Arc::new(tok),
        template: Some(tpl),
        hybrid: true,
        defaults: Defaults::for_model_type("qwen3_5"),
        ctx: 4096,
        test_hooks: false,
    };
    let sys = json!({"role": "system", "content": "You are a careful assistant."});
    let turn1 = json!([sys, {"role": "user", "content": "Capital of France?"}]);
    let r1 = front.chat_prompt(&parse_chat(&json!({"messages": turn1}), 4096).unwrap()).unwrap();
    let turn2 = json!([sys, {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."},
        {"role": "user", "content": "And Italy?"}]);
    let r2 = front.chat_prompt(&parse_chat(&json!({"messages": turn2}), 4096).unwrap()).unwrap();
    let p1 = &r1.tokens;
    assert_eq!(r1.snapshots.len(), 3, "{:?}", r1.snapshots);
    assert_eq!(*r1.snapshots.last().unwrap(), p1.len());
    // The system prompt's end: shared by every conversation with that system prompt.
    let sys_only = front.tok.encode("<|im_start|>system\nYou are a careful assistant.<|im_end|>\n", false).unwrap();
    assert!(r1.snapshots[0] >= sys_only.len() && p1[..sys_only.len()] == sys_only[..], "{:?}", r1.snapshots);
    // The end of turn 1 before its generation prompt is a prefix of turn 2's prompt: the next
    // request resumes there although the template renders the answer differently.
    let resume = r1.snapshots[1];
    assert!(resume > r1.snapshots[0] && resume < p1.len());
    assert_eq!(p1[..resume], r2.tokens[..resume]);
    // It is where turn 1's own generation prompt starts.
    let gen_prompt = front.tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", false).unwrap();
    assert_eq!(p1[resume..], gen_prompt[..]);
}
