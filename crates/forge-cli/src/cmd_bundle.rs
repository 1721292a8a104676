//! `forge bundle` and `forge verify`: a self-contained, verifiable directory holding a model
//! (an export with the parts of its source checkpoint it needs, or a checkpoint), optionally a
//! drafter, provenance notes and `release.json` (see `forge_core::release`).

use anyhow::{bail, Context, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::release::{self, Depth, Release};
use forge_model::export::{is_export, Export, MANIFEST};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct BundleArgs {
    /// The model: a Forge export (from `forge quantize`), a Hugging Face directory, a GGUF file or a
    /// short name (smollm2).
    model: PathBuf,
    /// The bundle directory to create (must not exist).
    #[arg(long)]
    out: PathBuf,
    /// A drafter for speculative decoding (same tokenizer as the model), bundled under drafter/.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// A quality report to record (the JSON of `forge eval kl --json-out FILE`).
    #[arg(long)]
    quality: Option<PathBuf>,
    /// Include the export's compiled kernel cache (packed.forgecache; `forge compile`).
    #[arg(long)]
    compiled: bool,
    /// The bundle's name in release.json (default: the directory's name).
    #[arg(long)]
    name: Option<String>,
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// The bundle directory (holds release.json).
    dir: PathBuf,
    /// Hash every byte (default: check presence and sizes only).
    #[arg(long)]
    full: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run_bundle(mut a: BundleArgs) -> Result<()> {
    // Short names (smollm2) and bundles resolve as every --model does.
    a.model = resolve(&a.model.to_string_lossy())?;
    if let Some(d) = &a.draft {
        a.draft = Some(resolve(&d.to_string_lossy())?);
    }
    if a.out.exists() {
        bail!("{}: already exists; bundles are written to a new directory", a.out.display());
    }
    let name = match &a.name {
        Some(n) => n.clone(),
        None => a.out.file_name().map(|n| n.to_string_lossy().into_owned()).context("--out has no directory name")?,
    };
    // Built beside the destination and renamed into place at the end: no partial bundle ever
    // carries the final name.
    let parent = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("{}: cannot create", parent.display()))?;
    let stage = parent.join(format!(".{name}.partial"));
    if stage.exists() {
        std::fs::remove_dir_all(&stage)
            .with_context(|| format!("{}: cannot remove a stale partial bundle", stage.display()))?;
    }
    let result = (|| -> Result<()> {
        let quality = match &a.quality {
            Some(p) => serde_json::from_slice::<Value>(
                &std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()))?,
            )
            .with_context(|| format!("{}: malformed JSON", p.display()))?,
            None => Value::Null,
        };
        let (model, identity) = place(&a.model, &stage.join("model"), a.compiled)?;
        let (drafter, pairing) = match &a.draft {
            Some(d) => {
                let (path, id) = place(d, &stage.join("drafter"), a.compiled)?;
                let t = tokenizer_fingerprint(&a.model)?;
                let dt = tokenizer_fingerprint(d)?;
                if t.sha256 != dt.sha256 {
                    bail!(
                        "--draft {}: its tokenizer differs from the model's ({} tokens, specials {:?} against {} tokens, specials {:?}); a drafter must share the target's vocabulary",
                        d.display(), dt.vocab, dt.specials, t.vocab, t.specials
                    );
                }
                (Some(path), json!({"tokenizer_sha256": t.sha256, "drafter": id}))
            }
            None => (None, json!({"tokenizer_sha256": tokenizer_fingerprint(&a.model)?.sha256})),
        };
        write_notice(&stage, &name, &identity)?;
        let files = release::list_files(&stage)?;
        let total: u64 = files.iter().map(|f| std::fs::metadata(stage.join(f)).map_or(0, |m| m.len())).sum();
        let bar = bytes_bar(total, "hashing");
        let entries = release::inventory(&stage, &files, &mut |n| bar.inc(n))?;
        bar.finish_and_clear();
        let mut identity = identity;
        checkpoint_hashes(&mut identity, "model", &entries);
        let mut pairing = pairing;
        if let Some(d) = pairing.get_mut("drafter") {
            checkpoint_hashes(d, "drafter", &entries);
        }
        let rel = Release {
            format: release::FORMAT.into(),
            forge_version: env!("CARGO_PKG_VERSION").into(),
            name: name.clone(),
            model,
            drafter,
            identity,
            pairing,
            quality,
            files: entries,
        };
        forge_core::fsutil::write_atomic(&stage.join(release::RELEASE_FILE), rel.to_json().as_bytes())?;
        release::mark_verified(&stage, &rel)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&stage);
        return Err(e);
    }
    std::fs::rename(&stage, &a.out).with_context(|| format!("{}: cannot rename into place", a.out.display()))?;
    let rel = Release::read(&a.out)?;
    println!(
        "bundle {}: {} files, {:.1} MB; model {}{}",
        a.out.display(),
        rel.files.len(),
        rel.total_bytes() as f64 / 1e6,
        rel.model,
        rel.drafter.as_deref().map(|d| format!(", drafter {d}")).unwrap_or_default()
    );
    Ok(())
}

