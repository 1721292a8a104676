//! The server end to end over loopback HTTP on SmolLM2-135M-Instruct: chat (plain and SSE),
//! greedy output against the known answer, the prompt cache, seeded sampling, stop strings, tool
//! calls and reasoning (scripted through the `x_forced_output` test hook, since a 135M model will
//! not reliably produce them), errors, auth, disconnects, queueing and a bounded load test.
//!
//! One server serves every test; tests take `SERIAL` so cache and health assertions see only
//! their own requests.

mod common;

use common::*;
use forge_server::engine::{EngineConfig, Event, GenParams, Job};
use forge_server::{App, Background, ServerConfig};
use serde_json::{json, Value as Json};
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const KEY: &str = "test-key-123";
const CTX: usize = 512;
const FRANCE: &str = "What is the capital of France?";
/// SmolLM2's greedy answer (tests/fixtures/smollm2_oracle.json, from transformers).
const PARIS: &str = "The capital of France is Paris.";

struct Server {
    app: Arc<App>,
    bg: Background,
}

static SERVER: OnceLock<Server> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

fn server() -> (&'static Server, MutexGuard<'static, ()>) {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = SERVER.get_or_init(|| {
        let loaded = forge_model::load::load(&smollm2()).expect("load SmolLM2");
        let cfg = ServerConfig {
            api_key: Some(KEY.into()),
            model_id: "smollm2".into(),
            engine: EngineConfig { ctx: CTX, max_queue: 64, ..EngineConfig::default() },
            test_hooks: true,
            ..ServerConfig::default()
        };
        let app = App::new(loaded, cfg).expect("app");
        let bg = forge_server::spawn_background(app.clone(), "127.0.0.1:0").expect("server");
        Server { app, bg }
    });
    (s, guard)
}

fn addr() -> SocketAddr {
    SERVER.get().unwrap().bg.addr
}

fn chat(body: Json) -> Resp {
    post(addr(), "/v1/chat/completions", &body, Some(KEY))
}

fn user(text: &str) -> Json {
    json!([{"role": "user", "content": text}])
}

fn content(r: &Json) -> &str {
    r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {r}"))
}

/// Concatenated `delta.content` (and reasoning) of a chat stream.
fn stream_text(chunks: &[Json], field: &str) -> String {
    chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"].get(field)?.as_str().map(str::to_string)).collect()
}

fn wait_idle() -> Json {
    let t = Instant::now();
    loop {
        let h = get(addr(), "/health", None).json();
        if !h["busy"].as_bool().unwrap() && h["queue"] == 0 {
            return h;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "engine still busy: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn greedy_chat_equals_the_reference_answer_streamed_or_not() {
    let _s = server();
    let r = chat(json!({"messages": user(FRANCE), "temperature": 0, "max_tokens": 32}));
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(content(&j), PARIS);
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
    assert_eq!(j["usage"]["prompt_tokens"], 37);
    assert_eq!(j["usage"]["completion_tokens"], 7);
    assert_eq!(j["model"], "smollm2");

    let r = chat(json!({"messages": user(FRANCE), "temperature": 0, "stream": true,
                        "stream_options": {"include_usage": true}}));
    assert_eq!(r.status, 200);
    assert!(r.headers.to_ascii_lowercase().contains("content-type: text/event-stream"), "{}", r.headers);
    let chunks = r.chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(stream_text(&chunks, "content"), PARIS);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 7);
    // The same prompt again: all but the last prompt token come from the cache.
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 36);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c.get("usage").is_some()));
}

