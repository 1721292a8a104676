//! Self-generated chat calibration (ANEMLL Forge's `qwen38_calib_gen.py`): the teacher answers a list
//! of prompts through its own chat template, and each conversation — the templated prompt, the
//! sampled answer and the stop token that closed it — becomes one calibration row of token ids,
//! written as an `ids=` rows file (see [`crate::calib`]).

use crate::calib::ROWS_HEADER;
use anyhow::{bail, Context, Result};
use forge_core::chat::ChatTemplate;
use forge_core::tokenizer::Tokenizer;
use forge_model::generate::generate;
use forge_model::load::Loaded;
use forge_model::sampling::{Sampler, SamplingParams};
use std::path::Path;

/// How answers are sampled.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
}

/// One conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenRow {
    /// Templated prompt, then the answer (ending with its stop id when one ended it).
    pub ids: Vec<u32>,
    pub prompt_tokens: usize,
    /// Whether a stop id ended the answer (false: `max_tokens` cut it).
    pub stopped: bool,
}

/// Prompts from a file, by extension: `.json` is a JSON array of strings, `.jsonl` one
/// `{"prompt": "..."}` object per line, anything else one prompt per line. Blank lines, and in
/// plain text lines starting with `#`, are skipped. Refuses the evaluation split.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read prompts", path.display()))?;
    crate::calib::refuse_eval_split(path)?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let prompts: Vec<String> = match ext.as_str() {
        "json" => {
            let v: Vec<String> = serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON array of strings", path.display()))?;
            if let Some(i) = v.iter().position(|p| p.trim().is_empty()) {
                bail!("{}: prompt {i} is empty", path.display());
            }
            v
        }
        "jsonl" => {
            let mut v = Vec::new();
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let bad = || format!("{}:{}: expected {{\"prompt\": \"...\"}}", path.display(), i + 1);
                let obj: serde_json::Value = serde_json::from_str(line).with_context(bad)?;
                let p = obj.get("prompt").and_then(|p| p.as_str()).with_context(bad)?;
                if p.trim().is_empty() {
                    bail!("{}:{}: empty prompt", path.display(), i + 1);
                }
                v.push(p.to_string());
            }
            v
        }
        _ => text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect(),
    };
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(prompts)
}

/// The tokenizer and chat template of a loaded model, or an error naming the model.
pub fn chat_parts(loaded: &Loaded) -> Result<(&Tokenizer, &ChatTemplate)> {
    let tok = loaded.tokenizer()?;
    let tpl = loaded.template.as_ref().with_context(|| {
        format!("{}: no chat template (chat_template.jinja, tokenizer_config.json or GGUF)", loaded.path.display())
    })?;
    Ok((tok, tpl))
}

/// Token ids of `prompt` as one user turn in the model's chat template, with the generation
/// prompt (the template writes its own BOS when it wants one).
pub fn prompt_ids(loaded: &Loaded, prompt: &str) -> Result<Vec<u32>> {
    let (tok, tpl) = chat_parts(loaded)?;
    let msgs = serde_json::json!([{"role": "user", "content": prompt}]);
    let text = tpl.render(&msgs, None, true, &serde_json::Map::new())?;
    tok.encode(&text, false)
}

/// The seed of prompt `index`'s sampler: each answer has its own random stream, so a row does not
/// depend on the prompts before it (or on `--limit`).
pub fn row_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_add(1).wrapping_mul(0xD1B5_4A32_D192_ED03)
}

/// Answers prompt `index` (its seed is [`row_seed`]).
pub fn generate_row(loaded: &Loaded, prompt: &str, index: usize, o: &GenOptions) -> Result<GenRow> {
    let tok = loaded.tokenizer()?;
    let mut ids = prompt_ids(loaded, prompt)?;
    let prompt_tokens = ids.len();
    let params = SamplingParams {
        temperature: o.temperature,
        top_k: 0,
        top_p: o.top_p,
        min_p: 0.0,
        seed: row_seed(o.seed, index),
    };
    let mut sampler = Sampler::new(params);
    let mut session = loaded.model.new_session();
    let mut answer = Vec::new();
    let st = generate(&loaded.model, &mut session, &ids, o.max_tokens, &mut sampler, tok.stop_ids(), |t| {
        answer.push(t);
        Ok(true)
    })
    .with_context(|| format!("prompt {index}"))?;
    ids.extend(answer);
    ids.extend(st.stop_id);
    Ok(GenRow { ids, prompt_tokens, stopped: st.stop_id.is_some() })
}

/// An ids rows file: [`ROWS_HEADER`] line, then one row per line.
pub fn rows_file_text(rows: &[Vec<u32>]) -> String {
    let mut s = format!("{ROWS_HEADER} forge calib generate: one conversation per line (token ids)\n");
    for r in rows {
        let line: Vec<String> = r.iter().map(u32::to_string).collect();
        s.push_str(&line.join(" "));
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, text: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("forge-calib-gen-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn calib_gen_prompt_file_formats() {
        let want = vec!["What is Rust?".to_string(), "Write a haiku about rain.".to_string()];
        let txt = tmp("p.txt", "# comment\nWhat is Rust?\n\n  Write a haiku about rain.  \n");
        assert_eq!(read_prompts(&txt).unwrap(), want);
        let json = tmp("p.json", r#"["What is Rust?", "Write a haiku about rain."]"#);
        assert_eq!(read_prompts(&json).unwrap(), want);
        let jsonl = tmp("p.jsonl", "{\"prompt\": \"What is Rust?\"}\n\n{\"prompt\": \"Write a haiku about rain.\"}\n");
        assert_eq!(read_prompts(&jsonl).unwrap(), want);

        let err = |p: &Path| format!("{:#}", read_prompts(p).unwrap_err());
        let empty = tmp("empty.txt", "# only a comment\n\n");
        assert!(err(&empty).contains("empty.txt: no prompts"), "{}", err(&empty));
        let missing = empty.with_file_name("missing.txt");
        assert!(err(&missing).contains("missing.txt: cannot read prompts"), "{}", err(&missing));
        let bad = tmp("bad.jsonl", "{\"text\": \"x\"}\n");
        assert!(err(&bad).contains("bad.jsonl:1: expected"), "{}", err(&bad));
        let bad = tmp("bad.json", "{\"prompt\": \"x\"}");
        assert!(err(&bad).contains("bad.json: expected a JSON array"), "{}", err(&bad));
    }

    #[test]
    fn calib_gen_row_seeds_differ() {
        let s: std::collections::HashSet<u64> =
            (0..3).flat_map(|seed| (0..100).map(move |i| row_seed(seed, i))).collect();
        assert_eq!(s.len(), 300);
    }
}
