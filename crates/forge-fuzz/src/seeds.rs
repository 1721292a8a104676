//! The seed corpus (`fuzz/corpus/<target>/seed-*`), derived from the repository's fixtures:
//! small GGUF files written with Forge's own writer (a byte-level BPE vocabulary cut from
//! SmolLM2's, a SentencePiece one, one block of every quantization type, a `qwen35` hybrid laid
//! out as llama.cpp's converter writes it), the fixtures'
//! safetensors files cut to their small tensors, their `config.json` files, the tokenizer's test
//! texts, the chat-template fixtures' conversations, request bodies from the server's tests and
//! model outputs from the parser's. `fuzz --write-seeds` rewrites them; regression inputs
//! (`regress-*`) are kept by hand.

use crate::mutate::Rng;
use crate::targets::{fixture, smollm2_vocab, template_sources};
use forge_core::gguf::{write_gguf, GgmlType, GgufValue};
use forge_core::tokenizer::Tokenizer;
use serde_json::{json, Map, Value as Json};
use std::collections::BTreeMap;

type Seeds = Vec<(String, Vec<u8>)>;

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.into())
}

fn strings(v: &[String]) -> GgufValue {
    GgufValue::Array(v.iter().map(|t| s(t)).collect())
}

/// A byte-level BPE vocabulary cut from SmolLM2's: its special tokens, the letters, and the first
/// merges that stay within them.
pub fn small_gpt2_vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let full = smollm2_vocab();
    let mut tokens: Vec<String> = full.tokens[..17].to_vec();
    tokens.extend("abcdefghijklmnopqrstuvwxyz,.!?0123456789ĠĊ".chars().map(String::from));
    let mut merges = Vec::new();
    for m in &full.merges {
        if tokens.len() >= 96 {
            break;
        }
        let Some((a, b)) = m.split_once(' ') else { continue };
        let ab = format!("{a}{b}");
        if tokens.iter().any(|t| t == a) && tokens.iter().any(|t| t == b) && !tokens.contains(&ab) {
            tokens.push(ab);
            merges.push(m.clone());
        }
    }
    let types = (0..tokens.len()).map(|i| if i < 17 { 3 } else { 1 }).collect();
    (tokens, types, merges)
}

/// A miniature SentencePiece vocabulary (as in the tokenizer's tests).
fn small_spm_vocab() -> (Vec<String>, Vec<i32>, Vec<f32>) {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in [0x0a, 0x20, 0xc3, 0xa9, 0xe2, 0x96, 0x81] {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for p in [
        "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor", "ld",
        "▁world",
    ] {
        tokens.push(p.into());
        types.push(1);
    }
    let scores = tokens.iter().enumerate().map(|(i, t)| if i < 10 { 0.0 } else { t.chars().count() as f32 }).collect();
    (tokens, types, scores)
}

fn llama_metadata(arch: &str) -> Vec<(String, GgufValue)> {
    let k = |key: &str| format!("{arch}.{key}");
    vec![
        ("general.architecture".into(), s(arch)),
        (k("embedding_length"), GgufValue::U32(32)),
        (k("attention.head_count"), GgufValue::U32(2)),
        (k("attention.head_count_kv"), GgufValue::U32(1)),
        (k("block_count"), GgufValue::U32(1)),
        (k("feed_forward_length"), GgufValue::U32(64)),
        (k("context_length"), GgufValue::U64(256)),
        (k("rope.freq_base"), GgufValue::F32(10000.0)),
        (k("rope.dimension_count"), GgufValue::U32(16)),
        (k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5)),
    ]
}

fn gguf_bytes(metadata: &[(String, GgufValue)], tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)]) -> Vec<u8> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("forge-fuzz-seed-{}-{n}.gguf", std::process::id()));
    write_gguf(&path, metadata, tensors).expect("seed GGUF");
    let bytes = std::fs::read(&path).expect("seed GGUF");
    let _ = std::fs::remove_file(&path);
    bytes
}

fn random_block(rng: &mut Rng, ty: GgmlType, elements: usize) -> Vec<u8> {
    let n = ty.row_bytes(elements).expect("whole blocks");
    // Scales as small f16 values so that the dequantized numbers are finite, as in real files.
    (0..n).map(|i| if i % 2 == 1 { 0x3c } else { rng.next_u64() as u8 }).collect()
}

