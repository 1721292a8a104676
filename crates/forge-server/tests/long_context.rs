//! A long prompt through the server on SmolLM2-135M-Instruct with its KV8 cache: the prompt
//! (several prefill chunks, many cache pages) is answered with the tokens the model itself gives
//! the same prompt in the same chunks, the prompt cache takes the long prefix back for a
//! follow-up, every page is returned when the requests end, and a prompt past the context is
//! refused with OpenAI's `context_length_exceeded`.

mod common;

use common::*;
use forge_model::generate::generate;
use forge_model::sampling::{Sampler, SamplingParams};
use forge_model::session::KvDtype;
use forge_server::engine::EngineConfig;
use forge_server::{App, ServerConfig};
use serde_json::json;

const CTX: usize = 8192;
const CHUNK: usize = 512;
const NEW: usize = 24;

#[test]
fn a_long_prompt_is_answered_as_the_model_answers_it() {
    let load = || {
        let mut loaded = forge_model::load::load(&smollm2()).expect("load SmolLM2");
        loaded.model.set_kv_dtype(KvDtype::Kv8);
        loaded.model.set_prefill_chunk(CHUNK);
        loaded
    };
    let mut reference = load();
    let tok = reference.tokenizer.take().expect("SmolLM2's tokenizer");
    // About 2,300 tokens of the repository's calibration prose, then a question about it.
    let words: Vec<&str> = include_str!("../../../data/calib/prose.txt").split_whitespace().take(1700).collect();
    let text = format!("{}\n\nQuestion: what is the text above about? Answer:", words.join(" "));
    let ids = tok.encode(&text, false).expect("encode");
    assert!(ids.len() > 4 * CHUNK && ids.len() < CTX / 2, "{} prompt tokens", ids.len());

    // The model's own greedy answer, prefilled in the server's chunks.
    let mut session = reference.model.new_session();
    let mut want = Vec::new();
    let mut sampler = Sampler::new(SamplingParams { temperature: 0.0, ..SamplingParams::default() });
    generate(&reference.model, &mut session, &ids, NEW, &mut sampler, tok.stop_ids(), |t| {
        want.push(t);
        Ok(true)
    })
    .expect("generate");
    let want = tok.decode(&want, false).expect("decode");
    assert!(!want.trim().is_empty(), "the model answered nothing");
    drop(session);

    let cfg = ServerConfig {
        model_id: "smollm2".into(),
        engine: EngineConfig { ctx: CTX, prefill_chunk: CHUNK, ..EngineConfig::default() },
        ..ServerConfig::default()
    };
    let app = App::new(load(), cfg).expect("app");
    let bg = forge_server::spawn_background(app, "127.0.0.1:0").expect("server");
    let complete = |prompt: &[u32]| {
        let r = post(bg.addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": NEW, "temperature": 0}), None);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let first = complete(&ids);
    assert_eq!(first["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
    assert_eq!(first["choices"][0]["text"].as_str(), Some(want.as_str()), "{first}");

    // A follow-up on the same long prefix: the prompt cache gives it back (its pages copied
    // into the new request's session), so only the new tokens are prefilled.
    let mut more = ids.clone();
    more.extend(tok.encode(" In one word:", false).expect("encode"));
    let second = complete(&more);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached as usize >= ids.len() - 1, "cached {cached} of {}", ids.len());
    assert!(!second["choices"][0]["text"].as_str().unwrap().is_empty(), "{second}");

    // Every request done (the engine frees a slot just after its answer is sent): no page held
    // by a request, and the cache is KV8's.
    let t = std::time::Instant::now();
    let h = loop {
        let h = get(bg.addr, "/health", None).json();
        if h["busy"] == false {
            break h;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "engine still busy: {h}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(h["kv_cache_dtype"], "kv8", "{h}");
    let kv = &h["kv_cache"];
    assert_eq!((kv["positions"].as_u64(), kv["used_bytes"].as_u64()), (Some(0), Some(0)), "{h}");

    // Past the context: refused, and the server goes on.
    let long: Vec<u32> = ids.iter().cycle().take(CTX + 1).copied().collect();
    let r = post(bg.addr, "/v1/completions", &json!({"prompt": long, "max_tokens": 1}), None);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(complete(&ids)["choices"][0]["text"].as_str(), Some(want.as_str()));
}
