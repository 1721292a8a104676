//! Tokenizer: HF `tokenizer.json` directories and GGUF-embedded vocabularies, plus a streaming
//! detokenizer.
//!
//! Everything is executed by the `tokenizers` crate. For GGUF files the vocabulary is turned into
//! the `tokenizer.json` document the HF tokenizer of that model family would have, so GGUF and
//! safetensors checkpoints of the same model tokenize identically.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

/// Vocabulary as stored in GGUF metadata (`tokenizer.ggml.*`), filled by the GGUF loader.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer flavour of byte-level BPE vocabularies.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`; may be empty (then every token is normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.scores`; may be empty.
    pub scores: Vec<f32>,
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
}

// llama.cpp token types (`llama_token_type`).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;

/// Token texts that end a generation in the common chat formats, in addition to eos/eot.
const STOP_TOKEN_TEXTS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"];

/// Bound on the work of recovering SentencePiece merges (the sum of the squared piece lengths):
/// a 256 Ki vocabulary of 64-byte pieces reaches it; real ones stay below 1e8.
const MAX_SPM_MERGE_WORK: u64 = 1 << 30;

/// Split regex of Llama-3 `tokenizer.json` (`Split` pre-tokenizer, behavior `Isolated`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Split regex of Qwen2/2.5/3 `tokenizer.json`: like Llama-3 but single digits.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    stop_ids: Vec<u32>,
    /// Cached because `tokenizers::Tokenizer::get_vocab_size(true)` rebuilds the whole vocab map.
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir`. BOS/EOS and `add_bos_token` come from a sibling
    /// `tokenizer_config.json`; EOS ids from `generation_config.json` and `config.json` are added to
    /// the stop ids. Missing optional files are fine; unreadable or malformed ones are errors.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = read_bounded(&path, MAX_TOKENIZER_JSON_BYTES)?;
        let inner = parse_tokenizer_json(&text).map_err(|e| anyhow!("failed to load {}: {e}", path.display()))?;

        let tok_cfg = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let gen_cfg = read_optional_json(&dir.join("generation_config.json"))?;
        let model_cfg = read_optional_json(&dir.join("config.json"))?;
        Ok(Self::from_parts(inner, tok_cfg.as_ref(), gen_cfg.as_ref(), model_cfg.as_ref()))
    }

    /// Like [`Self::from_dir`], from the text of `tokenizer.json` and the configurations beside it,
    /// already read and parsed.
    pub fn from_json(
        tokenizer_json: &str,
        tokenizer_config: Option<&Value>,
        generation_config: Option<&Value>,
        config: Option<&Value>,
    ) -> Result<Self> {
        let inner = parse_tokenizer_json(tokenizer_json).map_err(|e| anyhow!("malformed tokenizer.json: {e}"))?;
        Ok(Self::from_parts(inner, tokenizer_config, generation_config, config))
    }

    fn from_parts(
        inner: tokenizers::Tokenizer,
        tok_cfg: Option<&Value>,
        gen_cfg: Option<&Value>,
        model_cfg: Option<&Value>,
    ) -> Self {
        let cfg_token = |key: &str| -> Option<u32> {
            let v = tok_cfg?.get(key)?;
            // Either "<s>" or a serialized AddedToken {"content": "<s>", ...}.
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            inner.token_to_id(text)
        };
        // Ids from generation_config.json / config.json: a number or a list; ids outside the
        // vocabulary are ignored rather than trusted.
        let cfg_id = |cfg: Option<&Value>, key: &str| -> Vec<u32> {
            let raw: Vec<u64> = match cfg.and_then(|c| c.get(key)) {
                Some(Value::Number(n)) => n.as_u64().into_iter().collect(),
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
                _ => Vec::new(),
            };
            raw.into_iter()
                .filter_map(|n| u32::try_from(n).ok())
                .filter(|&id| inner.id_to_token(id).is_some())
                .collect()
        };

        // An explicit (even null) bos_token in tokenizer_config.json is what HF uses; config.json's
        // bos_token_id only fills in when the tokenizer config does not mention BOS at all.
        let bos = match tok_cfg.and_then(|c| c.get("bos_token")) {
            Some(_) => cfg_token("bos_token"),
            None => cfg_id(model_cfg, "bos_token_id").first().copied(),
        };
        let gen_eos = cfg_id(gen_cfg, "eos_token_id");
        let model_eos = cfg_id(model_cfg, "eos_token_id");
        let eos = cfg_token("eos_token").or_else(|| gen_eos.first().copied()).or_else(|| model_eos.first().copied());

        let add_bos = match tok_cfg.and_then(|c| c.get("add_bos_token")) {
            Some(Value::Bool(b)) => *b,
            // No explicit flag: follow what the tokenizer.json post-processor does.
            _ => post_processor_adds_bos(&inner, bos),
        };

        let extra_stops: Vec<u32> = gen_eos.into_iter().chain(model_eos).collect();
        Self::assemble(inner, bos, eos, None, add_bos, &extra_stops)
    }

    /// Builds the tokenizer described by GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(v: &GgufVocab) -> Result<Self> {
        if v.tokens.is_empty() {
            bail!("GGUF tokenizer has no tokens (tokenizer.ggml.tokens is empty)");
        }
        if !v.token_types.is_empty() && v.token_types.len() != v.tokens.len() {
            bail!(
                "GGUF tokenizer.ggml.token_type has {} entries but there are {} tokens",
                v.token_types.len(),
                v.tokens.len()
            );
        }
        let n = v.tokens.len();
        for (name, id) in [("bos", v.bos), ("eos", v.eos), ("eot", v.eot), ("pad", v.pad)] {
            if let Some(id) = id {
                if id as usize >= n {
                    bail!("GGUF {name} token id {id} is out of range (vocabulary has {n} tokens)");
                }
            }
        }

        let doc = match v.model.as_str() {
            "gpt2" => gpt2_tokenizer_json(v)?,
            "llama" => llama_tokenizer_json(v)?,
            other => bail!("GGUF tokenizer model '{other}' not supported yet"),
        };
        let inner = tokenizers::Tokenizer::from_str(&doc.to_string())
            .map_err(|e| anyhow!("failed to build tokenizer from GGUF vocabulary: {e}"))?;
        // llama.cpp defaults: SentencePiece vocabularies add BOS, byte-level BPE ones do not.
        let add_bos = v.add_bos.unwrap_or(v.model == "llama") && v.bos.is_some();
        Ok(Self::assemble(inner, v.bos, v.eos, v.eot, add_bos, &[]))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        bos: Option<u32>,
        eos: Option<u32>,
        eot: Option<u32>,
        add_bos: bool,
        extra_stops: &[u32],
    ) -> Self {
        let mut stop_ids: Vec<u32> = Vec::new();
        let named = STOP_TOKEN_TEXTS.iter().filter_map(|t| inner.token_to_id(t));
        for id in eos.into_iter().chain(eot).chain(extra_stops.iter().copied()).chain(named) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        let vocab_size = inner.get_vocab_size(true);
        Self { inner, bos, eos, add_bos: add_bos && bos.is_some(), stop_ids, vocab_size }
    }

    /// Encodes `text`. Special/added tokens written in the text (e.g. `<|im_start|>`) become single
    /// tokens. BOS is prepended when `add_bos` is set and the model has a BOS token.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| anyhow!("tokenization failed: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text; invalid UTF-8 (e.g. half of a multi-byte character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            bail!("token id {bad} is not in the vocabulary ({} tokens)", self.vocab_size);
        }
        self.inner.decode(ids, skip_special).map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }

    /// The token's vocabulary string (byte-level form such as "Ġhello" for GPT-2 style vocabularies).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn bos_token(&self) -> Option<String> {
        self.bos.and_then(|id| self.inner.id_to_token(id))
    }

    pub fn eos_token(&self) -> Option<String> {
        self.eos.and_then(|id| self.inner.id_to_token(id))
    }

    /// Whether prompts should start with BOS (model metadata, not a per-call choice).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Ids that end generation (eos, eot, `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>` when present).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// A `tokenizer.json` larger than this is refused before it is read (the largest published ones,
/// with 256 Ki-token vocabularies, are about 35 MB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 512 << 20;
/// The same for the small JSON files beside it (`tokenizer_config.json`, `config.json`, ...).
pub const MAX_SIDE_JSON_BYTES: u64 = 64 << 20;

/// The text of `path`, refused if larger than `limit` bytes.
fn read_bounded(path: &Path, limit: u64) -> Result<String> {
    let size = std::fs::metadata(path).with_context(|| format!("failed to read {}", path.display()))?.len();
    if size > limit {
        bail!("{}: {size} bytes is more than the {limit} bytes such a file may have", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("failed to read {}", path.display()))
}

/// A `tokenizer.json` document. Its syntax is checked first: the `tokenizers` crate panics instead
/// of failing on some syntax errors (inside a `decoder`, for one).
fn parse_tokenizer_json(text: &str) -> Result<tokenizers::Tokenizer> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| anyhow!("malformed JSON: {e}"))?;
    tokenizers::Tokenizer::from_str(text).map_err(|e| anyhow!("{e}"))
}

fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    if matches!(std::fs::metadata(path), Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(None);
    }
    let text = read_bounded(path, MAX_SIDE_JSON_BYTES)?;
    serde_json::from_str(&text).map(Some).with_context(|| format!("failed to parse {}", path.display()))
}

/// True when encoding with special tokens puts `bos` in front (HF TemplateProcessing post-processor).
fn post_processor_adds_bos(inner: &tokenizers::Tokenizer, bos: Option<u32>) -> bool {
    let Some(bos) = bos else { return false };
    let with = inner.encode_fast("a", true).map(|e| e.get_ids().to_vec());
    let without = inner.encode_fast("a", false).map(|e| e.get_ids().to_vec());
    match (with, without) {
        (Ok(w), Ok(wo)) => w.len() > wo.len() && w.first() == Some(&bos),
        _ => false,
    }
}

fn token_type(v: &GgufVocab, id: usize) -> i32 {
    v.token_types.get(id).copied().unwrap_or(TOKEN_TYPE_NORMAL)
}

/// Vocab map; on duplicate token strings the lowest id wins (as in llama.cpp's text->id map).
fn vocab_map(v: &GgufVocab) -> serde_json::Map<String, Value> {
    let mut vocab = serde_json::Map::with_capacity(v.tokens.len());
    for (id, t) in v.tokens.iter().enumerate() {
        if !vocab.contains_key(t) {
            vocab.insert(t.clone(), json!(id));
        }
    }
    vocab
}

/// Control tokens become special added tokens and user-defined ones plain added tokens, so both
/// are matched verbatim in input text as in HF tokenizers and llama.cpp.
fn added_tokens(v: &GgufVocab, include_unknown: bool) -> Vec<Value> {
    v.tokens
        .iter()
        .enumerate()
        .filter_map(|(id, t)| {
            let ty = token_type(v, id);
            let special = ty == TOKEN_TYPE_CONTROL || (include_unknown && ty == TOKEN_TYPE_UNKNOWN);
            (special || ty == TOKEN_TYPE_USER_DEFINED).then(|| {
                json!({
                    "id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special,
                })
            })
        })
        .collect()
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_byte_level(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// `tokenizer.json` of a byte-level BPE (GPT-2 style) vocabulary.
fn gpt2_tokenizer_json(v: &GgufVocab) -> Result<Value> {
    // Pre-tokenizers as in the HF tokenizer.json of each family; names follow llama.cpp's
    // `tokenizer.ggml.pre` values that share one split regex.
    let pre = v.pre.as_deref();
    let (normalizer, pre_tokenizer, ignore_merges) = match pre {
        None | Some("default" | "gpt2" | "gpt-2") => (Value::Null, byte_level(true), false),
        Some("smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b") => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            false,
        ),
        // Llama-3's tokenizer.json sets ignore_merges: whole pre-tokens found in the vocab are
        // emitted directly (llama.cpp does the same for this pre type).
        Some("llama3" | "llama-v3" | "llama-bpe") => (Value::Null, split_then_byte_level(LLAMA3_SPLIT), true),
        Some("qwen2" | "deepseek-r1-qwen") => (json!({"type": "NFC"}), split_then_byte_level(QWEN2_SPLIT), false),
        Some(other) => bail!("GGUF tokenizer pre-tokenizer '{other}' not supported yet"),
    };

    let merges = v.merges.iter().map(|m| split_merge(m)).collect::<Result<Vec<_>>>()?;

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens(v, false),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab_map(v), "merges": merges,
        },
    }))
}

/// Splits a GGUF merge "a b" into its two parts. Like llama.cpp, the separator is the first
/// space after the first character, so a part may itself start with a space.
fn split_merge(m: &str) -> Result<[String; 2]> {
    let first = m.chars().next().map_or(0, char::len_utf8);
    match m[first..].find(' ') {
        Some(pos) => Ok([m[..first + pos].to_string(), m[first + pos + 1..].to_string()]),
        None => bail!("malformed GGUF merge {m:?} (expected two space-separated tokens)"),
    }
}

/// `tokenizer.json` of a SentencePiece BPE vocabulary, as HF's Llama/Mistral tokenizer.json:
/// "▁" normalizer, BPE with byte fallback, merges recovered from the piece scores.
fn llama_tokenizer_json(v: &GgufVocab) -> Result<Value> {
    if !v.scores.is_empty() && v.scores.len() != v.tokens.len() {
        bail!("GGUF tokenizer.ggml.scores has {} entries but there are {} tokens", v.scores.len(), v.tokens.len());
    }
    let unk = (0..v.tokens.len())
        .find(|&id| token_type(v, id) == TOKEN_TYPE_UNKNOWN)
        .map(|id| v.tokens[id].clone())
        .or_else(|| v.tokens.iter().find(|t| *t == "<unk>").cloned());

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens(v, true),
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab_map(v), "merges": spm_merges(v)?,
        },
    }))
}

/// Recovers BPE merges from SentencePiece scores the way HF's `SentencePieceExtractor` does: every
/// split of a piece into two vocabulary pieces is a merge, ranked by the merged piece's score
/// (higher first; by id when there are no scores), ties broken by the ids of the two halves.
///
/// Each piece costs the square of its length (every split hashes both halves); pieces are at most
/// a few dozen bytes in real vocabularies, so the total is bounded by [`MAX_SPM_MERGE_WORK`]
/// rather than letting a vocabulary of long pieces take hours.
fn spm_merges(v: &GgufVocab) -> Result<Vec<[String; 2]>> {
    let ids: HashMap<&str, usize> = v
        .tokens
        .iter()
        .enumerate()
        .rev() // lowest id wins for duplicates
        .map(|(id, t)| (t.as_str(), id))
        .collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    let mut work = 0u64;
    for (id, piece) in v.tokens.iter().enumerate() {
        // Control, byte and unknown pieces are never produced by merging.
        if matches!(token_type(v, id), TOKEN_TYPE_CONTROL | TOKEN_TYPE_BYTE | TOKEN_TYPE_UNKNOWN) {
            continue;
        }
        work += (piece.len() as u64).pow(2);
        if work > MAX_SPM_MERGE_WORK {
            bail!(
                "GGUF tokenizer.ggml.tokens: the pieces are too long to recover SentencePiece merges from \
                 (token {id} is {} bytes; the squared lengths exceed {MAX_SPM_MERGE_WORK})",
                piece.len()
            );
        }
        let score = v.scores.get(id).copied().unwrap_or(-(id as f32));
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&piece[..split]), ids.get(&piece[split..])) {
                merges.push((score, id, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then((a.2, a.3).cmp(&(b.2, b.3))));
    Ok(merges.into_iter().map(|(_, _, l, r)| [v.tokens[l].clone(), v.tokens[r].clone()]).collect())
}

/// Incremental detokenizer for streaming: feed ids, get the newly completed UTF-8 text. Text is
/// only released once it no longer ends in an incomplete character, so a multi-byte character
/// split across byte tokens (e.g. an emoji) comes out whole.
///
/// Each step decodes a short window of recent ids and emits the part past the previously
/// decoded prefix; decoding with context (rather than token by token) keeps decoder effects that
/// depend on neighbours, such as SentencePiece's leading-space stripping, correct.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Decode window: `ids[..read]` were emitted by the last step and only serve as context,
    /// `ids[read..]` are pending.
    ids: Vec<u32>,
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that keeps special tokens in the output text.
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self { tok, skip_special: false, ids: Vec::new(), read: 0 }
    }

    /// Drops special tokens (e.g. `<|im_end|>`) from the streamed text.
    pub fn skip_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Adds one id; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix_text = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let full_text = self.tok.decode(&self.ids, self.skip_special)?;
        // A UTF-8 character spans at most 4 byte tokens; a replacement char that survives more
        // pending tokens is real (invalid bytes from the model) and is emitted rather than
        // letting the window, and the cost of each step, grow without bound.
        let incomplete = full_text.ends_with('\u{FFFD}') && self.ids.len() - self.read < 8;
        if full_text.len() <= prefix_text.len() || incomplete {
            // Nothing new yet, or the last character is still incomplete.
            return Ok(String::new());
        }
        let new_text = suffix_after(&full_text, &prefix_text).to_string();
        // The ids just emitted become the next prefix (context for the decoder); older ids are no
        // longer needed, so the buffer stays small however long the stream runs.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(new_text)
    }

    /// Flushes what is still pending (an incomplete character becomes U+FFFD) and resets.
    pub fn finish(&mut self) -> Result<String> {
        let prefix_text = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let full_text = self.tok.decode(&self.ids, self.skip_special)?;
        let rest = suffix_after(&full_text, &prefix_text).to_string();
        self.ids.clear();
        self.read = 0;
        Ok(rest)
    }
}

/// `full` minus the already-emitted `prefix`. The prefix normally matches exactly; if decoding with
/// more context changed it, only the part after the common prefix is new.
fn suffix_after<'s>(full: &'s str, prefix: &str) -> &'s str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    // char_indices yields char boundaries, so slicing at the first mismatch cannot panic.
    let common = full.char_indices().zip(prefix.chars()).find(|((_, a), b)| a != b).map_or(full.len(), |((i, _), _)| i);
    &full[common..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids_of(v: &Value) -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    }

    fn opt_id(v: &Value) -> Option<u32> {
        v.as_u64().map(|x| x as u32)
    }

    /// The SmolLM2-135M-Instruct GGUF vocabulary and the expected ids, written by
    /// tools/make_tokenizer_fixtures.py.
    fn smollm2() -> (Tokenizer, Value) {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/smollm2_vocab.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let doc: Value = serde_json::from_str(&text).unwrap();
        let strings = |k: &str| -> Vec<String> {
            doc[k].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
        };
        let vocab = GgufVocab {
            model: doc["model"].as_str().unwrap().to_string(),
            pre: doc["pre"].as_str().map(str::to_string),
            tokens: strings("tokens"),
            token_types: doc["token_types"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect(),
            scores: Vec::new(),
            merges: strings("merges"),
            bos: opt_id(&doc["bos"]),
            eos: opt_id(&doc["eos"]),
            eot: opt_id(&doc["eot"]),
            pad: opt_id(&doc["pad"]),
            add_bos: doc["add_bos"].as_bool(),
        };
        (Tokenizer::from_gguf(&vocab).unwrap(), doc)
    }

    #[test]
    fn tokenizer_smollm2_matches_hf() {
        let (tok, doc) = smollm2();
        assert_eq!(tok.vocab_size(), 49152);
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.bos_token().as_deref(), Some("<|im_start|>"));
        assert_eq!(tok.eos_token().as_deref(), Some("<|im_end|>"));
        assert!(!tok.add_bos());
        // eos <|im_end|> first, then <|endoftext|> found by name.
        assert_eq!(tok.stop_ids(), &[2, 0]);

        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want = ids_of(&case["ids"]);
            let got = tok.encode(text, false).unwrap();
            assert_eq!(got, want, "encode({text:?})");
            assert_eq!(tok.decode(&got, false).unwrap(), text, "decode(encode({text:?}))");
        }
    }

    #[test]
    fn tokenizer_special_tokens_and_bos() {
        let (tok, _) = smollm2();
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!((ids[0], *ids.last().unwrap()), (1, 2));
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
        assert_eq!(tok.encode("hi", true).unwrap()[0], 1);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.id_to_token(216).as_deref(), Some("Ġ"));
        let err = tok.decode(&[5, 1_000_000], false).unwrap_err();
        assert!(err.to_string().contains("1000000"), "{err}");
    }

    #[test]
    fn tokenizer_stream_decoder_reproduces_text() {
        let (tok, doc) = smollm2();
        for case in doc["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids = ids_of(&case["ids"]);
            let mut dec = StreamDecoder::new(&tok);
            let mut out = String::new();
            let mut pending_steps = 0;
            for &id in &ids {
                let piece = dec.push(id).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "{text:?}: partial char leaked");
                pending_steps += usize::from(piece.is_empty());
                out.push_str(&piece);
            }
            out.push_str(&dec.finish().unwrap());
            assert_eq!(out, text);
            if text.contains('🚀') {
                // The emoji is spread over several byte tokens, so some pushes emit nothing.
                assert!(pending_steps > 0, "{text:?}: expected a split multi-byte char");
            }
        }
        // An incomplete character at the end is flushed as U+FFFD by finish().
        let rocket = tok.encode("🚀", false).unwrap();
        assert!(rocket.len() > 1);
        let mut dec = StreamDecoder::new(&tok);
        assert_eq!(dec.push(rocket[0]).unwrap(), "");
        assert!(dec.finish().unwrap().contains('\u{FFFD}'));
        // Invalid bytes (lone continuation byte 0x80, byte-level "Ģ") never complete a char:
        // they are emitted after a bounded wait and the total still equals the lossy decode.
        let cont = tok.token_to_id("Ģ").unwrap();
        let garbage = vec![cont; 20];
        let mut out = String::new();
        let mut emitted_early = false;
        for &id in &garbage {
            let piece = dec.push(id).unwrap();
            emitted_early |= !piece.is_empty();
            out.push_str(&piece);
        }
        out.push_str(&dec.finish().unwrap());
        assert!(emitted_early);
        assert_eq!(out, tok.decode(&garbage, false).unwrap());
        // Skipping special tokens.
        let ids = tok.encode("<|im_start|>hi<|im_end|>", false).unwrap();
        let mut dec = StreamDecoder::new(&tok).skip_special(true);
        let mut out = String::new();
        for id in ids {
            out.push_str(&dec.push(id).unwrap());
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, "hi");
    }

    fn spm_vocab() -> GgufVocab {
        // A miniature SentencePiece BPE vocabulary: <unk>, <s>, </s>, 256 byte pieces, then pieces.
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TOKEN_TYPE_BYTE);
        }
        let pieces = [
            "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor", "ld",
            "▁world",
        ];
        for p in pieces {
            tokens.push(p.into());
            types.push(TOKEN_TYPE_NORMAL);
        }
        // Longer merged pieces score higher, like a trained model's merge order.
        let scores =
            tokens.iter().enumerate().map(|(i, t)| if i < 259 { 0.0 } else { t.chars().count() as f32 }).collect();
        GgufVocab {
            model: "llama".into(),
            tokens,
            token_types: types,
            scores,
            bos: Some(1),
            eos: Some(2),
            ..Default::default()
        }
    }

    #[test]
    fn tokenizer_sentencepiece_gguf() {
        let tok = Tokenizer::from_gguf(&spm_vocab()).unwrap();
        assert!(tok.add_bos(), "SentencePiece vocabularies add BOS by default");
        let id = |t: &str| tok.token_to_id(t).unwrap();
        let ids = tok.encode("hello world", true).unwrap();
        assert_eq!(ids, vec![1, id("▁hello"), id("▁world")]);
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello world");
        // Characters outside the vocabulary fall back to their UTF-8 bytes.
        let ids = tok.encode("hé", false).unwrap();
        assert_eq!(ids, vec![id("▁h"), id("<0xC3>"), id("<0xA9>")]);
        assert_eq!(tok.decode(&ids, false).unwrap(), "hé");
        let mut dec = StreamDecoder::new(&tok);
        let mut out = String::new();
        for id in tok.encode("hello hé world", false).unwrap() {
            out.push_str(&dec.push(id).unwrap());
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, "hello hé world");
        assert_eq!(tok.stop_ids(), &[2]);
    }

    #[test]
    fn tokenizer_gguf_errors() {
        let mut v = spm_vocab();
        v.model = "bert".into();
        let err = Tokenizer::from_gguf(&v).unwrap_err().to_string();
        assert!(err.contains("'bert' not supported"), "{err}");

        let gpt2 = |pre: &str, merges: Vec<String>| GgufVocab {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens: vec!["a".into(), "b".into(), "ab".into()],
            merges,
            ..Default::default()
        };
        let err = Tokenizer::from_gguf(&gpt2("mystery", vec!["a b".into()])).unwrap_err();
        assert!(err.to_string().contains("'mystery'"), "{err}");
        let err = Tokenizer::from_gguf(&gpt2("gpt2", vec!["ab".into()])).unwrap_err();
        assert!(err.to_string().contains("malformed GGUF merge"), "{err}");
        for pre in ["gpt2", "llama-bpe", "qwen2", "smollm"] {
            let tok = Tokenizer::from_gguf(&gpt2(pre, vec!["a b".into()])).unwrap();
            assert_eq!(tok.encode("ab", false).unwrap(), vec![2], "pre {pre}");
        }
        let mut bad = gpt2("gpt2", vec![]);
        bad.eos = Some(7);
        assert!(Tokenizer::from_gguf(&bad).is_err());
        assert!(Tokenizer::from_gguf(&GgufVocab::default()).is_err());
    }

    #[test]
    fn tokenizer_from_dir_reads_configs() {
        let (tok, _) = smollm2();
        let dir = std::env::temp_dir().join(format!("forge-tok-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        tok.inner().save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": true}"#,
        )
        .unwrap();
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [2, 5]}"#).unwrap();
        let t = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!((t.bos_id(), t.add_bos()), (Some(1), true));
        assert_eq!(t.eos_token().as_deref(), Some("<|im_end|>"));
        assert_eq!(t.stop_ids(), &[2, 5, 0]);
        assert_eq!(t.encode("x = 12345", false).unwrap(), tok.encode("x = 12345", false).unwrap());

        std::fs::write(dir.join("config.json"), "{oops").unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&dir).err().unwrap());
        assert!(err.contains("config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&dir).err().unwrap());
        assert!(err.contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn tokenizer_long_sentencepiece_pieces_are_refused() {
        // Recovering merges costs the square of each piece's length: a vocabulary of a few
        // 40 KB pieces would take minutes and is refused up front, naming the field.
        let mut v = spm_vocab();
        for c in ['a', 'b'] {
            v.tokens.push(c.to_string().repeat(40_000));
            v.token_types.push(TOKEN_TYPE_NORMAL);
            v.scores.push(0.0);
        }
        let t = std::time::Instant::now();
        let err = Tokenizer::from_gguf(&v).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.tokens") && err.contains("40000 bytes"), "{err}");
        assert!(t.elapsed().as_secs() < 5);
    }

    #[test]
    fn tokenizer_json_syntax_errors_are_errors_not_panics() {
        // The tokenizers crate panics ("Helper") on a syntax error inside `decoder`: a
        // tokenizer.json cut short there (an interrupted download) must be an error.
        let (tok, _) = smollm2();
        let json = tok.inner().to_string(false).unwrap();
        let at = json.find("\"decoder\":").unwrap() + 20;
        for bad in [&json[..at], &format!("{}\u{1}{}", &json[..at], &json[at..])] {
            let err = Tokenizer::from_json(bad, None, None, None).unwrap_err().to_string();
            assert!(err.contains("malformed tokenizer.json: malformed JSON"), "{err}");
        }
        let dir = std::env::temp_dir().join(format!("forge-tok-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), &json[..at]).unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&dir).unwrap_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains("tokenizer.json") && err.contains("malformed JSON"), "{err}");
        assert!(Tokenizer::from_json(&json, None, None, None).is_ok());
    }
}