#[test]
fn prompt_cache_reuses_the_conversation() {
    let _s = server();
    let sys = "You are a geography tutor. Answer in one sentence.";
    let mut msgs = vec![json!({"role": "system", "content": sys}), json!({"role": "user", "content": FRANCE})];
    let r1 = chat(json!({"messages": msgs, "temperature": 0, "max_tokens": 24})).json();
    let answer = content(&r1).to_string();
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    msgs.push(json!({"role": "assistant", "content": answer}));
    msgs.push(json!({"role": "user", "content": "And of Italy?"}));
    let r2 = chat(json!({"messages": msgs, "temperature": 0, "max_tokens": 24})).json();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let p2 = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    // The whole first exchange is reused: its prompt and the answer tokens.
    assert!(cached >= p1 + 5 && cached < p2, "cached {cached}, first prompt {p1}, second prompt {p2}");
    assert_eq!(r2["timings"]["cache_n"].as_u64(), Some(cached));
    // A different conversation in between (an agent's summary request) does not evict it.
    let other =
        chat(json!({"messages": user("Summarize: the sky is blue."), "temperature": 0, "max_tokens": 8})).json();
    assert!(other["choices"][0]["finish_reason"].as_str().is_some());
    let r3 = chat(json!({"messages": msgs, "temperature": 0, "max_tokens": 24})).json();
    assert_eq!(r3["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(p2 - 1));
    // Cached or not, greedy answers are the same.
    assert_eq!(content(&r3), content(&r2));
    let h = get(addr(), "/health", None).json();
    assert!(h["prompt_cache"]["entries"].as_u64().unwrap() >= 2, "{h}");
    assert_eq!(h["last"]["cached_tokens"].as_u64(), Some(p2 - 1));
    // Every request done: no KV cache held by a request (the prompt cache's are counted there).
    let kv = &h["kv_cache"];
    assert_eq!((kv["positions"].as_u64(), kv["used_bytes"].as_u64()), (Some(0), Some(0)), "{h}");
    assert_eq!(kv["page_positions"].as_u64(), Some(256), "{h}");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let _s = server();
    let body = |seed: u64| {
        json!({"messages": user("Tell me a short story about a cat."), "temperature": 1.0, "top_p": 0.95,
               "seed": seed, "max_tokens": 12, "presence_penalty": 0.5, "frequency_penalty": 0.2,
               "repetition_penalty": 1.1, "dry_multiplier": 0.8})
    };
    let a = chat(body(7)).json();
    let b = chat(body(7)).json();
    assert_eq!(content(&a), content(&b));
    let others: Vec<String> = (8..11).map(|s| content(&chat(body(s)).json()).to_string()).collect();
    assert!(others.iter().any(|o| o != content(&a)), "different seeds should give different samples");
    // Streaming with the same seed gives the same text.
    let mut sb = body(7);
    sb["stream"] = json!(true);
    assert_eq!(stream_text(&chat(sb).chunks(), "content"), content(&a));
}

#[test]
fn stop_strings_and_max_tokens() {
    let _s = server();
    let r = chat(json!({"messages": user(FRANCE), "temperature": 0, "stop": ["Paris"]})).json();
    assert_eq!(content(&r), "The capital of France is ");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let r = chat(json!({"messages": user(FRANCE), "temperature": 0, "stop": "France", "stream": true}));
    let chunks = r.chunks();
    assert_eq!(stream_text(&chunks, "content"), "The capital of ");
    let r = chat(json!({"messages": user(FRANCE), "temperature": 0, "max_completion_tokens": 3})).json();
    assert_eq!(content(&r), "The capital of");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 3);
}

#[test]
fn loop_guard_ends_degenerate_repetition() {
    let _s = server();
    let forced = "ha ".repeat(60);
    let j = chat(json!({"messages": user("Laugh."), "x_forced_output": forced, "loop_guard": 24})).json();
    // OpenAI's finish reasons only: litellm (Aider) rejected "repetition", OpenCode looped on it.
    assert_eq!(j["choices"][0]["finish_reason"], "length", "{j}");
    let n = j["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((24..40).contains(&n), "{n} tokens");
    assert_eq!(wait_idle()["last"]["finish"], "repetition");
    let body = json!({"messages": user("Laugh."), "x_forced_output": forced, "loop_guard": 24, "stream": true});
    let chunks = chat(body).chunks();
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    let body = json!({"prompt": "Laugh.", "x_forced_output": forced, "loop_guard": 24});
    let j = post(addr(), "/v1/completions", &body, Some(KEY)).json();
    assert_eq!(j["choices"][0]["finish_reason"], "length", "{j}");
}

#[test]
fn logprobs_are_reported() {
    let _s = server();
    let r =
        chat(json!({"messages": user(FRANCE), "temperature": 0, "max_tokens": 3, "logprobs": true, "top_logprobs": 2}))
            .json();
    let lp = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 3);
    assert_eq!(lp[0]["token"], "The");
    let top = lp[0]["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    // Greedy: the chosen token is the most likely one.
    assert_eq!(top[0]["token"], lp[0]["token"]);
    assert!(lp[0]["logprob"].as_f64().unwrap() <= 0.0);
    let r = post(
        addr(),
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "logprobs": 1}),
        Some(KEY),
    )
    .json();
    assert_eq!(r["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), 2);
}

#[test]
fn text_completions() {
    let _s = server();
    let r = post(
        addr(),
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        Some(KEY),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["object"], "text_completion");
    let text = j["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    let r = post(
        addr(),
        "/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": true, "echo": true}),
        Some(KEY),
    );
    let streamed: String =
        r.chunks().iter().filter_map(|c| c["choices"].get(0)?["text"].as_str().map(str::to_string)).collect();
    assert_eq!(streamed, format!("The capital of France is{text}"));
}

