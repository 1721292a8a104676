//! Memory-mapped safetensors checkpoints: one file, a sharded set with
//! `model.safetensors.index.json`, or every `*.safetensors` in a directory.

use crate::backing::Backing;
use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorInfo};
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

impl AsRef<[u8]> for Backing {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A set of safetensors files seen as one name → tensor map.
pub struct SafetensorsSet {
    files: Vec<(PathBuf, Arc<Backing>)>,
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
        let mut set = SafetensorsSet::empty();
        for path in paths {
            let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
            let map = map_file(&file).with_context(|| format!("{}: cannot memory-map", path.display()))?;
            set.add(path, Backing::Map(map))?;
        }
        Ok(set)
    }

    /// One safetensors file already in memory; `path` only names it in messages.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let mut set = SafetensorsSet::empty();
        set.add(path, Backing::Owned(bytes))?;
        Ok(set)
    }

    fn empty() -> Self {
        SafetensorsSet { files: Vec::new(), entries: BTreeMap::new(), metadata: HashMap::new() }
    }

    fn add(&mut self, path: &Path, data: Backing) -> Result<()> {
        let header = parse_header(&data).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let idx = self.files.len();
        if let Some(m) = header.metadata {
            self.metadata.extend(m);
        }
        for (name, info) in header.tensors {
            let (start, end) = (header.data_start + info.data_offsets.0, header.data_start + info.data_offsets.1);
            self.entries.insert(name, Entry { file: idx, dtype: info.dtype, shape: info.shape, start, end });
        }
        self.files.push((path.to_path_buf(), Arc::new(data)));
        Ok(())
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
            if let Backing::Map(m) = &*self.files[e.file].1 {
                let _ = m.advise_range(memmap2::Advice::Random, e.start, e.end - e.start);
            }
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    /// Give back the resident pages of `name`'s bytes: a run that streams through a checkpoint
    /// larger than memory (`forge quantize`) calls this once a tensor is done with, so that its
    /// resident set stays at the tensors in use instead of every page it ever read. Borrows of
    /// the tensor stay valid: a later read faults the same bytes back in from the file.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some(e) = self.entries.get(name) {
            if let Backing::Map(m) = &*self.files[e.file].1 {
                // SAFETY: the mapping is a read-only private map of a file that this process never
                // writes, so no page of it holds data of its own: MADV_DONTNEED only drops the
                // resident copies, and the next access reads the same file bytes again.
                let _ =
                    unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, e.start, e.end - e.start) };
            }
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

/// A header's JSON larger than this is refused (the bound of the `safetensors` format itself).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Tensors in one file. The largest published shards hold a few thousand; the bound keeps a header
/// that claims billions from being collected.
pub const MAX_TENSORS: usize = 1 << 20;

/// A parsed and validated header: every tensor's `data_offsets` are relative to `data_start`,
/// cover the data without gaps or overlap, match their dtype and shape, and end inside the file.
struct Header {
    data_start: usize,
    metadata: Option<HashMap<String, String>>,
    tensors: Vec<(String, TensorInfo)>,
}

/// The header's JSON object: `__metadata__` and the tensors, in file order, with the count
/// bounded while it is read.
struct RawHeader {
    metadata: Option<HashMap<String, String>>,
    tensors: Vec<(String, TensorInfo)>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawHeader, A::Error> {
                use serde::de::Error;
                let mut out = RawHeader { metadata: None, tensors: Vec::new() };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if out.metadata.is_some() {
                            return Err(A::Error::custom("duplicate '__metadata__'"));
                        }
                        out.metadata = Some(map.next_value()?);
                        continue;
                    }
                    if out.tensors.len() >= MAX_TENSORS {
                        return Err(A::Error::custom(format!("more than {MAX_TENSORS} tensors")));
                    }
                    let info: TensorInfo =
                        map.next_value().map_err(|e| A::Error::custom(format!("tensor '{key}': {e}")))?;
                    out.tensors.push((key, info));
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// Reads and checks the header of a safetensors file held in `buf`. Every size is checked
/// against the bytes actually present before anything is sized from it.
fn parse_header(buf: &[u8]) -> Result<Header> {
    let len = buf.len();
    let Some(n) = buf.get(..8) else {
        bail!("{len} bytes is too short for a safetensors header (truncated file?)");
    };
    let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        bail!("the header claims {n} bytes (at most {MAX_HEADER_BYTES} are supported; not a safetensors file?)");
    }
    if n > (len - 8) as u64 {
        bail!("the header claims {n} bytes but the file has {len} (truncated file?)");
    }
    let data_start = 8 + n as usize;
    let text = std::str::from_utf8(&buf[8..data_start])
        .map_err(|e| anyhow!("malformed safetensors header: not UTF-8 ({e})"))?;
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| anyhow!("malformed safetensors header: {e}"))?;
    let data_len = len - data_start;
    let mut seen = std::collections::HashSet::with_capacity(raw.tensors.len());
    for (name, info) in &raw.tensors {
        if !seen.insert(name.as_str()) {
            bail!("duplicate tensor name '{name}' in the header");
        }
        let (s, e) = info.data_offsets;
        let need = info
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()))
            .filter(|bits| bits % 8 == 0)
            .map(|bits| bits / 8);
        let Some(need) = need else {
            bail!(
                "tensor '{name}': shape {:?} of {:?} is not a whole number of bytes or overflows",
                info.shape,
                info.dtype
            );
        };
        if e < s || e - s != need {
            bail!(
                "tensor '{name}': data_offsets [{s}, {e}] do not hold the {need} bytes of shape {:?} of {:?}",
                info.shape,
                info.dtype
            );
        }
        if e > data_len {
            bail!(
                "tensor '{name}' data range {}..{} exceeds the file size {len} (truncated file?)",
                data_start as u128 + s as u128,
                data_start as u128 + e as u128
            );
        }
    }
    // The format requires the tensors to tile the data: no gaps, no overlap, nothing after.
    let mut order: Vec<&(String, TensorInfo)> = raw.tensors.iter().collect();
    order.sort_by_key(|(_, i)| i.data_offsets);
    let mut at = 0;
    for (name, info) in order {
        if info.data_offsets.0 != at {
            bail!(
                "tensor '{name}' starts at byte {} of the data, expected {at} (tensors must cover the data without gaps or overlap)",
                info.data_offsets.0
            );
        }
        at = info.data_offsets.1;
    }
    if at != data_len {
        bail!("{} bytes after the last tensor's data (the header accounts for {at} of {data_len})", data_len - at);
    }
    Ok(Header { data_start, metadata: raw.metadata, tensors: raw.tensors })
}

