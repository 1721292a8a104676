//! The seeds are worth mutating only if the parsers accept them: each one gets past the format's
//! checks into the code behind them.

use forge_core::checkpoint::config_from_gguf;
use forge_core::config::ModelConfig;
use forge_core::gguf::GgufFile;
use forge_core::safetensors_dir::SafetensorsSet;
use forge_core::tokenizer::Tokenizer;
use forge_fuzz::seeds;
use std::path::Path;

fn seeds_of(target: &str) -> Vec<(String, Vec<u8>)> {
    seeds::all().remove(target).unwrap()
}

#[test]
fn gguf_seeds_open_with_a_config_vocabulary_and_template() {
    let mut configs = 0;
    for (name, bytes) in seeds_of("gguf") {
        let f = GgufFile::from_bytes(Path::new(&name), bytes).unwrap();
        for t in &f.tensors {
            f.dequantize(&t.name).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        }
        configs += usize::from(config_from_gguf(&f).is_ok());
        if f.get("tokenizer.ggml.tokens").is_some() {
            let ck = forge_core::checkpoint::Checkpoint::Gguf { file: Box::new(f), arch: String::new() };
            Tokenizer::from_gguf(&ck.gguf_vocab().unwrap()).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        }
    }
    assert!(configs >= 2, "{configs}");
}

#[test]
fn safetensors_and_config_seeds_are_accepted() {
    for (name, bytes) in seeds_of("safetensors") {
        let set = SafetensorsSet::from_bytes(Path::new(&name), bytes).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(set.names().count() >= 2, "{name}");
    }
    for (name, bytes) in seeds_of("config") {
        ModelConfig::from_hf_json(&serde_json::from_slice(&bytes).unwrap()).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    }
}

#[test]
fn request_seeds_are_valid_requests() {
    for (name, bytes) in seeds_of("request") {
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let ok = if name.starts_with("seed-chat") {
            forge_server::request::parse_chat(&v, 4096).map(|_| ())
        } else {
            forge_server::request::parse_completion(&v, 4096).map(|_| ())
        };
        ok.unwrap_or_else(|e| panic!("{name}: {}", e.message));
    }
}
