//! Reading exports (ANEMLL Forge's layout, docs/export.md) into `Linear` layers.
//!
//! An export directory holds `forge.json` (plan, provenance, the source checkpoint), per-layer
//! safetensors of quantized matrices and optional `embed.safetensors`. Everything an export
//! does not hold (norms, conv, `A_log`, `dt_bias`, an unquantized matrix) comes from the source
//! checkpoint that `forge.json` records.

use crate::linear::{Linear, LowRank, Weight};
use anyhow::{anyhow, bail, Context, Result};
use forge_core::safetensors_dir::SafetensorsSet;
use forge_core::tensor::{DType, HostTensor};
use forge_kernels::lut::{Format, Int8Matrix, LutMatrix};
use forge_kernels::rotation::Rotation;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const MANIFEST: &str = "forge.json";

pub fn is_export(path: &Path) -> bool {
    path.is_dir() && path.join(MANIFEST).exists()
}

/// The file and key of a canonical matrix name.
pub fn file_and_key(canonical: &str) -> Option<(String, String)> {
    if canonical == "lm_head" {
        return Some(("lm_head.safetensors".into(), "lm_head".into()));
    }
    let rest = canonical.strip_prefix("layers.")?;
    let (l, key) = rest.split_once('.')?;
    let l: usize = l.parse().ok()?;
    let file = if key.starts_with("mlp.") {
        format!("layer_{l:02}.safetensors")
    } else if key.starts_with("self_attn.") || key.starts_with("linear_attn.") {
        format!("layer_{l:02}_mixer.safetensors")
    } else {
        return None;
    };
    Some((file, key.to_string()))
}

pub struct Export {
    pub dir: PathBuf,
    pub manifest: Value,
    files: HashMap<String, SafetensorsSet>,
    /// The compiled cache (`forge compile`), when present and built from these weights.
    compiled: Option<crate::compiled::Compiled>,
}