fn gguf_seeds() -> Seeds {
    let mut rng = Rng::new(43);
    let (tokens, types, merges) = small_gpt2_vocab();
    let template = template_sources()[0].clone();
    let mut md = llama_metadata("llama");
    md.extend([
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(types.iter().map(|&t| GgufValue::I32(t)).collect())),
        ("tokenizer.ggml.merges".into(), strings(&merges)),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false)),
        ("tokenizer.chat_template".into(), s(&template)),
    ]);
    let v = tokens.len() as u64;
    let t = |name: &str, dims: Vec<u64>, ty: GgmlType, rng: &mut Rng| {
        let n = dims.iter().product::<u64>() as usize;
        (name.to_string(), dims, ty, random_block(rng, ty, n))
    };
    let llama_tensors = vec![
        t("token_embd.weight", vec![32, v], GgmlType::Q4_0, &mut rng),
        t("blk.0.attn_q.weight", vec![32, 32], GgmlType::Q4_0, &mut rng),
        t("blk.0.attn_k.weight", vec![32, 16], GgmlType::Q8_0, &mut rng),
        t("blk.0.attn_norm.weight", vec![32], GgmlType::F32, &mut rng),
        t("output_norm.weight", vec![32], GgmlType::F16, &mut rng),
    ];
    let mut out = vec![("seed-llama-gpt2-vocab".to_string(), gguf_bytes(&md, &llama_tensors))];

    let (tokens, types, scores) = small_spm_vocab();
    let mut md = llama_metadata("qwen2");
    md.extend([
        ("general.alignment".into(), GgufValue::U32(64)),
        ("tokenizer.ggml.model".into(), s("llama")),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(types.iter().map(|&t| GgufValue::I32(t)).collect())),
        ("tokenizer.ggml.scores".into(), GgufValue::Array(scores.iter().map(|&x| GgufValue::F32(x)).collect())),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("nested".into(), GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::U8(1), GgufValue::U8(2)])])),
    ]);
    let v = tokens.len() as u64;
    let tensors = vec![
        t("token_embd.weight", vec![32, v], GgmlType::Q4_0, &mut rng),
        t("blk.0.attn_q.bias", vec![32], GgmlType::F32, &mut rng),
    ];
    out.push(("seed-qwen2-spm-vocab".to_string(), gguf_bytes(&md, &tensors)));

    use GgmlType::*;
    let types =
        [F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, IQ4NL, IQ4XS, TQ1_0, TQ2_0];
    let tensors: Vec<_> = types
        .iter()
        .map(|&ty| {
            let n = ty.block_size().expect("known type").max(4) as u64;
            t(&format!("t.{}", ty.name()), vec![n], ty, &mut rng)
        })
        .collect();
    // A one-layer `qwen35` file as llama.cpp's converter lays it out: one key head for two value
    // heads (tiled rows and columns), Q8_0 and F16 matrices, `-exp(A_log)`.
    let k = |key: &str| format!("qwen35.{key}");
    let mut md = llama_metadata("qwen35");
    md.extend([
        (k("ssm.conv_kernel"), GgufValue::U32(4)),
        (k("ssm.state_size"), GgufValue::U32(8)),
        (k("ssm.group_count"), GgufValue::U32(1)),
        (k("ssm.time_step_rank"), GgufValue::U32(2)),
        (k("ssm.inner_size"), GgufValue::U32(16)),
        (k("attention.recurrent_layers"), GgufValue::Array(vec![GgufValue::Bool(true)])),
        (k("full_attention_interval"), GgufValue::U32(4)),
    ]);
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let hybrid = vec![
        t("token_embd.weight", vec![32, 16], GgmlType::Q8_0, &mut rng),
        t("blk.0.attn_qkv.weight", vec![32, 32], GgmlType::Q8_0, &mut rng),
        t("blk.0.ssm_out.weight", vec![16, 32], GgmlType::F16, &mut rng),
        ("blk.0.ssm_a".to_string(), vec![2], GgmlType::F32, f32s(&[-0.5, -2.0])),
        ("blk.0.attn_norm.weight".to_string(), vec![32], GgmlType::F32, f32s(&[1.25; 32])),
    ];
    out.push(("seed-qwen35-tiled".to_string(), gguf_bytes(&md, &hybrid)));
    out.push((
        "seed-every-quant-type".to_string(),
        gguf_bytes(&[("general.architecture".into(), s("llama"))], &tensors),
    ));
    out
}

