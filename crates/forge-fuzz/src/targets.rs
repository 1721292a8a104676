//! The fuzz targets: one `fn(&[u8])` per parser. Each runs the parser on the input and, where it
//! accepts it, exercises what the input produced and checks invariants the rest of Forge relies
//! on. Errors are expected; panics, hangs and unbounded allocations are bugs.

use forge_core::chat::ChatTemplate;
use forge_core::checkpoint::{config_from_gguf, Checkpoint};
use forge_core::config::ModelConfig;
use forge_core::gguf::GgufFile;
use forge_core::safetensors_dir::SafetensorsSet;
use forge_core::tokenizer::{GgufVocab, StreamDecoder, Tokenizer};
use forge_server::parser::{parse_all, OutputParser, Parsed, ToolSchemas};
use forge_server::prompt::Frontend;
use forge_server::request::{parse_chat, parse_completion, Defaults};
use serde_json::{json, Map, Value as Json};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus directory and cargo-fuzz target.
pub const TARGETS: &[(&str, Target)] = &[
    ("gguf", gguf),
    ("safetensors", safetensors),
    ("config", config),
    ("tokenizer", tokenizer),
    ("chat_template", chat_template),
    ("request", request),
    ("tool_parser", tool_parser),
];

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
}

fn read_json(rel: &str) -> Json {
    let path = fixture(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The SmolLM2-135M-Instruct vocabulary (`tests/fixtures/smollm2_vocab.json`) as GGUF metadata.
pub fn smollm2_vocab() -> GgufVocab {
    let doc = read_json("smollm2_vocab.json");
    let strings = |k: &str| -> Vec<String> {
        doc[k].as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
    };
    let id = |k: &str| doc[k].as_u64().map(|x| x as u32);
    GgufVocab {
        model: doc["model"].as_str().unwrap_or("gpt2").to_string(),
        pre: doc["pre"].as_str().map(String::from),
        tokens: strings("tokens"),
        token_types: doc["token_types"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_i64().map(|x| x as i32)).collect())
            .unwrap_or_default(),
        scores: Vec::new(),
        merges: strings("merges"),
        bos: id("bos"),
        eos: id("eos"),
        eot: id("eot"),
        pad: id("pad"),
        add_bos: doc["add_bos"].as_bool(),
    }
}

fn smollm2() -> &'static Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_gguf(&smollm2_vocab()).expect("SmolLM2 vocabulary")))
}

/// The chat templates of the fixtures: SmolLM2's, Qwen3's, Qwen3.5's and the jinja probe.
pub fn template_sources() -> Vec<String> {
    let mut out = vec![read_json("smollm2_vocab.json")["chat_template"].as_str().unwrap_or_default().to_string()];
    if let Some(cases) = read_json("chat_templates.json").as_array() {
        for c in cases {
            if let Some(t) = c["template"].as_str() {
                if !out.iter().any(|o| o == t) {
                    out.push(t.to_string());
                }
            }
        }
    }
    out
}

fn templates() -> &'static [ChatTemplate] {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        template_sources()
            .iter()
            .map(|s| {
                ChatTemplate::new(s, Some("<|im_start|>".into()), Some("<|im_end|>".into())).expect("fixture template")
            })
            .collect()
    })
}

/// Qwen3's template over the SmolLM2 tokenizer, 4096 positions: the server's front end minus
/// the engine.
pub fn frontend() -> &'static Frontend {
    static F: OnceLock<Frontend> = OnceLock::new();
    F.get_or_init(|| {
        let qwen3 = template_sources().into_iter().find(|s| s.contains("<tool_call>")).expect("a template with tools");
        Frontend {
            tok: smollm2().clone(),
            template: Some(ChatTemplate::new(&qwen3, None, Some("<|im_end|>".into())).expect("Qwen3 template")),
            hybrid: true,
            defaults: Defaults::for_model_type("qwen3"),
            ctx: 4096,
            test_hooks: false,
        }
    })
}

fn sample_messages() -> Json {
    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "hello", "reasoning_content": "greet"}, {"role": "user", "content": "bye"}])
}

