//! One test per bug the fuzz targets (or the review that wrote them) found, each replaying the
//! input kept in the corpus (`fuzz/corpus/<target>/regress-*`) and checking the error it now gets.

use forge_core::checkpoint::config_from_gguf;
use forge_core::config::ModelConfig;
use forge_core::gguf::GgufFile;
use forge_fuzz::harness::{corpus_dir, run_one};
use forge_fuzz::TARGETS;
use std::path::Path;

fn input(target: &str, file: &str) -> Vec<u8> {
    let path = corpus_dir(target).join(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The target survives the input.
fn replay(target: &str, file: &str) -> Vec<u8> {
    let bytes = input(target, file);
    let f = TARGETS.iter().find(|t| t.0 == target).unwrap().1;
    run_one(f, &bytes).unwrap_or_else(|e| panic!("{target}/{file}: {e}"));
    bytes
}

#[test]
fn tokenizer_json_with_a_syntax_error_in_its_decoder_panicked_in_the_tokenizers_crate() {
    let bytes = replay("tokenizer", "regress-tokenizer-json-decoder-syntax-panic");
    let json = std::str::from_utf8(&bytes[1..]).unwrap();
    let json = json.split('\0').next().unwrap();
    let err = forge_core::tokenizer::Tokenizer::from_json(json, None, None, None).unwrap_err().to_string();
    assert!(err.contains("malformed JSON"), "{err}");
}

#[test]
fn gguf_token_embd_without_dimensions_panicked_reading_the_vocabulary_size() {
    let bytes = replay("gguf", "regress-token-embd-without-dims");
    let f = GgufFile::from_bytes(Path::new("x.gguf"), bytes).unwrap();
    let err = config_from_gguf(&f).unwrap_err().to_string();
    assert!(err.contains("token_embd.weight") && err.contains("expected [vocab, hidden]"), "{err}");
}

#[test]
fn gguf_block_count_of_2_pow_40_sized_the_layer_list() {
    let bytes = replay("gguf", "regress-block-count-2e40");
    let f = GgufFile::from_bytes(Path::new("x.gguf"), bytes).unwrap();
    let err = config_from_gguf(&f).unwrap_err().to_string();
    assert!(err.contains("llama.block_count 1099511627776 is out of range"), "{err}");
}

#[test]
fn config_num_hidden_layers_of_10_pow_12_sized_the_layer_list() {
    let bytes = replay("config", "regress-num-hidden-layers-1e12");
    let err = ModelConfig::from_hf_json(&serde_json::from_slice(&bytes).unwrap()).unwrap_err().to_string();
    assert!(err.contains("num_hidden_layers 1000000000000 is out of range"), "{err}");
}

#[test]
fn config_hidden_size_of_10_pow_12_is_refused() {
    let bytes = replay("config", "regress-hidden-size-1e12");
    let err = ModelConfig::from_hf_json(&serde_json::from_slice(&bytes).unwrap()).unwrap_err().to_string();
    assert!(err.contains("hidden_size 1000000000000 is out of range"), "{err}");
}

#[test]
fn tool_parser_unterminated_function_tag_parsed_differently_streamed_and_in_one_piece() {
    // Found by cargo-fuzz: the target asserts that streaming and one-shot parsing agree.
    let bytes = replay("tool_parser", "regress-unterminated-function-tag-stream-mismatch");
    let text = String::from_utf8_lossy(&bytes[1..]);
    let schemas =
        || Some(forge_server::parser::ToolSchemas::from_tools(&[serde_json::json!({"function": {"name": "noop"}})]));
    let one = forge_server::parser::parse_all(&text, false, schemas(), "call_");
    assert_eq!(one.tool_calls.len(), 1, "{one:?}");
    assert_eq!(one.tool_calls[0].name, "noop");
}

#[test]
fn completion_prompt_over_the_context_is_refused_by_its_generation_parameters() {
    // 5,772 bytes of digits and letters: within the byte bound the request parser applies, 4,795
    // tokens once tokenized, over the 4,096 positions. The server checks the token bound in the
    // generation parameters, after tokenization; the target asserted it before.
    let bytes = replay("request", "regress-completion-digits-over-context");
    let front = forge_fuzz::targets::frontend();
    let v = serde_json::from_slice(&bytes).unwrap();
    let req = forge_server::request::parse_completion(&v, front.ctx).unwrap();
    let p = front.completion_prompt(&req).unwrap();
    assert!(p.tokens.len() >= front.ctx, "{} tokens", p.tokens.len());
    let err = front.gen_params(&req.common, &p, req.logprobs, "prompt").unwrap_err();
    assert_eq!((err.code, err.param.as_deref()), (Some("context_length_exceeded"), Some("prompt")), "{}", err.message);
}
