//! Memory-mapped safetensors checkpoints: one file, a sharded set with
//! `model.safetensors.index.json`, or every `*.safetensors` in a directory.

use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A set of safetensors files seen as one name → tensor map.
pub struct SafetensorsSet {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: BTreeMap<String, Entry>,
    /// Metadata (`__metadata__`) of each file, merged.
    pub metadata: HashMap<String, String>,
}

impl SafetensorsSet {
    /// Open the weights of a Hugging Face model directory.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).with_context(|| format!("{}: cannot read", index.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", index.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{}: missing object field 'weight_map'", index.display()))?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, f) in map {
                let f = f
                    .as_str()
                    .ok_or_else(|| anyhow!("{}: weight_map entry for '{tensor}' is not a string", index.display()))?;
                if f.contains('/') || f.contains("..") {
                    bail!("{}: weight_map entry '{f}' is not a plain file name", index.display());
                }
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
            }
            names.sort();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("{}: cannot list directory", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            v.sort();
            if v.is_empty() {
                bail!("{}: no model.safetensors, index or *.safetensors files", dir.display());
            }
            v
        };
        Self::open_files(&files)
    }

    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut set = SafetensorsSet { files: Vec::new(), entries: BTreeMap::new(), metadata: HashMap::new() };
        for path in paths {
            let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
            let map = map_file(&file).with_context(|| format!("{}: cannot memory-map", path.display()))?;
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| match e {
                safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                    anyhow!("{}: {}", path.display(), describe_truncation(&map))
                }
                e => anyhow!("{}: malformed safetensors header: {e:?}", path.display()),
            })?;
            let data_start = 8 + n;
            let idx = set.files.len();
            if let Some(m) = meta.metadata() {
                for (k, v) in m {
                    set.metadata.insert(k.clone(), v.clone());
                }
            }
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                let (start, end) = (data_start + s, data_start + e);
                if end > map.len() || start > end {
                    bail!(
                        "{}: tensor '{name}' data range {start}..{end} exceeds the file size {} (truncated file?)",
                        path.display(),
                        map.len()
                    );
                }
                set.entries.insert(
                    name.clone(),
                    Entry { file: idx, dtype: info.dtype, shape: info.shape.clone(), start, end },
                );
            }
            set.files.push((path.clone(), Arc::new(map)));
        }
        Ok(set)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The stored dtype, shape and bytes of `name` (copying a tensor without converting it).
    pub fn raw(&self, name: &str) -> Option<(Dtype, &[usize], &[u8])> {
        let e = self.entries.get(name)?;
        Some((e.dtype, e.shape.as_slice(), &self.files[e.file].1[e.start..e.end]))
    }

    /// The file holding `name` (for error messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries.get(name).map(|e| self.files[e.file].0.as_path())
    }

    /// Tell the OS that `name` is read at random places (an embedding table: one row per
    /// token). A page fault in a mapping otherwise reads ahead around the page, as much as
    /// the device's read-ahead (8 MiB on this project's test machines): a row of the 27B
    /// shape's table not yet in the page cache costs ~7 ms that way, ~0.45 ms with this.
    /// Advice only: an OS that declines it changes nothing but speed.
    pub fn advise_random(&self, name: &str) {
        #[cfg(unix)]
        if let Some(e) = self.entries.get(name) {
            let _ = self.files[e.file].1.advise_range(memmap2::Advice::Random, e.start, e.end - e.start);
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    /// The tensor `name`, borrowed from the mapping.
    pub fn get(&self, name: &str) -> Result<Option<HostTensor>> {
        let Some(e) = self.entries.get(name) else {
            return Ok(None);
        };
        let (path, map) = &self.files[e.file];
        let dtype = match e.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::I8 => DType::I8,
            Dtype::U8 => DType::U8,
            Dtype::I32 => DType::I32,
            Dtype::I64 => DType::I64,
            other => bail!("{}: tensor '{name}' has unsupported dtype {other:?}", path.display()),
        };
        let bytes = Bytes::new(map.clone(), e.start, e.end - e.start);
        HostTensor::from_raw(e.shape.clone(), dtype, bytes)
            .with_context(|| format!("{}: tensor '{name}'", path.display()))
            .map(Some)
    }
}

/// Name the first tensor whose data lies past the end of a truncated file.
fn describe_truncation(buf: &[u8]) -> String {
    let n = buf.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize).unwrap_or(0);
    let header = buf.get(8..8usize.saturating_add(n)).and_then(|h| serde_json::from_slice::<serde_json::Value>(h).ok());
    if let Some(serde_json::Value::Object(m)) = header {
        for (name, info) in &m {
            let end = info.get("data_offsets").and_then(|o| o.get(1)).and_then(|e| e.as_u64()).unwrap_or(0) as usize;
            if 8 + n + end > buf.len() {
                return format!(
                    "tensor '{name}' ends at byte {} but the file has {} bytes (truncated file?)",
                    8 + n + end,
                    buf.len()
                );
            }
        }
    }
    format!("the header describes more data than the file's {} bytes (truncated file?)", buf.len())
}

/// Map a file read-only (also used for Forge's compiled caches).
pub fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only; the usual caveat of mmap (the file changing underneath)
    // applies to every loader of this kind and is documented for users.
    unsafe { Mmap::map(file) }
}