/// Copy a model into `dest` and return the path release.json records for it (relative to the
/// bundle's root) and its identity. An export takes the parts of its source checkpoint it needs
/// under `dest/source/`, and its forge.json is rewritten to point there.
fn place(model: &Path, dest: &Path, compiled: bool) -> Result<(String, Value)> {
    let role = dest.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::create_dir_all(dest).with_context(|| format!("{}: cannot create", dest.display()))?;
    if is_export(model) {
        let ex = Export::open(model)?;
        let src = ex.source()?;
        let mut manifest = ex.manifest.clone();
        for f in ex.file_names() {
            copy(&model.join(&f), &dest.join(&f))?;
        }
        let cache = model.join(forge_model::compiled::CACHE_FILE);
        if compiled && cache.exists() {
            copy(&cache, &dest.join(forge_model::compiled::CACHE_FILE))?;
        }
        let src_rel = place_source(&src, &ex, &dest.join("source"))?;
        let source = manifest["source"].as_object_mut().context("forge.json: 'source' is not an object")?;
        source.remove("name");
        source.insert("path".into(), Value::String(src_rel));
        let text = serde_json::to_string_pretty(&manifest)? + "\n";
        forge_core::fsutil::write_atomic(&dest.join(MANIFEST), text.as_bytes())?;
        let identity = json!({
            "kind": "export",
            "source": ex.manifest["source"],
            "method": ex.manifest["method"],
            "seed": ex.manifest["seed"],
            "recipe": {"plan": ex.manifest["plan"], "rotation": ex.manifest["rotation"], "lowrank": ex.manifest["lowrank"]},
            "forge_json_sha256": release::sha256_bytes(text.as_bytes()),
        });
        return Ok((role, identity));
    }
    if model.is_dir() {
        for f in release::list_files(model)? {
            copy(&model.join(&f), &dest.join(&f))?;
        }
        // Its files' hashes come from the inventory (see `checkpoint_hashes`): hashed once.
        return Ok((role, json!({"kind": "checkpoint"})));
    }
    let file = model.file_name().context("model path has no file name")?.to_string_lossy().into_owned();
    copy(model, &dest.join(&file))?;
    Ok((format!("{role}/{file}"), json!({"kind": "checkpoint", "file": file})))
}

/// What an export needs of its source: a GGUF whole (its tokenizer and template live in its
/// metadata); of a Hugging Face directory every file but the weights, plus one safetensors
/// file with the tensors the export does not replace (norms, biases, convs, the embedding),
/// so a 27B checkpoint's quantized matrices are not carried twice. Returns the path forge.json
/// records, relative to the export.
fn place_source(src: &Path, ex: &Export, dest: &Path) -> Result<String> {
    std::fs::create_dir_all(dest).with_context(|| format!("{}: cannot create", dest.display()))?;
    if !src.is_dir() {
        let file = src.file_name().context("source path has no file name")?.to_string_lossy().into_owned();
        copy(src, &dest.join(&file))?;
        return Ok(format!("source/{file}"));
    }
    for f in release::list_files(src)? {
        let weights = f.ends_with(".safetensors") || f == "model.safetensors.index.json";
        if !weights && !f.contains('/') {
            copy(&src.join(&f), &dest.join(&f))?;
        }
    }
    let (ck, _) = Checkpoint::open(src)?;
    let Checkpoint::Hf { set, .. } = &ck else { unreachable!("a directory opens as a Hugging Face checkpoint") };
    let mut replaced: std::collections::HashSet<String> = ex.manifest["matrices"]
        .as_object()
        .map(|m| m.keys().map(|k| ck.stored_name(&format!("{k}.weight"))).collect())
        .unwrap_or_default();
    if ex.embedding()?.is_some() {
        replaced.insert(ck.stored_name("embed_tokens.weight"));
    }
    let keep: Vec<&str> = set.names().filter(|n| !replaced.contains(*n)).collect();
    let mut specs = Vec::new();
    for n in &keep {
        let (dtype, shape, _) = set.raw(n).expect("listed");
        use safetensors::tensor::Dtype as D;
        if !matches!(dtype, D::F32 | D::F16 | D::BF16 | D::U8 | D::I8) {
            bail!("{}: tensor '{n}' has dtype {dtype:?}, which bundles do not copy", src.display());
        }
        specs.push(forge_quant::export::TensorSpec { name: n.to_string(), dtype, shape: shape.to_vec() });
    }
    let meta = std::collections::BTreeMap::from([("format".to_string(), "pt".to_string())]);
    forge_quant::export::write_streaming(&dest.join("model.safetensors"), &specs, &meta, |i, w| {
        w.write_all(set.raw(&specs[i].name).expect("listed").2)?;
        Ok(())
    })?;
    Ok("source".into())
}