fn weather_tool() -> Json {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}])
}

#[test]
fn tool_call_round_trip() {
    let _s = server();
    let msgs = user("What's the weather in Paris for 3 days?");
    for (style, forced) in [
        ("json", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>"),
        (
            "xml",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        ),
    ] {
        let body = json!({"messages": msgs, "tools": weather_tool(), "x_forced_output": forced, "max_tokens": 200});
        let r = chat(body.clone());
        assert_eq!(r.status, 200, "{}", r.body);
        let j = r.json();
        let choice = &j["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{style}: {j}");
        assert!(choice["message"]["content"].is_null(), "{style}: {j}");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Json = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris", "days": 3}), "{style}");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));

        // Streaming: the name arrives first with the id, then argument fragments that add up.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let chunks = chat(sb).chunks();
        let calls: Vec<&Json> =
            chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"].get("tool_calls")).flat_map(|t| t.as_array().unwrap()).collect();
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert!(calls[0]["id"].is_string());
        let streamed_args: String = calls.iter().filter_map(|c| c["function"]["arguments"].as_str()).collect();
        assert_eq!(serde_json::from_str::<Json>(&streamed_args).unwrap(), args);
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

        // The client runs the tool and sends the result back with the call replayed.
        let mut history = msgs.as_array().unwrap().clone();
        history.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
        history.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"forecast\": \"sunny\"}"}));
        let r = chat(json!({"messages": history, "tools": weather_tool(), "temperature": 0, "max_tokens": 16}));
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.json()["choices"][0]["message"]["content"].is_string());
    }
    // Without tools in the request, the same text is plain content.
    let j = chat(json!({"messages": msgs, "x_forced_output": "<tool_call>{\"name\": \"x\"}</tool_call>"})).json();
    assert_eq!(content(&j), "<tool_call>{\"name\": \"x\"}</tool_call>");
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
}

#[test]
fn reasoning_goes_to_reasoning_content() {
    let _s = server();
    let forced = "<think>\nThe user asks about France. Paris.\n</think>\n\nThe capital is Paris.";
    let j = chat(json!({"messages": user(FRANCE), "x_forced_output": forced})).json();
    let m = &j["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "The user asks about France. Paris.");
    assert_eq!(m["content"], "The capital is Paris.");
    assert!(j["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap() > 5);
    let chunks = chat(json!({"messages": user(FRANCE), "x_forced_output": forced, "stream": true})).chunks();
    let reasoning_chunks =
        chunks.iter().filter(|c| c["choices"][0]["delta"].get("reasoning_content").is_some()).count();
    assert!(reasoning_chunks > 1, "reasoning is streamed as deltas");
    assert_eq!(stream_text(&chunks, "reasoning_content"), "The user asks about France. Paris.");
    assert_eq!(stream_text(&chunks, "content"), "The capital is Paris.");
    // A thinking budget closes the reasoning gracefully after that many tokens.
    let j = chat(
        json!({"messages": user(FRANCE), "x_forced_output": "<think> a b c d e f g h i j k", "thinking_budget": 3}),
    )
    .json();
    let m = &j["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "a b");
    assert_eq!(m["content"], "c d e f g h i j k");
}

#[test]
fn errors_are_openai_shaped_and_harmless() {
    let _s = server();
    let check = |r: Resp, status: u16, param: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.body);
        let e = r.json();
        let err = &e["error"];
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
        assert!(err["type"].is_string() && err.get("param").is_some() && err.get("code").is_some(), "{e}");
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{e}");
        }
        e
    };
    let a = addr();
    check(request(a, "POST", "/v1/chat/completions", b"{not json", Some(KEY)), 400, None);
    check(request(a, "POST", "/v1/chat/completions", b"", Some(KEY)), 400, None);
    check(request(a, "POST", "/v1/chat/completions", b"[1,2]", Some(KEY)), 400, None);
    check(chat(json!({"messages": "hello"})), 400, Some("messages"));
    check(chat(json!({"messages": user("x"), "temperature": "warm"})), 400, Some("temperature"));
    check(chat(json!({"messages": user("x"), "max_tokens": -5})), 400, Some("max_tokens"));
    check(chat(json!({"messages": user("x"), "n": 3})), 400, Some("n"));
    check(chat(json!({"messages": user("x"), "tools": "all"})), 400, Some("tools"));
    check(
        chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})),
        400,
        None,
    );
    let e = check(chat(json!({"messages": user("x"), "max_tokens": CTX + 1})), 400, Some("max_tokens"));
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    let long = "word ".repeat(2 * CTX);
    let e = check(chat(json!({"messages": user(&long)})), 400, Some("messages"));
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    // A prompt that fits leaves max_tokens clamped to the rest of the context.
    let fits = "word ".repeat(CTX - 60);
    let r = chat(json!({"messages": user(&fits), "x_forced_output": "ok", "max_tokens": 500}));
    assert_eq!(r.status, 200, "{}", r.body);
    check(request(a, "POST", "/v1/chat/completions", &vec![b' '; 3 << 20], Some(KEY)), 413, None);
    check(get(a, "/v1/nothing", Some(KEY)), 404, None);
    check(get(a, "/v1/chat/completions", Some(KEY)), 405, None);
    check(post(a, "/v1/completions", &json!({"prompt": [999999]}), Some(KEY)), 400, Some("prompt"));
    check(post(a, "/v1/completions", &json!({"max_tokens": 4}), Some(KEY)), 400, Some("prompt"));
    check(chat(json!({"messages": user("x"), "x_forced_output": 3})), 400, Some("x_forced_output"));
    // Still serving.
    let j = chat(json!({"messages": user(FRANCE), "temperature": 0})).json();
    assert_eq!(content(&j), PARIS);
}

