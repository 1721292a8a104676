//! Open a model path (Hugging Face directory or GGUF file) into a ready model, its tokenizer and
//! its chat template.

use crate::model::Model;
use anyhow::{Context, Result};
use forge_core::chat::ChatTemplate;
use forge_core::checkpoint::Checkpoint;
use forge_core::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

pub struct Loaded {
    pub model: Model,
    /// Absent for checkpoints shipped without `tokenizer.json` (e.g. test fixtures).
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub path: PathBuf,
}

impl Loaded {
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .with_context(|| format!("{}: no tokenizer (tokenizer.json or GGUF vocabulary)", self.path.display()))
    }
}

/// The tokenizer of a checkpoint (tokenizer.json of a directory, or the GGUF vocabulary).
pub fn load_tokenizer(ck: &Checkpoint) -> Result<Tokenizer> {
    match ck {
        Checkpoint::Hf { dir, .. } => Tokenizer::from_dir(dir),
        Checkpoint::Gguf { .. } => {
            let v = ck.gguf_vocab().with_context(|| format!("{}: no tokenizer.ggml.tokens", ck.path().display()))?;
            Tokenizer::from_gguf(&v)
        }
    }
}

/// Load a Hugging Face directory, a GGUF file or a Forge export.
pub fn load(path: &Path) -> Result<Loaded> {
    if crate::export::is_export(path) {
        let ex = crate::export::Export::open(path)?;
        if !ex.is_compiled() {
            if let Some(msg) = packing_exceeds_memory(ex.packing_bytes(), available_memory()) {
                anyhow::bail!("{}: {msg}; run `forge compile --model {}` once first", path.display(), path.display());
            }
        }
        let src = ex.source()?;
        let mut loaded = load_with(&src, &|name, o, i| ex.linear(name, o, i))?;
        if let (Some(table), crate::model::Embedding::Table(_)) = (ex.embedding()?, &loaded.model.embed) {
            loaded.model.embed = crate::model::Embedding::Table(table);
        }
        loaded.path = path.to_path_buf();
        return Ok(loaded);
    }
    load_with(path, &|_, _, _| Ok(None))
}

/// Why packing `need` bytes at load would not fit in `available` bytes (None: it fits, or the
/// available memory is unknown). The alternative is the kernel's OOM killer partway in.
fn packing_exceeds_memory(need: u64, available: Option<u64>) -> Option<String> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match available {
        Some(a) if need > a => Some(format!(
            "without its compiled cache, loading packs the quantized weights in memory, about {:.1} GiB, \
             and {:.1} GiB is available",
            gib(need),
            gib(a)
        )),
        _ => None,
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes (None where there is no such file or field).
fn available_memory() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Load a checkpoint with some linear layers supplied by `provider`.
pub fn load_with(path: &Path, provider: &crate::model::LinearProvider) -> Result<Loaded> {
    let (ck, cfg) = Checkpoint::open(path)?;
    let model = Model::load_with(&ck, cfg, provider)?;
    let (tokenizer, template) = match &ck {
        Checkpoint::Hf { dir, .. } => {
            let tok = if dir.join("tokenizer.json").exists() { Some(Tokenizer::from_dir(dir)?) } else { None };
            let (bos, eos) = tok.as_ref().map(|t| (t.bos_token(), t.eos_token())).unwrap_or((None, None));
            (tok, ChatTemplate::from_dir(dir, bos, eos)?)
        }
        Checkpoint::Gguf { .. } => {
            let vocab = ck.gguf_vocab().with_context(|| format!("{}: no tokenizer.ggml.tokens", path.display()))?;
            let tok = Tokenizer::from_gguf(&vocab).with_context(|| format!("{}: tokenizer", path.display()))?;
            let tpl = match ck.gguf_chat_template() {
                Some(src) => Some(
                    ChatTemplate::new(&src, tok.bos_token(), tok.eos_token())
                        .with_context(|| format!("{}: tokenizer.chat_template", path.display()))?,
                ),
                None => None,
            };
            (Some(tok), tpl)
        }
    };
    Ok(Loaded { model, tokenizer, template, path: path.to_path_buf() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   23068672 kB\n";
        assert_eq!(parse_mem_available(text), Some(23068672 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn a_load_that_would_not_fit_is_refused_with_the_sizes() {
        let gib = 1u64 << 30;
        let msg = packing_exceeds_memory(24 * gib, Some(22 * gib)).expect("refused");
        assert!(msg.contains("24.0 GiB") && msg.contains("22.0 GiB"), "{msg}");
        // The 27B shape's 9.7 GiB packed form, SmolLM2-sized, or memory unknown: loaded.
        assert_eq!(packing_exceeds_memory(97 * gib / 10, Some(22 * gib)), None);
        assert_eq!(packing_exceeds_memory(80 << 20, Some(22 * gib)), None);
        assert_eq!(packing_exceeds_memory(24 * gib, None), None);
    }
}
