//! Open a model path (Hugging Face directory or GGUF file) into a ready model, its tokenizer and
//! its chat template.

use crate::model::Model;
use anyhow::{Context, Result};
use forge_core::chat::ChatTemplate;
use forge_core::checkpoint::Checkpoint;
use forge_core::config::ModelConfig;
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

/// How a checkpoint is loaded.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Dequantize a GGUF file's block-quantized and 16-bit linear weights to f32 at load (the reference
    /// path: about 7× a Q4 file's size in memory) instead of running them from the file's
    /// mapping in their blocks.
    pub dequantize_gguf: bool,
}

/// Load a checkpoint with some linear layers supplied by `provider`.
pub fn load_with(path: &Path, provider: &crate::model::LinearProvider) -> Result<Loaded> {
    load_with_options(path, provider, LoadOptions::default())
}

/// [`load`] of a plain checkpoint (not an export) with `opts`.
pub fn load_options(path: &Path, opts: LoadOptions) -> Result<Loaded> {
    load_with_options(path, &|_, _, _| Ok(None), opts)
}

/// The GGUF block-quantized weight of linear layer `name` (canonical, without `.weight`) as a
/// [`crate::linear::Linear`] over the file's mapping; None where the checkpoint is not GGUF or
/// the weight is not block-quantized (it is then read as a dense tensor). A tied head reads the
/// embedding table (the model then looks embeddings up row by row through the head).
pub fn gguf_linear(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    name: &str,
    out_f: usize,
    in_f: usize,
) -> Result<Option<crate::linear::Linear>> {
    let stored = if name == "lm_head" && cfg.tie_embeddings { "embed_tokens" } else { name };
    let Some(m) = gguf_blocks(ck, &format!("{stored}.weight"), out_f, in_f)? else { return Ok(None) };
    Ok(Some(crate::linear::Linear::with_weight(name, out_f, in_f, crate::linear::Weight::Gguf(std::sync::Arc::new(m)))))
}

/// The block-quantized GGUF tensor `name` (canonical), checked to be `rows × cols`; None where
/// the checkpoint is not GGUF or the tensor is not block-quantized.
fn gguf_blocks(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Option<forge_core::gguf::BlockMatrix>> {
    let Some(m) = ck.gguf_block_matrix(name)? else { return Ok(None) };
    if (m.rows, m.cols) != (rows, cols) {
        anyhow::bail!(
            "{}: tensor '{}' has shape [{}, {}], the config implies [{rows}, {cols}]",
            ck.path().display(),
            m.name,
            m.rows,
            m.cols
        );
    }
    Ok(Some(m))
}

/// [`Model::load_with`] where the layers `provider` does not supply come, for a GGUF file, from
/// [`gguf_linear`] (unless `opts` asks for dequantization), else from the dense tensors.
pub fn model_with_options(
    ck: &Checkpoint,
    cfg: ModelConfig,
    provider: &crate::model::LinearProvider,
    opts: LoadOptions,
) -> Result<Model> {
    if opts.dequantize_gguf || !matches!(ck, Checkpoint::Gguf { .. }) {
        return Model::load_with(ck, cfg, provider);
    }
    let c = cfg.clone();
    // An untied block-quantized table stays in its blocks too (a tied one is the head's).
    let embedding = match cfg.tie_embeddings {
        true => None,
        false => gguf_blocks(ck, "embed_tokens.weight", cfg.vocab_size, cfg.hidden_size)?
            .map(|m| crate::model::Embedding::Blocks(std::sync::Arc::new(m))),
    };
    Model::load_with_embedding(
        ck,
        cfg,
        &|name, o, i| match provider(name, o, i)? {
            Some(l) => Ok(Some(l)),
            None => gguf_linear(ck, &c, name, o, i),
        },
        embedding,
    )
}

/// [`load_with`] with `opts`.
pub fn load_with_options(path: &Path, provider: &crate::model::LinearProvider, opts: LoadOptions) -> Result<Loaded> {
    let (ck, cfg) = Checkpoint::open(path)?;
    let model = model_with_options(&ck, cfg, provider, opts)?;
    let (tokenizer, template) = match &ck {
        Checkpoint::Hf { dir, .. } => {
            let tok = if dir.join("tokenizer.json").exists() { Some(Tokenizer::from_dir(dir)?) } else { None };
            let (bos, eos) = tok.as_ref().map(|t| (t.bos_token(), t.eos_token())).unwrap_or((None, None));
            (tok, ChatTemplate::from_dir(dir, bos, eos)?)
        }
        Checkpoint::Gguf { .. } => 'vocab: {
            // A file without a vocabulary (a converted test checkpoint) runs on token ids.
            let Some(vocab) = ck.gguf_vocab() else { break 'vocab (None, None) };
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