#[test]
fn api_key_is_required_except_for_health() {
    let _s = server();
    let a = addr();
    let body = json!({"messages": user(FRANCE), "max_tokens": 1});
    let r = post(a, "/v1/chat/completions", &body, None);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    assert_eq!(post(a, "/v1/chat/completions", &body, Some("wrong-key-123")).status, 401);
    assert_eq!(get(a, "/v1/models", None).status, 401);
    let m = get(a, "/v1/models", Some(KEY)).json();
    assert_eq!(m["data"][0]["id"], "smollm2");
    assert_eq!(get(a, "/v1/models/smollm2", Some(KEY)).status, 200);
    assert_eq!(get(a, "/v1/models/gpt-4", Some(KEY)).status, 404);
    let h = get(a, "/health", None).json();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["ctx"], CTX);
    assert_eq!(h["kv_cache_dtype"], "f32");
}

#[test]
fn disconnect_stops_generation_and_keeps_the_cache_consistent() {
    let _s = server();
    wait_idle();
    // A long scripted answer: 300 tokens would take many seconds on two cores.
    let long = "one two three four five six seven eight nine ten ".repeat(30);
    let body = json!({"messages": user("Count for me."), "x_forced_output": long, "max_tokens": 400, "stream": true});
    let conn = open_stream_until_content(addr(), "/v1/chat/completions", &body, Some(KEY));
    let t = Instant::now();
    drop(conn);
    let h = wait_idle();
    assert!(t.elapsed() < Duration::from_secs(3), "generation did not stop promptly: {:?}", t.elapsed());
    assert_eq!(h["last"]["finish"], "cancelled", "{h}");
    assert!(h["last"]["generated_tokens"].as_u64().unwrap() < 100, "{h}");
    // A non-streaming client that hangs up cancels its generation too.
    let mut body = body;
    body["stream"] = json!(false);
    send_and_hang_up(addr(), "/v1/chat/completions", &body, Some(KEY), Duration::from_millis(800));
    let t = Instant::now();
    let h = wait_idle();
    assert!(t.elapsed() < Duration::from_secs(3), "generation did not stop promptly: {:?}", t.elapsed());
    assert_eq!(h["last"]["finish"], "cancelled", "{h}");
    // The state the cancelled job left is reused, and greedy answers are unaffected.
    let r = chat(json!({"messages": user("Count for me."), "x_forced_output": "ok"})).json();
    assert!(r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 10, "{r}");
    assert_eq!(content(&chat(json!({"messages": user(FRANCE), "temperature": 0})).json()), PARIS);
}

#[test]
fn jobs_run_in_arrival_order() {
    let (s, _g) = server();
    wait_idle();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let prompt = s.app.front.tok.encode("Hello there", false).unwrap();
    // Job k is scripted to k+1 tokens; the Done events must come back in submission order.
    for k in 0..4u32 {
        let forced: Vec<u32> = (0..=k).map(|i| prompt[i as usize % prompt.len()]).collect();
        let params = GenParams { max_tokens: 16, forced_output: Some(forced), ..GenParams::default() };
        let job = Job::new(prompt.clone(), Vec::new(), params, Arc::new(AtomicBool::new(false)), tx.clone());
        assert!(s.app.engine.submit(job).is_ok());
    }
    drop(tx);
    let mut order = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        if let Event::Done(st) = ev {
            order.push(st.generated_tokens);
        }
    }
    assert_eq!(order, vec![1, 2, 3, 4]);
}

