//! The compiled cache: an export's LUT/INT8 matrices in the integer-dot kernel layout, stored
//! next to the export (`packed.forgecache`) and memory-mapped at load, so a model starts without
//! re-packing and without holding the plain one-byte-per-index form in memory (the CPU
//! counterpart of ANEMLL Forge's compiled ANE package).
//!
//! The file is a safetensors file: per matrix `{file}/{key}` three tensors — `.data` (U8, the
//! packed index rows plus 16 bytes of slack), `.tables` (I8, 16 bytes per lookup table) and
//! `.scale` (F32, per output row: row scale × codebook factor) — and metadata `{name}.layout`
//! (`kind cout cin`), the cache `version` and the export's `fingerprint`: a SHA-256 over
//! `forge.json` and, per export file, its name, size, safetensors header and 64 sampled 4 KiB
//! blocks. A cache whose fingerprint does not match is ignored (with a warning) and rebuilt by
//! `forge compile --force`. Matrices whose codebooks are not on the 8-bit grid keep the float
//! tile kernels and are packed at load; they are not in the cache.

use crate::export::Export;
use anyhow::{anyhow, bail, Context, Result};
use forge_kernels::lutmm::intdot::{Blob, DotLayout, DotMatrix};
use forge_kernels::lutmm::PackedMatrix;
use memmap2::Mmap;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

pub const CACHE_FILE: &str = "packed.forgecache";
/// The cache format's version; a cache of another version is ignored, as a stale one is. This
/// one holds 16 bytes of slack after each matrix's index rows, every LUT kind with integer-dot
/// kernels (lut2 and lut3 included) in the integer-dot layout and, where the AVX-512 kernels
/// run, every grouped kind in its groups (`intdot::group_field`), as [`LAYOUTS`] records.
const VERSION: &str = "6";

/// The metadata entry naming the LUT matrices' index layouts: the AVX-512 kernels' own
/// (`avx512`) or the plain ones the other kernels read.
const LAYOUTS: &str = "index_layouts";

fn layouts_here() -> &'static str {
    if forge_kernels::lutmm::intdot::six_bit_layout() {
        "avx512"
    } else {
        "plain"
    }
}
/// Data starts on this boundary (the header is padded with spaces, as safetensors allows).
const ALIGN: usize = 64;

/// A loaded cache: matrix name (`{file}/{key}`) → packed matrix over the mapped file.
pub struct Compiled {
    map: Arc<Mmap>,
    data_start: usize,
    entries: HashMap<String, Value>,
    metadata: HashMap<String, String>,
}