/// Encodes the input as text and decodes it as ids, whole and streamed. With `exact` (a
/// byte-level vocabulary), checks that decoding inverts encoding and that the streamed text
/// equals the whole decode.
fn exercise_tokenizer(tok: &Tokenizer, bytes: &[u8], exact: bool) {
    let text = String::from_utf8_lossy(bytes);
    if let Ok(ids) = tok.encode(&text, false) {
        if let Ok(back) = tok.decode(&ids, false) {
            if exact && back != text {
                // A vocabulary may lack some bytes (SmolLM2's has no token for 21 of them, e.g.
                // 0x04 and the lead byte 0xF1): their characters are lost or become U+FFFD, the
                // same in every context. Everything else must come back.
                let per_char: String = text
                    .chars()
                    .map(|c| {
                        let ids = tok.encode(c.encode_utf8(&mut [0; 4]), false).expect("one character encodes");
                        tok.decode(&ids, false).expect("its ids decode")
                    })
                    .collect();
                assert_eq!(back, per_char, "decode(encode(text)) lost more than the unrepresentable bytes");
            }
        }
    }
    let vocab = tok.vocab_size().max(1) as u32;
    // Ids from the bytes, a few beyond the vocabulary.
    let ids: Vec<u32> = bytes
        .chunks(2)
        .take(512)
        .map(|c| u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32 % (vocab + 4))
        .collect();
    let _ = tok.decode(&ids, true);
    let whole = tok.decode(&ids, false);
    let mut dec = StreamDecoder::new(tok);
    let mut streamed = String::new();
    for &id in &ids {
        match dec.push(id) {
            Ok(piece) => streamed.push_str(&piece),
            Err(_) => return,
        }
    }
    if let Ok(rest) = dec.finish() {
        streamed.push_str(&rest);
        if exact {
            assert_eq!(Ok(streamed), whole.map_err(|e| e.to_string()), "streamed decode != whole decode of {ids:?}");
        }
    }
}

/// GGUF reader: header, metadata, tensor directory, dequantization, configuration, embedded
/// vocabulary and chat template.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(Path::new("fuzz.gguf"), data.to_vec()) else { return };
    for t in &file.tensors {
        if let Ok(v) = file.dequantize(&t.name) {
            assert_eq!(v.len() as u64, t.n_elements(), "tensor {}", t.name);
        }
    }
    let cfg = config_from_gguf(&file);
    let arch = file.get_str("general.architecture").unwrap_or("").to_string();
    let ck = Checkpoint::Gguf { file: Box::new(file), arch };
    if let Ok(cfg) = &cfg {
        cfg.validate().expect("config_from_gguf returns a valid configuration");
        for name in [
            "embed_tokens.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.input_layernorm.weight",
            "layers.0.linear_attn.in_proj_qkv.weight",
            "layers.0.linear_attn.out_proj.weight",
            "layers.0.linear_attn.A_log",
            "norm.weight",
            "lm_head.weight",
        ] {
            let _ = ck.get(name);
            if let Ok(Some(m)) = ck.gguf_block_matrix(name).map(|m| m.filter(|m| m.rows > 0)) {
                let mut row = vec![0f32; m.cols];
                m.decode_rows(0, 1, &mut row).expect("a block matrix decodes its first row");
            }
        }
    }
    if let Some(v) = ck.gguf_vocab() {
        if let Ok(tok) = Tokenizer::from_gguf(&v) {
            exercise_tokenizer(&tok, b"Hello, world! <|im_start|>user\n\xe6\x9d\xb1 \x00 12345", false);
        }
    }
    if let Some(src) = ck.gguf_chat_template() {
        if let Ok(t) = ChatTemplate::new(&src, Some("<s>".into()), None) {
            let _ = t.render(&sample_messages(), None, true, &Map::new());
        }
    }
}