/// A bundled checkpoint's identity takes its files' SHA-256 from the inventory (relative to
/// its directory `role`), rather than hashing them a second time.
fn checkpoint_hashes(identity: &mut Value, role: &str, entries: &[release::FileEntry]) {
    if identity["kind"] != "checkpoint" {
        return;
    }
    let prefix = format!("{role}/");
    let hashes: serde_json::Map<String, Value> = entries
        .iter()
        .filter_map(|e| e.path.strip_prefix(&prefix).map(|p| (p.to_string(), Value::String(e.sha256.clone()))))
        .collect();
    identity["sha256"] = Value::Object(hashes);
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    if let Some(d) = to.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("{}: cannot create", d.display()))?;
    }
    std::fs::copy(from, to).with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// NOTICE.md: where the weights come from and how they were made; the source's own licence
/// files travel with it under source/.
fn write_notice(stage: &Path, name: &str, identity: &Value) -> Result<()> {
    let src = &identity["source"];
    let origin = src["path"].as_str().or(identity["file"].as_str()).unwrap_or("(see release.json)");
    let text = format!(
        "# {name}\n\nA Forge bundle (Forge {}). `release.json` lists every file with its size and SHA-256;\n\
         `forge verify {name} --full` checks them.\n\n\
         - Model weights: derived from `{origin}` (SHA-256 in release.json, `identity`). Their licence is the\n  \
         source model's; licence files that came with the source are under `model/source/`.\n\
         - Method: {} (seed {}); the recipe is recorded in `model/forge.json` and release.json.\n\
         - No endorsement by the source model's authors is implied.\n",
        env!("CARGO_PKG_VERSION"),
        identity["method"].as_str().unwrap_or("none (original weights)"),
        identity["seed"],
    );
    forge_core::fsutil::write_atomic(&stage.join("NOTICE.md"), text.as_bytes())
}

pub(crate) struct Fingerprint {
    pub sha256: String,
    pub vocab: usize,
    pub specials: Vec<u32>,
}

/// The tokenizer's identity: every id's token string and the special ids, hashed.
pub(crate) fn tokenizer_fingerprint(model: &Path) -> Result<Fingerprint> {
    let path = if is_export(model) { Export::open(model)?.source()? } else { model.to_path_buf() };
    let (ck, _) = Checkpoint::open(&path)?;
    let tok = match forge_model::load::load_tokenizer(&ck) {
        Ok(t) => t,
        // Test checkpoints carry no tokenizer: their identity is their vocabulary size alone.
        Err(_) => {
            let (_, cfg) = Checkpoint::open(&path)?;
            let s = format!("vocab:{}", cfg.vocab_size);
            return Ok(Fingerprint {
                sha256: release::sha256_bytes(s.as_bytes()),
                vocab: cfg.vocab_size,
                specials: vec![],
            });
        }
    };
    let mut s = String::new();
    for id in 0..tok.vocab_size() as u32 {
        s.push_str(&tok.id_to_token(id).unwrap_or_default());
        s.push('\n');
    }
    let mut specials: Vec<u32> = tok.stop_ids().to_vec();
    specials.extend(tok.bos_id());
    specials.sort_unstable();
    specials.dedup();
    s.push_str(&format!("{specials:?}"));
    Ok(Fingerprint { sha256: release::sha256_bytes(s.as_bytes()), vocab: tok.vocab_size(), specials })
}

fn bytes_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    if total < (64 << 20) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar
}

pub fn run_verify(a: VerifyArgs) -> Result<()> {
    let rel = Release::read(&a.dir)?;
    let bar = bytes_bar(if a.full { rel.total_bytes() } else { 0 }, "verifying");
    let r = release::verify(&a.dir, &rel, if a.full { Depth::Full } else { Depth::Sizes }, &mut |n| bar.inc(n))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json!({"ok": r.ok(), "hashed": r.hashed, "report": r}))?);
    } else if r.ok() {
        println!(
            "{}: OK, {} files, {:.1} MB ({})",
            a.dir.display(),
            rel.files.len(),
            rel.total_bytes() as f64 / 1e6,
            if r.hashed { "every SHA-256 checked" } else { "sizes checked; --full checks every byte" }
        );
    } else {
        for p in r.problems(&a.dir) {
            println!("{p}");
        }
    }
    if !r.ok() {
        bail!("{}: {} problem(s) against release.json", a.dir.display(), r.problems(&a.dir).len());
    }
    Ok(())
}

/// The paths a `--model` argument resolves to, with the bundle check unless `--no-verify`.
pub fn resolve(arg: &str) -> Result<PathBuf> {
    forge_core::hub::resolve_model_with(arg, true, !crate::no_verify())
}