/// Map a file read-only (also used for Forge's compiled caches).
pub fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only; the usual caveat of mmap (the file changing underneath)
    // applies to every loader of this kind and is documented for users.
    unsafe { Mmap::map(file) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.resize(b.len() + data_len, 0);
        b
    }

    fn err(bytes: Vec<u8>) -> String {
        let e = SafetensorsSet::from_bytes(Path::new("absurd.safetensors"), bytes).err().expect("must be refused");
        let msg = format!("{e:#}");
        assert!(msg.starts_with("absurd.safetensors: ") && !msg.contains('\n'), "{msg}");
        msg
    }

    #[test]
    fn safetensors_absurd_headers_are_refused_before_allocating() {
        // A header length of 2^40 bytes, in a 16-byte file.
        let mut b = (1u64 << 40).to_le_bytes().to_vec();
        b.extend_from_slice(b"{}{}{}{}");
        let e = err(b);
        assert!(e.contains("claims 1099511627776 bytes") && e.contains("at most 100000000"), "{e}");
        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(err(b).contains("claims 1000 bytes but the file has 10 (truncated file?)"));
        assert!(err(vec![1, 2, 3]).contains("too short"));
        // Offsets past the end of the file, and sizes that overflow.
        let e = err(file(r#"{"w":{"dtype":"F32","shape":[262144,1048576],"data_offsets":[0,1099511627776]}}"#, 16));
        assert!(e.contains("tensor 'w' data range") && e.contains("(truncated file?)"), "{e}");
        let e = err(file(r#"{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}}"#, 16));
        assert!(e.contains("tensor 'w'") && e.contains("overflows"), "{e}");
        let e = err(file(r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[18446744073709551615,3]}}"#, 4));
        assert!(e.contains("tensor 'w': data_offsets"), "{e}");
        let e = err(file(r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,5]}}"#, 5));
        assert!(e.contains("tensor 'w': data_offsets [0, 5]") && e.contains("4 bytes"), "{e}");
        // The tensors must tile the data.
        let e = err(file(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
            6,
        ));
        assert!(e.contains("tensor 'b' starts at byte 2") && e.contains("overlap"), "{e}");
        let e = err(file(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 9));
        assert!(e.contains("5 bytes after the last tensor"), "{e}");
        let e = err(file(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        ));
        assert!(e.contains("duplicate tensor name 'a'"), "{e}");
        let e = err(file(r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#, 1));
        assert!(e.contains("malformed safetensors header") && e.contains("tensor 'a'"), "{e}");
        // More tensors than any model has: refused while the header is read.
        let mut h = String::from("{");
        for i in 0..=MAX_TENSORS {
            h.push_str(&format!("\"{i}\":{{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}},"));
        }
        h.pop();
        h.push('}');
        let e = err(file(&h, 0));
        assert!(e.contains("more than 1048576 tensors"), "{e}");
    }

    /// `release` gives the pages back (the file-backed resident set drops by the tensor's size)
    /// and the tensor still reads the same bytes afterwards.
    #[cfg(target_os = "linux")]
    #[test]
    fn released_tensor_pages_leave_the_resident_set() {
        let n = 64 << 20;
        let header = format!(r#"{{"t":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
        let mut bytes = file(&header, 0);
        bytes.extend((0..n).map(|i| (i * 7 % 251) as u8));
        let path = std::env::temp_dir().join(format!("forge-release-{}.safetensors", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let set = SafetensorsSet::open_files(std::slice::from_ref(&path)).unwrap();
        let rss_file = || -> i64 {
            let s = std::fs::read_to_string("/proc/self/status").unwrap();
            let l = s.lines().find(|l| l.starts_with("RssFile:")).unwrap();
            l.split_whitespace().nth(1).unwrap().parse::<i64>().unwrap() * 1024
        };
        let sum = |set: &SafetensorsSet| set.raw("t").unwrap().2.iter().map(|&b| b as u64).sum::<u64>();
        let want: u64 = bytes[bytes.len() - n..].iter().map(|&b| b as u64).sum();
        assert_eq!(sum(&set), want);
        let before = rss_file();
        set.release("t");
        let after = rss_file();
        // Other tests of this process may map files meanwhile: half the tensor is the bound.
        assert!(before - after > (n / 2) as i64, "file-backed RSS {before} -> {after}");
        assert_eq!(sum(&set), want);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn safetensors_from_bytes_equals_open() {
        let path =
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen2_tiny/model.safetensors"));
        let a = SafetensorsSet::open_files(std::slice::from_ref(&path)).unwrap();
        let b = SafetensorsSet::from_bytes(&path, std::fs::read(&path).unwrap()).unwrap();
        assert!(a.names().eq(b.names()) && a.names().count() > 10);
        for n in a.names() {
            assert_eq!(a.raw(n), b.raw(n), "{n}");
        }
    }
}