/// safetensors reader: header, offsets, tensor views and their conversion to f32.
pub fn safetensors(data: &[u8]) {
    let Ok(set) = SafetensorsSet::from_bytes(Path::new("fuzz.safetensors"), data.to_vec()) else { return };
    let names: Vec<String> = set.names().map(String::from).collect();
    for name in names {
        let (_, shape, bytes) = set.raw(&name).expect("a listed tensor");
        let (numel, n_bytes) = (shape.iter().product::<usize>(), bytes.len());
        if let Ok(Some(t)) = set.get(&name) {
            assert_eq!(t.numel(), numel);
            if let Ok(v) = t.to_f32_vec() {
                assert_eq!(v.len(), numel, "tensor {name} of {n_bytes} bytes");
            }
        }
    }
}

/// `config.json`: every architecture's configuration, validated.
pub fn config(data: &[u8]) {
    let Ok(v) = serde_json::from_slice::<Json>(data) else { return };
    if let Ok(cfg) = ModelConfig::from_hf_json(&v) {
        cfg.validate().expect("from_hf_json returns a valid configuration");
        assert!(cfg.q_proj_dim() >= cfg.num_heads * cfg.head_dim);
        if let Some(d) = &cfg.deltanet {
            assert!(d.conv_dim() > 0);
        }
    }
}

/// A GGUF-style vocabulary from bytes: `[model][pre]` then `\n`-separated tokens, an empty line,
/// `\n`-separated merges, an empty line and the text to encode. Tokens of the form `<|…|>` are
/// control tokens.
fn vocab_from_bytes(data: &[u8]) -> (GgufVocab, &[u8]) {
    let (model, pre) = match data {
        [m, p, ..] => (*m, *p),
        _ => (0, 0),
    };
    let mut rest = data.get(2..).unwrap_or_default();
    // Lines up to the next empty one; `rest` moves past it.
    let mut section = || {
        let mut lines = Vec::new();
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let line = &rest[..nl];
            rest = &rest[nl + 1..];
            if line.is_empty() {
                return lines;
            }
            lines.push(String::from_utf8_lossy(line).into_owned());
        }
        lines
    };
    let tokens = section();
    let merges = section();
    let text = rest;
    let pres = [None, Some("gpt2"), Some("smollm"), Some("llama-bpe"), Some("qwen2"), Some("default"), Some("other")];
    let n = tokens.len() as u32;
    let v = GgufVocab {
        model: if model & 1 == 0 { "gpt2" } else { "llama" }.to_string(),
        pre: pres[pre as usize % pres.len()].map(String::from),
        token_types: tokens
            .iter()
            .map(|t| {
                if t.starts_with("<|") && t.ends_with("|>") {
                    3
                } else if t.starts_with("<0x") {
                    6
                } else {
                    1
                }
            })
            .collect(),
        scores: tokens.iter().map(|t| t.chars().count() as f32).collect(),
        tokens,
        merges,
        bos: (model & 2 != 0 && n > 0).then_some(0),
        eos: (model & 4 != 0 && n > 1).then_some(1),
        eot: None,
        pad: None,
        add_bos: Some(model & 8 != 0),
    };
    (v, text)
}

/// Tokenizer loading (GGUF vocabularies, `tokenizer.json`) and encoding/decoding, by the first
/// byte: 0 encodes and decodes with the real SmolLM2 tokenizer, 1 builds a vocabulary from the
/// input ([`vocab_from_bytes`]), 2 reads a `tokenizer.json` (and, after a NUL byte, a
/// `tokenizer_config.json`).
pub fn tokenizer(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode % 3 {
        0 => exercise_tokenizer(smollm2(), rest, true),
        1 => {
            let (v, text) = vocab_from_bytes(rest);
            if let Ok(tok) = Tokenizer::from_gguf(&v) {
                exercise_tokenizer(&tok, text, false);
            }
        }
        _ => {
            let (json, cfg) = match rest.iter().position(|&b| b == 0) {
                Some(p) => (&rest[..p], serde_json::from_slice::<Json>(&rest[p + 1..]).ok()),
                None => (rest, None),
            };
            let Ok(json) = std::str::from_utf8(json) else { return };
            if let Ok(tok) = Tokenizer::from_json(json, cfg.as_ref(), None, None) {
                exercise_tokenizer(&tok, b"Hello <|im_start|> w\xc3\xb6rld 42", false);
            }
        }
    }
}