impl Export {
    pub fn open(dir: &Path) -> Result<Export> {
        let mpath = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&mpath).with_context(|| format!("{}: cannot read", mpath.display()))?;
        let manifest: Value =
            serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", mpath.display()))?;
        let mut ex = Self::open_partial(dir)?;
        ex.manifest = manifest;
        ex.compiled = crate::compiled::Compiled::open_for(&ex)?;
        Ok(ex)
    }

    /// The layer files of a directory without requiring `forge.json` (resuming a run).
    pub fn open_partial(dir: &Path) -> Result<Export> {
        let manifest = Value::Null;
        let mut files = HashMap::new();
        if !dir.exists() {
            return Ok(Export { dir: dir.to_path_buf(), manifest, files, compiled: None });
        }
        for e in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
            let p = e?.path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".safetensors") && !name.starts_with('.') {
                files.insert(name, SafetensorsSet::open_files(std::slice::from_ref(&p))?);
            }
        }
        Ok(Export { dir: dir.to_path_buf(), manifest, files, compiled: None })
    }

    /// The source checkpoint recorded in `forge.json` (a path, relative paths resolved against
    /// the export, or a short name such as `smollm2`).
    pub fn source(&self) -> Result<PathBuf> {
        let src = self.manifest["source"]["path"]
            .as_str()
            .ok_or_else(|| anyhow!("{}: missing string field 'source.path'", self.dir.join(MANIFEST).display()))?;
        if let Some(name) = self.manifest["source"]["name"].as_str() {
            if let Ok(p) = forge_core::hub::resolve_model(name, false) {
                return Ok(p);
            }
        }
        let p = Path::new(src);
        let p = if p.is_relative() { self.dir.join(p) } else { p.to_path_buf() };
        if !p.exists() {
            bail!("{}: source checkpoint '{src}' not found", self.dir.join(MANIFEST).display());
        }
        Ok(p)
    }

    /// FP16 embedding table, when the export stores one.
    pub fn embedding(&self) -> Result<Option<HostTensor>> {
        match self.files.get("embed.safetensors") {
            Some(set) => set.get("embed_tokens.weight"),
            None => Ok(None),
        }
    }

    /// Tensor `{key}.{suffix}` of `file` as f32, checked against `shape`.
    fn f32s(&self, file: &str, set: &SafetensorsSet, key: &str, suffix: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let ctx = || format!("{}: tensor '{key}.{suffix}'", self.dir.join(file).display());
        self.shaped(file, set, key, suffix, shape)?.to_f32_vec().with_context(ctx)
    }

    /// Tensor `key.suffix`, checked to have `shape`.
    fn shaped(&self, file: &str, set: &SafetensorsSet, key: &str, suffix: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self.tensor(file, set, &format!("{key}.{suffix}"))?;
        if t.shape != shape {
            bail!(
                "{}: tensor '{key}.{suffix}': has shape {:?}, expected {shape:?}",
                self.dir.join(file).display(),
                t.shape
            );
        }
        Ok(t)
    }

    fn tensor(&self, file: &str, set: &SafetensorsSet, name: &str) -> Result<HostTensor> {
        set.get(name)?.ok_or_else(|| anyhow!("{}: missing tensor '{name}'", self.dir.join(file).display()))
    }

    /// The export's safetensors files, sorted.
    pub fn file_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.files.keys().cloned().collect();
        v.sort();
        v
    }

    /// Whether a compiled cache is in use.
    pub fn is_compiled(&self) -> bool {
        self.compiled.is_some()
    }

    /// Bytes a load without the compiled cache allocates for the quantized matrices: their packed
    /// form (what [`DotMatrix::sizes`] gives for the layout each packs to; matrices off the
    /// integer grid, which take the float tiles, estimated at four bits an index) and the copy of
    /// each INT8 tensor the plain form holds. LUT indices stay in the file's mapping.
    ///
    /// [`DotMatrix::sizes`]: forge_kernels::lutmm::intdot::DotMatrix::sizes
    pub fn packing_bytes(&self) -> u64 {
        use forge_kernels::lutmm::intdot::DotMatrix;
        let Ok(matrices) = self.quantized_matrices() else { return 0 };
        let mut total = 0u64;
        for (file, key, cout, cin) in matrices {
            let int8 = self.files[&file].contains(&format!("{key}.int8"));
            let packed = match self.dot_layout(&file, &key, cout, cin) {
                Ok(Some(layout)) => DotMatrix::sizes(&layout).map_or(0, |(d, t, s)| (d + t + s) as u64),
                // Unreadable codebooks fail the load itself with their own error.
                _ => (cout * cin / 2) as u64,
            };
            total += packed + if int8 { (cout * cin) as u64 } else { 0 };
        }
        total
    }

    /// Every LUT/INT8 matrix: `(file, key, cout, cin)`, in file and key order.
    pub fn quantized_matrices(&self) -> Result<Vec<(String, String, usize, usize)>> {
        let mut out = Vec::new();
        for file in self.file_names() {
            let set = &self.files[&file];
            let mut keys: Vec<&str> = set.names().collect();
            keys.sort();
            for name in keys {
                let shape = set.shape(name).unwrap_or(&[]);
                if let Some(key) = name.strip_suffix(".idx") {
                    let d = set.shape(&format!("{key}.lut")).and_then(|s| s.get(1).copied()).unwrap_or(1);
                    if let [g, cin] = shape[..] {
                        out.push((file.clone(), key.to_string(), g * d, cin));
                    }
                } else if let Some(key) = name.strip_suffix(".int8") {
                    if let [cout, cin] = shape[..] {
                        out.push((file.clone(), key.to_string(), cout, cin));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The integer-dot layout matrix `key` of `file` packs to, if any (reads only its codebook).
    pub fn dot_layout(
        &self,
        file: &str,
        key: &str,
        out_f: usize,
        in_f: usize,
    ) -> Result<Option<forge_kernels::lutmm::intdot::DotLayout>> {
        use forge_kernels::lutmm::intdot::DotMatrix;
        let set = &self.files[file];
        if set.contains(&format!("{key}.int8")) {
            return Ok(DotMatrix::layout_for(Format::Int8, &[], out_f, in_f));
        }
        let lut = self.tensor(file, set, &format!("{key}.lut"))?;
        let format = self.lut_format(file, set, key, &lut)?;
        let cb = lut.to_f32_vec().with_context(|| format!("{}: tensor '{key}.lut'", self.dir.join(file).display()))?;
        Ok(DotMatrix::layout_for(format, &cb, out_f, in_f))
    }

    /// Matrix `key` of `file` read and packed for the kernels.
    pub fn packed(
        &self,
        file: &str,
        key: &str,
        out_f: usize,
        in_f: usize,
    ) -> Result<forge_kernels::lutmm::PackedMatrix> {
        use forge_kernels::lutmm::PackedMatrix;
        match self.weight(file, &self.files[file], key, out_f, in_f, false)? {
            Some(Weight::Lut(m)) => Ok(PackedMatrix::from_lut(&m)),
            Some(Weight::Int8(m)) => Ok(PackedMatrix::from_int8(&m)),
            _ => bail!("{}: '{key}' is not a LUT or INT8 matrix", self.dir.join(file).display()),
        }
    }

    fn lut_format(&self, file: &str, set: &SafetensorsSet, key: &str, lut: &HostTensor) -> Result<Format> {
        let path = self.dir.join(file);
        let ctx = |what: &str| format!("{}: tensor '{key}.{what}'", path.display());
        let [k, d] = lut.shape[..] else { bail!("{}: expected a (K, d) table, found {:?}", ctx("lut"), lut.shape) };
        let format = match set.metadata.get(&format!("{key}.format")) {
            Some(f) => Format::parse(f).with_context(|| format!("{}: metadata '{key}.format'", path.display()))?,
            None => match (k, d) {
                (16, 1) => Format::Lut4,
                (8, 1) => Format::Lut3,
                (4, 1) => Format::Lut2,
                (16, 2) => Format::Vec2x16,
                (64, 2) => Format::Vec2x64,
                _ => bail!("{}: a ({k}, {d}) table matches no known format", ctx("lut")),
            },
        };
        if format.entries() != k || format.vec_dim() != d {
            bail!("{}: shape ({k}, {d}) does not fit format {}", ctx("lut"), format.name());
        }
        Ok(format)
    }

    /// The stored weight of `key` (from the compiled cache when `cached` and present).
    fn weight(
        &self,
        file: &str,
        set: &SafetensorsSet,
        key: &str,
        out_f: usize,
        in_f: usize,
        cached: bool,
    ) -> Result<Option<Weight>> {
        if let (true, Some(c)) = (cached, &self.compiled) {
            if let Some(p) = c.matrix(file, key, out_f, in_f)? {
                return Ok(Some(Weight::Packed(Arc::new(p))));
            }
        }
        let path = self.dir.join(file);
        let has = |suffix: &str| set.contains(&format!("{key}.{suffix}"));
        let ctx = |what: &str| format!("{}: tensor '{key}.{what}'", path.display());
        let f32s = |suffix: &str, shape: &[usize]| self.f32s(file, set, key, suffix, shape);
        let weight = if has("lut") {
            let lut = self.tensor(file, set, &format!("{key}.lut"))?;
            let format = self.lut_format(file, set, key, &lut)?;
            let d = format.vec_dim();
            let idx_t = self.tensor(file, set, &format!("{key}.idx"))?;
            if idx_t.dtype() != DType::U8 || idx_t.shape != [out_f / d, in_f] {
                bail!(
                    "{}: expected U8 {:?}, found {} {:?}",
                    ctx("idx"),
                    [out_f / d, in_f],
                    idx_t.dtype().name(),
                    idx_t.shape
                );
            }
            let m = LutMatrix {
                format,
                cout: out_f,
                cin: in_f,
                codebook: lut.to_f32_vec().with_context(|| ctx("lut"))?,
                // The mapped bytes themselves: packing reads them once, and the page cache can
                // give them back, where a copy would sit beside the packed form for good.
                idx: idx_t.raw().cloned().ok_or_else(|| anyhow!("{}: not raw bytes", ctx("idx")))?,
                scale: f32s("scale", &[out_f])?,
            };
            m.validate().with_context(|| format!("{}: matrix '{key}'", path.display()))?;
            Weight::Lut(Arc::new(m))
        } else if has("int8") {
            let q = self.tensor(file, set, &format!("{key}.int8"))?;
            if q.dtype() != DType::I8 || q.shape != [out_f, in_f] {
                bail!("{}: expected I8 {:?}, found {} {:?}", ctx("int8"), [out_f, in_f], q.dtype().name(), q.shape);
            }
            let q: Vec<i8> = q.raw_bytes().unwrap_or_default().iter().map(|&b| b as i8).collect();
            Weight::Int8(Arc::new(Int8Matrix { cout: out_f, cin: in_f, q, scale: f32s("scale", &[out_f])? }))
        } else if has("weight") {
            let w = self.tensor(file, set, &format!("{key}.weight"))?;
            if w.shape != [out_f, in_f] {
                bail!("{}: has shape {:?}, expected {:?}", ctx("weight"), w.shape, [out_f, in_f]);
            }
            w.floats().with_context(|| ctx("weight"))?;
            Weight::Dense(w)
        } else {
            return Ok(None);
        };
        Ok(Some(weight))
    }

    /// The quantized linear layer `canonical` (`out_f × in_f`), if the export holds it.
    pub fn linear(&self, canonical: &str, out_f: usize, in_f: usize) -> Result<Option<Linear>> {
        let Some((file, key)) = file_and_key(canonical) else { return Ok(None) };
        let Some(set) = self.files.get(&file) else { return Ok(None) };
        let path = self.dir.join(&file);
        let has = |suffix: &str| set.contains(&format!("{key}.{suffix}"));
        let ctx = |what: &str| format!("{}: tensor '{key}.{what}'", path.display());
        let Some(weight) = self.weight(&file, set, &key, out_f, in_f, true)? else { return Ok(None) };
        let mut lin = Linear::with_weight(canonical, out_f, in_f, weight);
        if has("lr_a") || has("lr_b") {
            let a = self.tensor(&file, set, &format!("{key}.lr_a"))?;
            let r = *a.shape.get(1).ok_or_else(|| anyhow!("{}: expected (Cout, r)", ctx("lr_a")))?;
            let a = self.shaped(&file, set, &key, "lr_a", &[out_f, r])?;
            let b = self.shaped(&file, set, &key, "lr_b", &[r, in_f])?;
            let (fa, fb) = (a.floats().with_context(|| ctx("lr_a"))?, b.floats().with_context(|| ctx("lr_b"))?);
            lin.lowrank = Some(LowRank::from_stored(r, fa, fb));
        }
        lin.rotation = self.rotation(&file, set, &key, in_f)?;
        Ok(Some(lin))
    }

    /// Per-matrix rotation metadata, else ANEMLL Forge's file-level `basis`/`seed_in`/`seed_mid`/`block`.
    fn rotation(
        &self,
        file: &str,
        set: &SafetensorsSet,
        key: &str,
        dim: usize,
    ) -> Result<Option<Arc<dyn crate::linear::InputRotation>>> {
        let md = &set.metadata;
        let path = self.dir.join(file);
        let num = |k: &str| -> Result<Option<u64>> {
            md.get(k)
                .map(|v| v.parse::<u64>().with_context(|| format!("{}: metadata '{k}' = '{v}'", path.display())))
                .transpose()
        };
        let (seed, block) = if let Some(seed) = num(&format!("{key}.rotation_seed"))? {
            (seed, num(&format!("{key}.rotation_block"))?.map(|b| b as usize))
        } else if md.get("basis").map(|s| s.as_str()) == Some("online") && key.starts_with("mlp.") {
            let seed_key = if key == "mlp.down_proj" { "seed_mid" } else { "seed_in" };
            let seed = num(seed_key)?
                .ok_or_else(|| anyhow!("{}: basis is online but metadata '{seed_key}' is missing", path.display()))?;
            // The file-level block describes the gate/up input; down's input may need another.
            let block = match num("block")?.map(|b| b as usize) {
                Some(0) => bail!("{}: basis is online but metadata 'block' is 0", path.display()),
                Some(b) if dim.is_multiple_of(b) => Some(b),
                Some(b) if key != "mlp.down_proj" => {
                    bail!("{}: metadata 'block' = {b} does not divide the input size {dim} of '{key}'", path.display())
                }
                _ => None,
            };
            (seed, block)
        } else {
            return Ok(None);
        };
        let rot = match block {
            Some(b) => Rotation::with_block(dim, b, seed)
                .with_context(|| format!("{}: rotation of '{key}'", path.display()))?,
            None => Rotation::new(dim, seed),
        };
        Ok(Some(Arc::new(rot)))
    }
}
