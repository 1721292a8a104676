//! Speculative decoding through the server on SmolLM2-135M-Instruct: the same greedy text as a
//! server without a drafter, streamed or not, with prompt lookup and with a draft model; the
//! OpenAI usage fields count accepted and rejected drafts; a request may opt out.

mod common;

use common::*;
use forge_model::session::KvDtype;
use forge_model::speculative::SpecConfig;
use forge_server::engine::{EngineConfig, Speculation};
use forge_server::{App, ServerConfig};
use serde_json::{json, Value as Json};

const PROMPT: &str = "Print the alphabet from A to Z, separated by commas, twice.";

fn start(speculation: Speculation, draft: bool) -> forge_server::Background {
    let loaded = forge_model::load::load(&smollm2()).expect("load SmolLM2");
    let draft = draft.then(|| forge_model::load::load(&smollm2()).expect("load the draft").model);
    let cfg = ServerConfig {
        model_id: "smollm2".into(),
        engine: EngineConfig {
            ctx: 512,
            speculation,
            spec: SpecConfig { max_draft: 5, adaptive: false },
            ..Default::default()
        },
        ..ServerConfig::default()
    };
    let app = App::with_draft(loaded, draft, cfg).expect("app");
    forge_server::spawn_background(app, "127.0.0.1:0").expect("server")
}

fn ask(bg: &forge_server::Background, extra: Json) -> (String, Json) {
    let mut body = json!({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 48});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let r = post(bg.addr, "/v1/chat/completions", &body, None).json();
    let text = r["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    (text, r["usage"]["completion_tokens_details"].clone())
}

fn streamed(bg: &forge_server::Background) -> String {
    let body =
        json!({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 48, "stream": true});
    post(bg.addr, "/v1/chat/completions", &body, None)
        .chunks()
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn speculative_servers_answer_as_the_plain_one() {
    let plain = start(Speculation::Off, false);
    let (want, details) = ask(&plain, json!({}));
    assert_eq!(details["accepted_prediction_tokens"], 0);
    assert_eq!(details["rejected_prediction_tokens"], 0);
    let lookup = start(Speculation::Lookup { min_n: 2, max_n: 4 }, false);
    let (got, details) = ask(&lookup, json!({}));
    assert_eq!(got, want, "prompt lookup");
    let accepted = details["accepted_prediction_tokens"].as_u64().unwrap();
    assert!(accepted > 0, "lookup accepted nothing: {details}; answer {want:?}");
    assert_eq!(streamed(&lookup), want, "prompt lookup, streamed");
    let (got, details) = ask(&lookup, json!({"speculative": false}));
    assert_eq!(got, want, "opted out");
    assert_eq!(details["accepted_prediction_tokens"], 0, "a request that opts out drafts nothing");
    let drafted = start(Speculation::Draft(KvDtype::F16), true);
    let (got, details) = ask(&drafted, json!({}));
    assert_eq!(got, want, "draft model");
    assert!(details["accepted_prediction_tokens"].as_u64().unwrap() > 0, "{details}");
    assert_eq!(streamed(&drafted), want, "draft model, streamed");
    // The prompt cache holds what the sessions saw: a second identical request, answered from
    // it, says the same.
    assert_eq!(ask(&drafted, json!({})).0, want, "draft model, from the prompt cache");
}