/// Messages from bytes: a JSON `{"messages", "tools"}` object or messages array as is; anything
/// else is split at NUL bytes into messages whose first byte picks the role (and, for assistant
/// turns, a tool call carrying the text as an argument).
fn messages_from_bytes(data: &[u8]) -> (Json, Option<Json>) {
    if let Ok(v) = serde_json::from_slice::<Json>(data) {
        return match v {
            Json::Object(mut o) => (o.remove("messages").unwrap_or(Json::Null), o.remove("tools")),
            other => (other, None),
        };
    }
    let messages = data
        .split(|&b| b == 0)
        .map(|piece| {
            let (role, text) = piece.split_first().map_or((0, &[][..]), |(r, t)| (*r, t));
            let text = String::from_utf8_lossy(text);
            match role % 5 {
                0 => json!({"role": "system", "content": text}),
                1 => json!({"role": "user", "content": text}),
                2 => json!({"role": "assistant", "content": text, "reasoning_content": text}),
                3 => json!({"role": "tool", "content": text, "tool_call_id": "call_0"}),
                _ => json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": text, "arguments": {"value": text}}}]}),
            }
        })
        .collect();
    (Json::Array(messages), None)
}

/// Chat-template rendering of adversarial conversations through the fixtures' real templates:
/// `[template][flags]` then the messages ([`messages_from_bytes`]).
pub fn chat_template(data: &[u8]) {
    let [sel, flags, rest @ ..] = data else { return };
    let ts = templates();
    let t = &ts[*sel as usize % ts.len()];
    let (messages, tools) = messages_from_bytes(rest);
    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), Json::Bool(flags & 2 != 0));
    let _ = t.render(&messages, tools.as_ref(), flags & 1 != 0, &extra);
}

/// The server's request path short of the engine, in the server's order: the JSON body, its
/// field checks, the prompt rendered and tokenized for chat and text completions, and the
/// generation parameters, which refuse a prompt that leaves no room in the context (the
/// earlier checks bound only the text's bytes).
pub fn request(data: &[u8]) {
    let Ok(v) = serde_json::from_slice::<Json>(data) else { return };
    let front = frontend();
    if let Ok(req) = parse_chat(&v, front.ctx) {
        if let Ok(p) = front.chat_prompt(&req) {
            if front.gen_params(&req.common, &p, req.logprobs, "messages").is_ok() {
                assert!(p.tokens.len() < front.ctx, "a prompt of {} tokens was accepted", p.tokens.len());
            }
        }
    }
    if let Ok(req) = parse_completion(&v, front.ctx) {
        if let Ok(p) = front.completion_prompt(&req) {
            if front.gen_params(&req.common, &p, req.logprobs, "prompt").is_ok() {
                assert!(p.tokens.len() < front.ctx, "a prompt of {} tokens was accepted", p.tokens.len());
            }
        }
    }
}

fn schemas() -> ToolSchemas {
    ToolSchemas::from_tools(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"type": ["null", "string"]}}}}}),
        json!({"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}),
    ])
}

/// Reasoning and tool-call parsing of generated text: `[flags]` then the text. The text is parsed
/// in one piece and streamed in pieces of 1 to 8 characters; both must agree.
pub fn tool_parser(data: &[u8]) {
    let [flags, rest @ ..] = data else { return };
    let text = String::from_utf8_lossy(rest);
    let think = flags & 1 != 0;
    let tools = || (flags & 2 != 0).then(schemas);
    let one = parse_all(&text, think, tools(), "call_");
    let mut p = OutputParser::new(think, tools(), "call_");
    let mut streamed = Parsed::default();
    let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let (mut i, mut step) = (0, *flags as usize >> 2);
    while i + 1 < chars.len() {
        step = step.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let j = (i + 1 + (step >> 16) % 8).min(chars.len() - 1);
        for d in p.push(&text[chars[i]..chars[j]]) {
            streamed.add(&d);
        }
        i = j;
    }
    for d in p.finish() {
        streamed.add(&d);
    }
    assert_eq!(streamed, one, "streamed parse differs from the one-shot parse");
}