/// The export's fingerprint (see the module docs).
pub fn fingerprint(ex: &Export) -> Result<String> {
    let mut h = Sha256::new();
    let manifest = ex.dir.join(crate::export::MANIFEST);
    h.update(std::fs::read(&manifest).with_context(|| format!("{}: cannot read", manifest.display()))?);
    for name in ex.file_names() {
        let path = ex.dir.join(&name);
        let mut f = std::fs::File::open(&path).with_context(|| format!("{}: cannot open", path.display()))?;
        let size = f.metadata()?.len();
        h.update(name.as_bytes());
        h.update(size.to_le_bytes());
        let mut n = [0u8; 8];
        f.read_exact(&mut n).with_context(|| format!("{}: truncated", path.display()))?;
        let hlen = u64::from_le_bytes(n).min(size.saturating_sub(8));
        let mut header = vec![0u8; hlen as usize];
        f.read_exact(&mut header).with_context(|| format!("{}: truncated header", path.display()))?;
        h.update(&header);
        let mut block = vec![0u8; 4096];
        for i in 0..64u64 {
            let at = (size.saturating_sub(4096)) * i / 63;
            f.seek(SeekFrom::Start(at))?;
            let n = f.read(&mut block)?;
            h.update(&block[..n]);
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

impl Compiled {
    /// The cache of export `ex`, if present and built from these weights; a stale or unreadable
    /// cache is reported on stderr and ignored.
    pub fn open_for(ex: &Export) -> Result<Option<Compiled>> {
        let path = ex.dir.join(CACHE_FILE);
        match Self::current(ex)? {
            Ok(c) => Ok(Some(c)),
            Err(None) => Ok(None),
            Err(Some(why)) => {
                eprintln!("warning: ignoring {}: {why} (rebuild it with `forge compile`)", path.display());
                Ok(None)
            }
        }
    }

    /// The export's cache if it is current; else why not (`None`: there is none).
    fn current(ex: &Export) -> Result<std::result::Result<Compiled, Option<String>>> {
        let path = ex.dir.join(CACHE_FILE);
        if !path.exists() {
            return Ok(Err(None));
        }
        let c = match Compiled::open(&path) {
            Ok(c) => c,
            Err(e) => return Ok(Err(Some(format!("{e:#}")))),
        };
        if c.metadata.get("version").map(String::as_str) != Some(VERSION) {
            return Ok(Err(Some(format!(
                "it has the layout of another Forge version (cache version {VERSION} expected)"
            ))));
        }
        if c.metadata.get("fingerprint") != Some(&fingerprint(ex)?) {
            return Ok(Err(Some("it was compiled from other weights".into())));
        }
        // A cache without the entry cannot say how to read its matrices.
        let here = layouts_here();
        match c.metadata.get(LAYOUTS) {
            Some(l) if l == here => Ok(Ok(c)),
            Some(l) => Ok(Err(Some(format!(
                "its LUT matrices are in the {l} layout, and this CPU's kernels take the {here} layout"
            )))),
            None => Ok(Err(Some(format!("its metadata does not name its index layouts ('{LAYOUTS}')")))),
        }
    }

    /// Parse a cache file (header and bounds only; data stays mapped).
    pub fn open(path: &Path) -> Result<Compiled> {
        let f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        // Read-only; the cache is written atomically (temp file + rename), so the mapped bytes
        // change only if someone edits the file in place, which Forge never does.
        let map =
            forge_core::safetensors_dir::map_file(&f).with_context(|| format!("{}: cannot map", path.display()))?;
        if map.len() < 8 {
            bail!("{}: truncated (no header)", path.display());
        }
        let hlen = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
        if hlen > map.len() - 8 {
            bail!("{}: header of {hlen} bytes runs past the end of the file", path.display());
        }
        let header: Map<String, Value> = serde_json::from_slice(&map[8..8 + hlen])
            .with_context(|| format!("{}: malformed header", path.display()))?;
        let data_start = 8 + hlen;
        let mut metadata = HashMap::new();
        let mut entries = HashMap::new();
        for (k, v) in header {
            if k == "__metadata__" {
                for (mk, mv) in v.as_object().into_iter().flatten() {
                    metadata.insert(mk.clone(), mv.as_str().unwrap_or_default().to_string());
                }
                continue;
            }
            let off = v["data_offsets"].as_array().filter(|a| a.len() == 2);
            let (a, b) = match off.map(|a| (a[0].as_u64(), a[1].as_u64())) {
                Some((Some(a), Some(b))) if a <= b && data_start + b as usize <= map.len() => (a, b),
                _ => bail!("{}: tensor '{k}' has bad or out-of-file data_offsets", path.display()),
            };
            entries.insert(k, json!([a, b, v["dtype"].clone()]));
        }
        Ok(Compiled { map: Arc::new(map), data_start, entries, metadata })
    }

    fn range(&self, name: &str, dtype: &str) -> Result<(usize, usize)> {
        let e = self.entries.get(name).ok_or_else(|| anyhow!("missing tensor '{name}'"))?;
        if e[2].as_str() != Some(dtype) {
            bail!("tensor '{name}' is {}, expected {dtype}", e[2]);
        }
        Ok((self.data_start + e[0].as_u64().unwrap() as usize, self.data_start + e[1].as_u64().unwrap() as usize))
    }

    /// The packed matrix `{file}/{key}`, if the cache holds it; its shape must be `out_f × in_f`.
    pub fn matrix(&self, file: &str, key: &str, out_f: usize, in_f: usize) -> Result<Option<PackedMatrix>> {
        let name = format!("{file}/{key}");
        let Some(layout) = self.metadata.get(&format!("{name}.layout")) else { return Ok(None) };
        let ctx = || format!("{CACHE_FILE}: matrix '{name}'");
        let parts: Vec<&str> = layout.split_whitespace().collect();
        let (kind, cout, cin) = match parts[..] {
            [k, o, i] => (k, o.parse::<usize>().ok(), i.parse::<usize>().ok()),
            _ => bail!("{}: malformed layout '{layout}'", ctx()),
        };
        let (Some(cout), Some(cin)) = (cout, cin) else { bail!("{}: malformed layout '{layout}'", ctx()) };
        if (cout, cin) != (out_f, in_f) {
            bail!("{}: cached as {cout}×{cin}, the model needs {out_f}×{in_f}", ctx());
        }
        let (d0, d1) = self.range(&format!("{name}.data"), "U8").with_context(ctx)?;
        let (t0, t1) = self.range(&format!("{name}.tables"), "I8").with_context(ctx)?;
        let (s0, s1) = self.range(&format!("{name}.scale"), "F32").with_context(ctx)?;
        let tables: Vec<i8> = self.map[t0..t1].iter().map(|&b| b as i8).collect();
        let scale: Vec<f32> =
            self.map[s0..s1].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let src: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        let blob = Blob::Shared { src, offset: d0, len: d1 - d0 };
        // The AVX-512 layouts of every kind but INT8 go together (one metadata entry).
        let six = self.metadata.get(LAYOUTS).map(String::as_str) == Some("avx512");
        let dl = DotLayout::cached(kind, cout, cin, six);
        let d = DotMatrix::from_parts(&dl, blob, &tables, scale).with_context(ctx)?;
        let format = forge_kernels::lut::Format::parse(kind).with_context(ctx)?;
        Ok(Some(PackedMatrix::from_dot(format, d)))
    }

    /// Number of cached matrices.
    pub fn len(&self) -> usize {
        self.metadata.keys().filter(|k| k.ends_with(".layout")).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What `compile` did.
pub struct CompileReport {
    pub matrices: usize,
    /// Matrices left to the float tile kernels (lut2/lut3, or a codebook off the 8-bit grid).
    pub tiles: usize,
    pub bytes: u64,
    pub reused: bool,
}

/// Build (or, unless `force`, reuse) the compiled cache of the export at `dir`, one matrix at a
/// time so that memory stays at one matrix's plain and packed forms. `progress(done, total)`.
pub fn compile(dir: &Path, force: bool, progress: &dyn Fn(usize, usize)) -> Result<CompileReport> {
    let ex = Export::open(dir)?;
    let path = dir.join(CACHE_FILE);
    if !force {
        // A stale or damaged cache is simply rebuilt.
        if let Ok(c) = Compiled::current(&ex)? {
            let bytes = std::fs::metadata(&path)?.len();
            return Ok(CompileReport { matrices: c.len(), tiles: 0, bytes, reused: true });
        }
    }
    let fp = fingerprint(&ex)?;
    let names = ex.quantized_matrices()?;
    // Pass 1: which matrices take the integer-dot layout, and their sizes (codebooks only).
    let mut header = Map::new();
    let mut meta = Map::new();
    meta.insert("version".into(), VERSION.into());
    meta.insert(LAYOUTS.into(), layouts_here().into());
    meta.insert("fingerprint".into(), fp.into());
    meta.insert("format".into(), "forge packed cache (integer-dot layout)".into());
    let mut plan = Vec::new();
    let mut offset = 0u64;
    let mut tiles = 0;
    for (file, key, cout, cin) in &names {
        let Some(layout) = ex.dot_layout(file, key, *cout, *cin)? else {
            tiles += 1;
            continue;
        };
        let name = format!("{file}/{key}");
        let sizes = DotMatrix::sizes(&layout)?;
        for (suffix, dtype, n) in [("data", "U8", sizes.0), ("tables", "I8", sizes.1), ("scale", "F32", sizes.2)] {
            let end = offset + n as u64;
            header.insert(
                format!("{name}.{suffix}"),
                json!({"dtype": dtype, "shape": [n / dtype_size(dtype)], "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        meta.insert(format!("{name}.layout"), format!("{} {} {}", layout.kind, layout.cout, layout.cin).into());
        plan.push((file.clone(), key.clone(), *cout, *cin, sizes));
    }
    header.insert("__metadata__".into(), Value::Object(meta));
    let mut hbytes = serde_json::to_vec(&Value::Object(header))?;
    while (8 + hbytes.len()) % ALIGN != 0 {
        hbytes.push(b' ');
    }
    // Pass 2: pack and stream each matrix.
    let total = plan.len();
    forge_core::fsutil::write_atomic_with(&path, |w: &mut dyn Write| {
        w.write_all(&(hbytes.len() as u64).to_le_bytes())?;
        w.write_all(&hbytes)?;
        for (i, (file, key, cout, cin, sizes)) in plan.iter().enumerate() {
            let p = ex.packed(file, key, *cout, *cin)?;
            let d = p.as_dot().ok_or_else(|| anyhow!("{file}: '{key}' did not pack to the integer-dot layout"))?;
            let (_, data, tables, scale) = d.parts();
            if (data.len(), tables.len(), 4 * scale.len()) != *sizes {
                bail!("{file}: '{key}' packed to unexpected sizes");
            }
            w.write_all(data)?;
            w.write_all(&tables.iter().map(|&b| b as u8).collect::<Vec<_>>())?;
            let sb: Vec<u8> = scale.iter().flat_map(|s| s.to_le_bytes()).collect();
            w.write_all(&sb)?;
            progress(i + 1, total);
        }
        Ok(())
    })?;
    let bytes = std::fs::metadata(&path)?.len();
    Ok(CompileReport { matrices: total, tiles, bytes, reused: false })
}

fn dtype_size(dtype: &str) -> usize {
    if dtype == "F32" {
        4
    } else {
        1
    }
}