/// A fixture's safetensors file cut to its tensors of at most `max_bytes`, re-packed.
fn cut_safetensors(rel: &str, max_bytes: usize, max_tensors: usize) -> Vec<u8> {
    let bytes = std::fs::read(fixture(rel)).expect("fixture");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Map<String, Json> = serde_json::from_slice(&bytes[8..8 + n]).expect("fixture header");
    let data = &bytes[8 + n..];
    let mut out_header = Map::new();
    let mut out_data = Vec::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            out_header.insert(name.clone(), info.clone());
            continue;
        }
        let off = |i: usize| info["data_offsets"][i].as_u64().expect("offset") as usize;
        let (s, e) = (off(0), off(1));
        if e - s > max_bytes || out_header.len() > max_tensors {
            continue;
        }
        let mut info = info.clone();
        info["data_offsets"] = json!([out_data.len(), out_data.len() + e - s]);
        out_data.extend_from_slice(&data[s..e]);
        out_header.insert(name.clone(), info);
    }
    let text = Json::Object(out_header).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&out_data);
    out
}

fn safetensors_seeds() -> Seeds {
    [
        ("seed-llama-tiny", "llama_tiny/model.safetensors"),
        ("seed-qwen2-tiny", "qwen2_tiny/model.safetensors"),
        ("seed-qwen35-tiny", "qwen35_tiny/model.safetensors"),
        ("seed-qwen35-mm-shard", "qwen35_tiny_mm/model-00003-of-00003.safetensors"),
        ("seed-upstream-export-layer", "qwen35_tiny_upstream_export/layer_00.safetensors"),
    ]
    .into_iter()
    .map(|(name, rel)| (name.to_string(), cut_safetensors(rel, 512, 8)))
    .collect()
}

fn config_seeds() -> Seeds {
    ["llama_tiny", "llama3_tiny", "qwen2_tiny", "qwen3_tiny", "qwen35_tiny", "qwen35_tiny_mm"]
        .into_iter()
        .map(|d| (format!("seed-{d}"), std::fs::read(fixture(&format!("{d}/config.json"))).expect("fixture config")))
        .collect()
}

fn tokenizer_seeds() -> Seeds {
    let mut out = Seeds::new();
    let doc: Json =
        serde_json::from_slice(&std::fs::read(fixture("smollm2_vocab.json")).expect("fixture")).expect("json");
    let texts: Vec<&str> = doc["cases"].as_array().expect("cases").iter().filter_map(|c| c["text"].as_str()).collect();
    for (i, chunk) in texts.chunks(3).enumerate() {
        let mut b = vec![0u8];
        b.extend_from_slice(chunk.join("").as_bytes());
        out.push((format!("seed-smollm2-texts-{i}"), b));
    }
    let (tokens, _, merges) = small_gpt2_vocab();
    let vocab_input = |model: u8, pre: u8, tokens: &[String], merges: &[String], text: &str| {
        let mut b = vec![1u8, model, pre];
        for t in tokens {
            b.extend_from_slice(t.as_bytes());
            b.push(b'\n');
        }
        b.push(b'\n');
        for m in merges {
            b.extend_from_slice(m.as_bytes());
            b.push(b'\n');
        }
        b.push(b'\n');
        b.extend_from_slice(text.as_bytes());
        b
    };
    out.push(("seed-gpt2-vocab".into(), vocab_input(2 | 4, 2, &tokens, &merges, "hello, world 42!")));
    out.push(("seed-gpt2-vocab-qwen2-pre".into(), vocab_input(2 | 4 | 8, 4, &tokens, &merges, "the end.")));
    let (spm, _, _) = small_spm_vocab();
    out.push(("seed-spm-vocab".into(), vocab_input(1 | 2 | 4 | 8, 0, &spm, &[], "hello world é")));
    // A tokenizer.json, as `Tokenizer::from_dir` reads it, with its tokenizer_config.json.
    let mut v = smollm2_vocab();
    (v.tokens, v.token_types, v.merges) = small_gpt2_vocab();
    let tok = Tokenizer::from_gguf(&v).expect("small vocabulary");
    let mut b = vec![2u8];
    b.extend_from_slice(tok.inner().to_string(false).expect("tokenizer.json").as_bytes());
    b.push(0);
    b.extend_from_slice(
        br#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": true}"#,
    );
    out.push(("seed-tokenizer-json".into(), b));
    out
}