#[test]
fn concurrent_clients_with_random_disconnects() {
    let _s = server();
    wait_idle();
    let served_before = get(addr(), "/health", None).json()["served"].as_u64().unwrap();
    let mut rng = forge_model::sampling::Rng::new(2024);
    let plans: Vec<(bool, bool, u64)> = (0..12)
        .map(|_| (rng.next_u64().is_multiple_of(2), rng.next_u64().is_multiple_of(3), rng.next_u64() % 4))
        .collect();
    let t = Instant::now();
    let handles: Vec<_> = plans
        .iter()
        .enumerate()
        .map(|(i, &(stream, disconnect, seed))| {
            std::thread::spawn(move || {
                let q = ["What is 2+2?", "Name a color.", FRANCE, "Say hi."][i % 4];
                let body = json!({"messages": user(q), "max_tokens": 8, "seed": seed, "temperature": 0.8, "stream": stream || disconnect});
                if disconnect {
                    // Some answers may finish before any content; either way the server must cope.
                    let _ = std::panic::catch_unwind(|| drop(open_stream_until_content(addr(), "/v1/chat/completions", &body, Some(KEY))));
                    return None;
                }
                let r = chat(body);
                assert_eq!(r.status, 200, "{}", r.body);
                let reason = if stream {
                    let c = r.chunks();
                    c.last().unwrap()["choices"][0]["finish_reason"].as_str().unwrap().to_string()
                } else {
                    r.json()["choices"][0]["finish_reason"].as_str().unwrap().to_string()
                };
                Some(reason)
            })
        })
        .collect();
    let mut completed = 0;
    for h in handles {
        if let Some(reason) = h.join().expect("client thread") {
            assert!(["stop", "length"].contains(&reason.as_str()), "{reason}");
            completed += 1;
        }
    }
    assert!(completed >= plans.iter().filter(|p| !p.1).count());
    assert!(t.elapsed() < Duration::from_secs(120));
    let h = wait_idle();
    assert!(h["served"].as_u64().unwrap() >= served_before + completed as u64);
    // Bounded state: the cache keeps within its entry limit.
    assert!(h["prompt_cache"]["entries"].as_u64().unwrap() <= 16, "{h}");
    assert_eq!(content(&chat(json!({"messages": user(FRANCE), "temperature": 0})).json()), PARIS);
}

#[test]
fn terminal_chat_on_the_same_engine() {
    let (s, _g) = server();
    wait_idle();
    let input = format!("{FRANCE}\n/think\n/reset\n\n{FRANCE}\n/bogus\n/quit\nnot read\n");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let opts = forge_server::chat::ChatOptions { temperature: Some(0.0), max_tokens: Some(32), ..Default::default() };
    forge_server::chat::run_chat(&s.app, input.as_bytes(), &mut out, &mut err, &opts).unwrap();
    let (out, err) = (String::from_utf8(out).unwrap(), String::from_utf8(err).unwrap());
    assert_eq!(out, format!("{PARIS}\n{PARIS}\n"));
    assert!(
        err.contains("(thinking on)") && err.contains("(new conversation)") && err.contains("unknown command /bogus"),
        "{err}"
    );
    let stats: Vec<&str> = err.lines().filter(|l| l.starts_with("[prompt 37 tokens")).collect();
    assert_eq!(stats.len(), 2, "{err}");
    assert!(stats[0].contains("answer 7 tokens") && stats[0].contains("tok/s"), "{err}");
}

#[test]
fn a_body_claiming_one_gib_is_refused_with_an_openai_error() {
    use std::io::{Read, Write};
    let (s, _g) = server();
    let limit = s.app.max_body;
    assert_eq!(limit, forge_server::server::body_limit(CTX));
    let mut stream = std::net::TcpStream::connect(addr()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n",
        1u64 << 30
    );
    stream.write_all(head.as_bytes()).unwrap();
    // Send the body as a client would, until the server answers and stops reading.
    let mut writer = stream.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = vec![b' '; 64 << 10];
        let mut sent = 0usize;
        while sent < 1 << 30 {
            match writer.write(&chunk) {
                Ok(n) if n > 0 => sent += n,
                _ => break,
            }
        }
        sent
    });
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let sent = sender.join().unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let e: Json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(e["error"]["code"], "request_too_large", "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    // Refused after about the limit, not after the gigabyte (socket buffers hold a few MiB).
    assert!(sent < limit + (32 << 20), "sent {sent} bytes for a limit of {limit}");
    // Still serving.
    assert_eq!(content(&chat(json!({"messages": user(FRANCE), "temperature": 0})).json()), PARIS);
}
