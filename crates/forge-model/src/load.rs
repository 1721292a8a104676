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
