//! `forge calib generate` through the binary on a tiny chat model: the random-weight
//! `tests/fixtures/qwen35_tiny` (vocabulary 384) given a byte-level tokenizer written here (ids
//! 0–255 = bytes, no merges, 256 = `<|im_start|>`, 257 = `<|im_end|>`) and a ChatML template, so
//! the expected prompt ids can be worked out by hand, independently of Forge's template engine and
//! tokenizer. Checks: same seed → same file, every row starts with its templated prompt, the file
//! loads through the calibration loader as one row per prompt, and bad input → one-line errors.

mod common;

use common::{expect_error, forge, tmpdir};
use std::path::{Path, PathBuf};

const IM_START: u32 = 256;
const IM_END: u32 = 257;
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] \
                      + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// GPT-2's byte → printable character map (`bytes_to_unicode`), indexed by byte.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// qwen35_tiny + byte-level tokenizer; with `template`, a ChatML chat template too.
fn tiny_chat_model(dir: &Path, template: bool) {
    let fx = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen35_tiny"));
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fx.join(f), dir.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().iter().enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
    let special = |id: u32, s: &str| {
        serde_json::json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": true})
    };
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                                        "use_regex": true});
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(IM_START, "<|im_start|>"), special(IM_END, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let mut cfg = serde_json::json!({"bos_token": null, "eos_token": "<|im_end|>", "add_bos_token": false});
    if template {
        cfg["chat_template"] = CHATML.into();
    }
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

/// The ChatML prompt of one user turn, tokenized by hand.
fn expected_prompt_ids(prompt: &str) -> Vec<u32> {
    let mut ids = vec![IM_START];
    ids.extend(format!("user\n{prompt}").bytes().map(u32::from));
    ids.push(IM_END);
    ids.push(b'\n' as u32);
    ids.push(IM_START);
    ids.extend("assistant\n".bytes().map(u32::from));
    ids
}

fn read_rows(path: &Path) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("#rows"), "{text}");
    lines.map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect()).collect()
}

const PROMPTS: [&str; 4] = ["What is a tuple?", "Why is the sky blue?", "Write a haiku.", "Explain Big-O."];

#[test]
fn calib_generate_is_seeded_and_rows_are_the_conversations() {
    let d = tmpdir("gen");
    let model = d.join("model");
    tiny_chat_model(&model, true);
    let prompts = d.join("prompts.txt");
    std::fs::write(&prompts, format!("# test prompts\n{}\n\n", PROMPTS.join("\n"))).unwrap();
    let run = |seed: &str, out: &Path| {
        let (m, p, o) = (model.to_str().unwrap(), prompts.to_str().unwrap(), out.to_str().unwrap());
        let args =
            ["calib", "generate", "--model", m, "--prompts", p, "--out", o, "--max-tokens", "12", "--limit", "3"];
        let (ok, _, err) = forge(&[&args[..], &["--seed", seed]].concat());
        assert!(ok, "{err}");
        assert!(err.contains("calib generate: 3 rows"), "{err}");
        std::fs::read(out).unwrap()
    };
    let (a, b, c) = (d.join("a.txt"), d.join("b.txt"), d.join("c.txt"));
    // (a) the same seed gives the same bytes; another seed other answers.
    assert_eq!(run("5", &a), run("5", &b));
    assert_ne!(run("6", &c), std::fs::read(&a).unwrap());

    // (b) each row is its templated prompt, then at most 12 answer tokens and the stop token.
    let rows = read_rows(&a);
    assert_eq!(rows.len(), 3);
    let mut generated = 0;
    for (row, p) in rows.iter().zip(PROMPTS) {
        let want = expected_prompt_ids(p);
        assert_eq!(&row[..want.len()], &want[..], "prompt {p:?}");
        let answer = &row[want.len()..];
        assert!(!answer.is_empty() && answer.len() <= 13, "{answer:?}");
        let stop = answer.iter().position(|&t| t == IM_END);
        assert!(stop.is_none_or(|i| i == answer.len() - 1), "stop token inside the answer: {answer:?}");
        if stop.is_none() {
            assert_eq!(answer.len(), 12);
        }
        generated += answer.len();
    }

    // The sidecar records the settings and counts.
    let side: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("a.txt.json")).unwrap()).unwrap();
    let tokens: usize = rows.iter().map(Vec::len).sum();
    assert_eq!(side["rows"], 3);
    assert_eq!(side["tokens"], tokens);
    assert_eq!(side["generated_tokens"], generated);
    assert_eq!(
        (side["seed"].as_u64(), side["max_tokens"].as_u64(), side["limit"].as_u64()),
        (Some(5), Some(12), Some(3))
    );
    assert_eq!((side["temperature"].as_f64(), side["top_p"].as_f64()), (Some(0.7), Some(0.95)));
    assert!(side["prompts"].as_str().unwrap().ends_with("prompts.txt"));

    // (c) the calibration loader reads one row per conversation (cut to --seq when longer).
    let spec = format!("ids={}", a.display());
    assert_eq!(forge_quant::calib::load_rows(None, &spec, 4096).unwrap(), rows);
    let cut = forge_quant::calib::load_rows(None, &format!("{spec}:2"), 30).unwrap();
    assert_eq!(cut, rows[..2].iter().map(|r| r[..30].to_vec()).collect::<Vec<_>>());
    // Prompt i does not depend on the prompts before it: --limit 1 reproduces row 0.
    let one = d.join("one.txt");
    let (m, p, o) = (model.to_str().unwrap(), prompts.to_str().unwrap(), one.to_str().unwrap());
    let (ok, _, err) = forge(&[
        "calib",
        "generate",
        "--model",
        m,
        "--prompts",
        p,
        "--out",
        o,
        "--max-tokens",
        "12",
        "--seed",
        "5",
        "--limit",
        "1",
    ]);
    assert!(ok, "{err}");
    assert_eq!(read_rows(&one), rows[..1]);
}

#[test]
fn calib_generate_bad_inputs_give_one_line_errors() {
    let d = tmpdir("bad");
    let (chat, plain) = (d.join("chat"), d.join("notemplate"));
    tiny_chat_model(&chat, true);
    tiny_chat_model(&plain, false);
    let no_tok = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen35_tiny"));
    let good = d.join("p.txt");
    std::fs::write(&good, "Hello?\n").unwrap();
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "# nothing here\n\n").unwrap();
    let missing = d.join("missing.txt");
    let out = d.join("out.txt");
    let args = |model: &Path, prompts: &Path| -> Vec<String> {
        ["calib", "generate", "--model", model.to_str().unwrap(), "--prompts", prompts.to_str().unwrap()]
            .into_iter()
            .chain(["--out", out.to_str().unwrap(), "--max-tokens", "2"])
            .map(String::from)
            .collect()
    };
    let check = |model: &Path, prompts: &Path, needles: &[&str]| {
        let a = args(model, prompts);
        expect_error(&a.iter().map(String::as_str).collect::<Vec<_>>(), needles);
    };
    check(&chat, &missing, &["missing.txt", "cannot read prompts"]);
    check(&chat, &empty, &["empty.txt", "no prompts"]);
    check(&no_tok, &good, &["qwen35_tiny", "no tokenizer"]);
    check(&plain, &good, &["notemplate", "no chat template"]);
    assert!(!out.exists(), "nothing is written on error");
}