fn chat_template_seeds() -> Seeds {
    let sources = template_sources();
    let doc: Json =
        serde_json::from_slice(&std::fs::read(fixture("chat_templates.json")).expect("fixture")).expect("json");
    let mut out = Seeds::new();
    for case in doc.as_array().expect("cases") {
        let Some(idx) = sources.iter().position(|s| Some(s.as_str()) == case["template"].as_str()) else { continue };
        let flags = u8::from(case["add_generation_prompt"].as_bool().unwrap_or(false))
            | if case["extra"]["enable_thinking"].as_bool().unwrap_or(false) { 2 } else { 0 };
        let mut b = vec![idx as u8, flags];
        b.extend_from_slice(json!({"messages": case["messages"], "tools": case["tools"]}).to_string().as_bytes());
        out.push((format!("seed-{}", case["name"].as_str().unwrap_or("case")), b));
    }
    // The raw form: NUL-separated messages, the first byte of each picking its role.
    for (idx, name) in [(0u8, "smollm2"), (2, "qwen35")] {
        let mut b = vec![idx, 1];
        b.extend_from_slice(b"\x00You are {{ helpful }}.\x00\x01hi <|im_end|> there\x00\x02<think>x</think>ok\x00\x04get_weather\x00\x03sunny");
        out.push((format!("seed-raw-{name}"), b));
    }
    out
}

fn request_seeds() -> Seeds {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let bodies = [
        (
            "chat-plain",
            json!({"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}),
        ),
        (
            "chat-tools-history",
            json!({"messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}]},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "reasoning_content": "look it up",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
              "tools": tools, "tool_choice": "auto", "seed": -1, "top_k": -1,
              "chat_template_kwargs": {"enable_thinking": true}, "logprobs": true, "top_logprobs": 3}),
        ),
        (
            "chat-sampling",
            json!({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
              "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 16, "top_p": 0.9, "min_p": 0.05,
              "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "repeat_last_n": -1,
              "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
              "dry_sequence_breakers": ["\n", ":"], "stop": ["\n\n", "END"], "thinking_budget": 32, "loop_guard": 64, "n": 1}),
        ),
        (
            "chat-max-completion",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4095, "enable_thinking": false}),
        ),
        ("completion-text", json!({"prompt": "Once upon a time", "max_tokens": 8, "echo": true, "logprobs": 2})),
        ("completion-tokens", json!({"prompt": [1, 2, 3, 4000, 49151], "max_tokens": 4})),
        ("completion-nested", json!({"prompt": [[17, 18, 19]], "stop": "x"})),
        ("completion-list", json!({"prompt": ["a"], "seed": 18446744073709551615u64})),
    ];
    bodies.into_iter().map(|(n, b)| (format!("seed-{n}"), b.to_string().into_bytes())).collect()
}

fn tool_parser_seeds() -> Seeds {
    let texts: [(u8, &str, &str); 10] = [
        (0, "reasoning", "<think>\nLet me think.\n</think>\n\nParis."),
        (1, "reasoning-open", "The user asks.\n</think>\n\nAnswer."),
        (2, "xml-call", "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"),
        (2, "json-call", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"noop\", \"arguments\": \"{}\"}\n</tool_call>"),
        (2, "bare-function", "<function=noop>\n</function>\ntext <function=get_weather><parameter=opts>{\"a\": [1, 2]}</parameter><parameter=tags>[1, \"x\"]</parameter></function>"),
        (3, "think-then-call", "<think>plan</think>\n<tool_call>\n<function=get_weather>\n<parameter=scale>\n1.5e3\n</parameter>\n<parameter=note>\nNone\n</parameter>\n</function>\n</tool_call>"),
        (2, "malformed", "<tool_call>\n{\"name\": oops}\n</tool_call> and <tool_call>plain</tool_call> <tool_call><function=get_weather><parameter=city>Rome"),
        (2, "partial-tags", "a <tool b </thi c <function d <parameter=x> e </parameter> f"),
        (0, "unicode", "<think>é🙂\u{0}</think>🙂 <tool_call>"),
        (2, "whitespace", "  \n\t <tool_call>   \n  <function=noop>  \n  </function>  \n  </tool_call>  \n "),
    ];
    texts
        .into_iter()
        .map(|(flags, name, text)| {
            let mut b = vec![flags];
            b.extend_from_slice(text.as_bytes());
            (format!("seed-{name}"), b)
        })
        .collect()
}

/// Every target's seeds, by target name.
pub fn all() -> BTreeMap<&'static str, Seeds> {
    BTreeMap::from([
        ("gguf", gguf_seeds()),
        ("safetensors", safetensors_seeds()),
        ("config", config_seeds()),
        ("tokenizer", tokenizer_seeds()),
        ("chat_template", chat_template_seeds()),
        ("request", request_seeds()),
        ("tool_parser", tool_parser_seeds()),
    ])
}
