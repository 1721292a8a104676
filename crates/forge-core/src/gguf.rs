//! GGUF v2/v3 reader (metadata, tensor directory, dequantization to f32, block-quantized
//! matrices kept in the mapping and decoded row by row: [`BlockMatrix`]) and a small writer for
//! tests.
//!
//! The reader memory-maps the file and validates everything it is told by the header before it
//! trusts it: every count and length is bounded by the bytes actually left in the file before
//! anything is allocated, and every tensor's byte range is checked against the file size, so a
//! truncated or corrupt file yields a one-line error naming the file (and the key or tensor)
//! instead of a panic or a huge allocation.
//!
//! Block layouts follow ggml (`ggml-common.h` / `ggml-quants.c`); the tests check the
//! dequantizers bit-for-bit against gguf-py's numpy reference (`gguf/quants.py`).

use crate::backing::Backing;
use crate::tensor::Bytes;
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml tensors have at most 4 dimensions; anything larger is corruption.
const MAX_DIMS: u32 = 4;
/// The format allows arrays of arrays; real files never nest deeply, and a bound keeps a
/// malicious file from recursing the parser off the stack.
const MAX_ARRAY_DEPTH: usize = 8;
/// Tensors in one file. The largest published models have a few thousand; the bound keeps a
/// header that claims billions from sizing the directory after it.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Metadata values in one file, array elements included. A parsed value takes 32 bytes however
/// small its encoding (one byte for a U8), so the count, not the file size, bounds the memory the
/// metadata takes once parsed (256 MiB at this bound). The largest vocabularies hold about a
/// million values (tokens, types, scores, merges).
pub const MAX_METADATA_VALUES: u64 = 1 << 23;
/// Super-block size of the k-quants and the other 256-element formats.
const QK_K: usize = 256;

/// Metadata value type ids (`gguf_type` in ggml).
mod vtype {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Tensor element types (`ggml_type`). Ids that ggml has retired or added since are kept as
/// `Other(id)` so a file can still be described even when it cannot be decoded.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1M,
    BF16,
    TQ1_0,
    TQ2_0,
    Other(u32),
}

/// `ggml_type` id of MXFP4, which has no variant of its own; its layout is known so files
/// that contain it (e.g. gpt-oss) can still be opened.
const MXFP4_ID: u32 = 39;

impl GgmlType {
    pub fn from_u32(v: u32) -> Self {
        use GgmlType::*;
        match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => IQ2XXS,
            17 => IQ2XS,
            18 => IQ3XXS,
            19 => IQ1S,
            20 => IQ4NL,
            21 => IQ3S,
            22 => IQ2S,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            other => Other(other),
        }
    }

    pub fn to_u32(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ2XXS => 16,
            IQ2XS => 17,
            IQ3XXS => 18,
            IQ1S => 19,
            IQ4NL => 20,
            IQ3S => 21,
            IQ2S => 22,
            IQ4XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            Other(v) => v,
        }
    }

    /// The name gguf-py and llama.cpp's tools print (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ2XXS => "IQ2_XXS",
            IQ2XS => "IQ2_XS",
            IQ3XXS => "IQ3_XXS",
            IQ1S => "IQ1_S",
            IQ4NL => "IQ4_NL",
            IQ3S => "IQ3_S",
            IQ2S => "IQ2_S",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            Other(MXFP4_ID) => "MXFP4",
            Other(_) => "unknown",
        }
    }

    /// (elements per block, bytes per block), as in ggml's type traits.
    fn layout(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        Some(match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            // ggml stores d and s as f16 (36 bytes); gguf-py's table still says 40 from the
            // era when they were f32.
            Q8_1 => (32, 2 + 2 + 32),
            Q2K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4K => (QK_K, 2 + 2 + 12 + QK_K / 2),
            Q5K => (QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2),
            Q6K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8K => (QK_K, 4 + QK_K + QK_K / 8),
            IQ2XXS => (QK_K, 2 + QK_K / 4),
            IQ2XS => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3XXS => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4NL => (32, 2 + 16),
            IQ3S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4XS => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 | F64 => (1, 8),
            IQ1M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            TQ1_0 => (QK_K, 2 + 4 * 13),
            TQ2_0 => (QK_K, 2 + QK_K / 4),
            Other(MXFP4_ID) => (32, 1 + 16),
            Other(_) => return None,
        })
    }

    /// Elements per block (1 for plain scalar types); `None` for unknown types.
    pub fn block_size(self) -> Option<usize> {
        self.layout().map(|(bs, _)| bs)
    }

    /// Bytes per block; `None` for unknown types.
    pub fn type_size(self) -> Option<usize> {
        self.layout().map(|(_, ts)| ts)
    }

    /// Bytes taken by `n` consecutive elements; `None` if the type is unknown, `n` is not a
    /// whole number of blocks, or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let (bs, ts) = self.layout()?;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(ts)
    }

    /// Whether [`dequantize`] can decode this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | F64
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q2K
                | Q3K
                | Q4K
                | Q5K
                | Q6K
                | Q8K
                | IQ4NL
                | IQ4XS
                | TQ1_0
                | TQ2_0
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgmlType::Other(v) if self.layout().is_none() => write!(f, "unknown type id {v}"),
            _ => f.write_str(self.name()),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// As in the file: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Saturating rather than checked: infos from `GgufFile::open` are validated not to
        // overflow, and a hand-built one should not be able to panic here.
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Shape in row-major (PyTorch) order = dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect()
    }
}

/// An opened, validated GGUF file. Tensor data stays in the memory map until asked for.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
    /// Shared so that [`BlockMatrix`] views can hold on to the mapping.
    data: Arc<Backing>,
}

impl GgufFile {
    /// Memory-maps and parses `path`; the tensor data is not read.
    pub fn open(path: &Path) -> Result<Self> {
        let shown = path.display();
        let file = File::open(path).with_context(|| format!("{shown}: cannot open GGUF file"))?;
        let size = file.metadata().with_context(|| format!("{shown}: cannot stat GGUF file"))?.len();
        if size == 0 {
            bail!("{shown}: empty file, not a GGUF file");
        }
        // SAFETY: the map is read-only and private to this struct. Like every mmap-based model
        // loader (llama.cpp, safetensors) we rely on the file not being modified while it is
        // open; all bounds are checked against the map's length, never re-read from disk.
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("{shown}: cannot memory-map GGUF file"))?;
        Self::from_backing(path, Backing::Map(mmap))
    }

    /// Parses a GGUF file already in memory; `path` only names it in messages.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::from_backing(path, Backing::Owned(bytes))
    }

    fn from_backing(path: &Path, data: Backing) -> Result<Self> {
        let parsed = parse(&data, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name: parsed.by_name,
            data: Arc::new(data),
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Raw bytes of a tensor. `info` must come from this file; one whose range lies outside
    /// the file yields an empty slice rather than a panic.
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        usize::try_from(info.offset)
            .ok()
            .and_then(|start| self.data.get(start..start.checked_add(info.n_bytes)?))
            .unwrap_or(&[])
    }

    /// The raw bytes of a tensor as a view that shares the file's mapping (no copy); None when
    /// the tensor's range lies outside the file.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Option<Bytes> {
        let start = usize::try_from(info.offset).ok()?;
        let end = start.checked_add(info.n_bytes)?;
        (end <= self.data.len()).then(|| Bytes::new(self.data.clone(), start, info.n_bytes))
    }

    /// A 2-D tensor of a block-quantized type as a [`BlockMatrix`] over the mapping (None for
    /// other types: plain floats, or blocks without a decoder). `row_map` as in
    /// [`BlockMatrix::new`]. Errors name the file and the tensor.
    pub fn block_matrix(&self, name: &str, row_map: Option<Vec<u32>>) -> Result<Option<BlockMatrix>> {
        let shown = self.path.display();
        let info = self.tensor(name).ok_or_else(|| anyhow!("{shown}: no tensor named '{name}'"))?;
        if !BlockMatrix::supports(info.ty) {
            return Ok(None);
        }
        let (rows, cols) = match info.shape()[..] {
            [r, c] => (r, c),
            ref other => bail!("{shown}: tensor {name} of type {} has shape {other:?}, expected a matrix", info.ty),
        };
        let bytes = self.tensor_bytes(info).ok_or_else(|| {
            anyhow!(
                "{shown}: tensor {name}: data at offset {} ({} bytes) lies outside the file",
                info.offset,
                info.n_bytes
            )
        })?;
        BlockMatrix::new(name, info.ty, rows, cols, bytes, row_map).map(Some).with_context(|| format!("{shown}"))
    }

    /// Dequantize a whole tensor to f32 (row-major, shape = info.shape()).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let shown = self.path.display();
        let info = self.tensor(name).ok_or_else(|| anyhow!("{shown}: no tensor named '{name}'"))?;
        if !info.ty.can_dequantize() {
            bail!("unsupported tensor type {} for tensor {name} in {shown}", info.ty);
        }
        let n = usize::try_from(info.n_elements())
            .map_err(|_| anyhow!("{shown}: tensor {name} is too large for this platform"))?;
        let mut out = vec![0f32; n];
        dequantize(info.ty, self.tensor_data(info), &mut out).with_context(|| format!("{shown}: tensor {name}"))?;
        Ok(out)
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// Any integer type; `None` for negative values.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        as_u64(self.get(key)?)
    }

    /// F32 or F64.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        as_f32(self.get(key)?)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.get(key)? {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// `None` unless the value is an array whose elements are all booleans.
    pub fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                GgufValue::Bool(b) => Some(*b),
                _ => None,
            })
            .collect()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key)? {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// `None` unless the value is an array whose elements are all strings.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                GgufValue::String(s) => Some(s.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Arrays of any integer element type; `None` if an element does not fit in i64.
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.array(key)?.iter().map(as_i64).collect()
    }

    /// Arrays of F32 or F64 elements.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.array(key)?.iter().map(as_f32).collect()
    }

    fn array(&self, key: &str) -> Option<&[GgufValue]> {
        match self.get(key)? {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

fn as_i64(v: &GgufValue) -> Option<i64> {
    use GgufValue::*;
    match *v {
        U8(x) => Some(x.into()),
        I8(x) => Some(x.into()),
        U16(x) => Some(x.into()),
        I16(x) => Some(x.into()),
        U32(x) => Some(x.into()),
        I32(x) => Some(x.into()),
        U64(x) => i64::try_from(x).ok(),
        I64(x) => Some(x),
        _ => None,
    }
}

fn as_u64(v: &GgufValue) -> Option<u64> {
    match *v {
        GgufValue::U64(x) => Some(x),
        _ => as_i64(v).and_then(|x| u64::try_from(x).ok()),
    }
}

fn as_f32(v: &GgufValue) -> Option<f32> {
    match *v {
        GgufValue::F32(x) => Some(x),
        GgufValue::F64(x) => Some(x as f32),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

/// A low-level parse failure; the caller knows what was being read and turns it into the
/// one-line error.
enum Fail {
    Truncated { need: u64, at: usize },
    Invalid(String),
}

type Parsed<T> = std::result::Result<T, Fail>;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata values still allowed (see [`MAX_METADATA_VALUES`]).
    values_left: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// `n` is a u64 so that a corrupt length is reported as such instead of wrapping.
    fn take(&mut self, n: u64) -> Parsed<&'a [u8]> {
        match usize::try_from(n) {
            Ok(n) if n <= self.remaining() => {
                let s = &self.buf[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(Fail::Truncated { need: n, at: self.pos }),
        }
    }

    fn array<const N: usize>(&mut self) -> Parsed<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64)?);
        Ok(a)
    }

    fn u32(&mut self) -> Parsed<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Parsed<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// Fails as truncated if `count` items of at least `min_size` bytes each cannot fit in
    /// what is left, so the count can then be trusted for an allocation.
    fn check_fits(&self, count: u64, min_size: u64) -> Parsed<usize> {
        let need = count.saturating_mul(min_size);
        if need > self.remaining() as u64 {
            return Err(Fail::Truncated { need, at: self.pos });
        }
        // Fits in the file, hence in usize.
        Ok(count as usize)
    }

    /// Takes `n` values from the metadata budget before they are allocated.
    fn spend(&mut self, n: u64) -> Parsed<()> {
        match self.values_left.checked_sub(n) {
            Some(left) => {
                self.values_left = left;
                Ok(())
            }
            None => Err(Fail::Invalid(format!(
                "more than {MAX_METADATA_VALUES} metadata values in all (array elements included)"
            ))),
        }
    }

    fn string(&mut self) -> Parsed<String> {
        let len = self.u64()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| Fail::Invalid(format!("string is not valid UTF-8 ({e})")))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Parsed<GgufValue> {
        use GgufValue as V;
        Ok(match ty {
            vtype::U8 => V::U8(u8::from_le_bytes(self.array()?)),
            vtype::I8 => V::I8(i8::from_le_bytes(self.array()?)),
            vtype::U16 => V::U16(u16::from_le_bytes(self.array()?)),
            vtype::I16 => V::I16(i16::from_le_bytes(self.array()?)),
            vtype::U32 => V::U32(self.u32()?),
            vtype::I32 => V::I32(i32::from_le_bytes(self.array()?)),
            vtype::U64 => V::U64(self.u64()?),
            vtype::I64 => V::I64(i64::from_le_bytes(self.array()?)),
            vtype::F32 => V::F32(f32::from_le_bytes(self.array()?)),
            vtype::F64 => V::F64(f64::from_le_bytes(self.array()?)),
            // ggml itself reads a bool as a raw byte without checking it.
            vtype::BOOL => V::Bool(self.array::<1>()?[0] != 0),
            vtype::STRING => V::String(self.string()?),
            vtype::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(Fail::Invalid(format!("arrays nested more than {MAX_ARRAY_DEPTH} deep")));
                }
                let elem_ty = self.u32()?;
                let min_size = min_value_size(elem_ty)
                    .ok_or_else(|| Fail::Invalid(format!("unknown array element type {elem_ty}")))?;
                let count = self.u64()?;
                let count = self.check_fits(count, min_size)?;
                self.spend(count as u64)?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                V::Array(items)
            }
            other => return Err(Fail::Invalid(format!("unknown value type {other}"))),
        })
    }
}

/// Smallest encoding of a value of type `ty` (an empty string or array still has its header).
fn min_value_size(ty: u32) -> Option<u64> {
    Some(match ty {
        vtype::U8 | vtype::I8 | vtype::BOOL => 1,
        vtype::U16 | vtype::I16 => 2,
        vtype::U32 | vtype::I32 | vtype::F32 => 4,
        vtype::U64 | vtype::I64 | vtype::F64 | vtype::STRING => 8,
        vtype::ARRAY => 4 + 8,
        _ => return None,
    })
}

struct ParsedHeader {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
}

fn parse(buf: &[u8], path: &Path) -> Result<ParsedHeader> {
    let shown = path.display();
    let size = buf.len();
    let fail = |f: Fail, what: &str| match f {
        Fail::Truncated { need, at } => anyhow!(
            "{shown}: truncated GGUF header while reading {what} \
             (needed {need} bytes at offset {at}, file is {size} bytes)"
        ),
        Fail::Invalid(msg) => anyhow!("{shown}: malformed GGUF {what}: {msg}"),
    };
    let mut cur = Cursor { buf, pos: 0, values_left: MAX_METADATA_VALUES };

    let magic: [u8; 4] = cur.array().map_err(|f| fail(f, "magic"))?;
    if &magic != GGUF_MAGIC {
        bail!("{shown}: not a GGUF file (magic {magic:02x?}, expected \"GGUF\")");
    }
    let version = cur.u32().map_err(|f| fail(f, "version"))?;
    match version {
        2 | 3 => {}
        1 => bail!("{shown}: GGUF version 1 is not supported (only 2 and 3)"),
        // A byte-swapped small number means a big-endian file.
        v if v.swap_bytes() <= 3 => bail!("{shown}: big-endian GGUF files are not supported"),
        v => bail!("{shown}: unsupported GGUF version {v} (only 2 and 3)"),
    }
    let n_tensors = cur.u64().map_err(|f| fail(f, "tensor count"))?;
    let n_kv = cur.u64().map_err(|f| fail(f, "metadata count"))?;
    // Smallest key/value: empty key (8) + type (4) + one-byte value; smallest tensor info:
    // empty name (8) + n_dims (4) + type (4) + offset (8). Both sections must fit together.
    let min_header = n_kv.saturating_mul(13).saturating_add(n_tensors.saturating_mul(24));
    if min_header > cur.remaining() as u64 {
        bail!(
            "{shown}: truncated or corrupt GGUF header: it claims {n_tensors} tensors and \
             {n_kv} metadata keys, which cannot fit in a {size}-byte file"
        );
    }
    if n_tensors > MAX_TENSORS {
        bail!("{shown}: GGUF header claims {n_tensors} tensors (at most {MAX_TENSORS} are supported)");
    }
    if n_kv > MAX_METADATA_VALUES {
        bail!("{shown}: GGUF header claims {n_kv} metadata keys (at most {MAX_METADATA_VALUES} are supported)");
    }

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = cur.string().map_err(|f| fail(f, &format!("the name of metadata key #{i}")))?;
        let what = format!("metadata key '{key}'");
        let ty = cur.u32().map_err(|f| fail(f, &what))?;
        cur.spend(1).map_err(|f| fail(f, &what))?;
        let value = cur.value(ty, 0).map_err(|f| fail(f, &what))?;
        if metadata.insert(key, value).is_some() {
            bail!("{shown}: duplicate {what}");
        }
    }
    let alignment = alignment_from(metadata.get(ALIGNMENT_KEY)).map_err(|m| anyhow!("{shown}: {m}"))?;

    // Offsets read here are relative to the data section, whose start is only known once the
    // whole directory has been read.
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut by_name = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = cur.string().map_err(|f| fail(f, &format!("the name of tensor #{i}")))?;
        let what = format!("tensor info for '{name}'");
        let n_dims = cur.u32().map_err(|f| fail(f, &what))?;
        if n_dims > MAX_DIMS {
            bail!("{shown}: tensor {name}: {n_dims} dimensions (at most {MAX_DIMS} allowed)");
        }
        let dims = (0..n_dims).map(|_| cur.u64()).collect::<Parsed<Vec<u64>>>().map_err(|f| fail(f, &what))?;
        let ty = GgmlType::from_u32(cur.u32().map_err(|f| fail(f, &what))?);
        let offset = cur.u64().map_err(|f| fail(f, &what))?;
        let n_bytes = tensor_n_bytes(ty, &dims).map_err(|m| anyhow!("{shown}: tensor {name}: {m}"))?;
        if !offset.is_multiple_of(alignment) {
            bail!("{shown}: tensor {name}: offset {offset} is not a multiple of the alignment {alignment}");
        }
        if by_name.insert(name.clone(), tensors.len()).is_some() {
            bail!("{shown}: duplicate tensor name '{name}'");
        }
        tensors.push(GgufTensorInfo { name, dims, ty, offset, n_bytes });
    }

    // The header is at most the file size, so this cannot overflow.
    let data_start = (cur.pos as u64).div_ceil(alignment) * alignment;
    for t in &mut tensors {
        let start = data_start.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes as u64));
        match (start, end) {
            (Some(start), Some(end)) if end <= size as u64 => t.offset = start,
            _ => bail!(
                "{shown}: tensor {}: data range {}..{} exceeds file size {size} (truncated file?)",
                t.name,
                data_start as u128 + t.offset as u128,
                data_start as u128 + t.offset as u128 + t.n_bytes as u128,
            ),
        }
    }

    Ok(ParsedHeader { version, metadata, tensors, by_name })
}

/// `general.alignment` is optional; when present the spec requires a non-zero power-of-two U32.
fn alignment_from(v: Option<&GgufValue>) -> std::result::Result<u64, String> {
    match v {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(GgufValue::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(other) => Err(format!("invalid {ALIGNMENT_KEY} {other:?} (must be a non-zero power of two of type U32)")),
    }
}

/// Size of a tensor's data, rejecting shapes ggml could not represent.
fn tensor_n_bytes(ty: GgmlType, dims: &[u64]) -> std::result::Result<usize, String> {
    let (bs, ts) = ty.layout().ok_or_else(|| format!("unknown ggml type id {}", ty.to_u32()))?;
    if dims.contains(&0) {
        return Err(format!("zero dimension in dims {dims:?}"));
    }
    // ggml counts elements in i64.
    let n_elements = dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| format!("element count of dims {dims:?} overflows"))?;
    let row = dims.first().copied().unwrap_or(1);
    if !row.is_multiple_of(bs as u64) {
        return Err(format!("row length {row} is not a multiple of the {} block size {bs}", ty.name()));
    }
    (n_elements / bs as u64)
        .checked_mul(ts as u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("byte size of dims {dims:?} overflows"))
}

// ---------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------

/// Dequantize `n` elements (a multiple of the block size) of type `ty` from `data` into `out`.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let (bs, ts) = match ty.layout() {
        Some(layout) if ty.can_dequantize() => layout,
        _ => bail!("unsupported tensor type {ty}"),
    };
    if !out.len().is_multiple_of(bs) {
        bail!("{} elements is not a multiple of the {ty} block size {bs}", out.len());
    }
    let expected = out.len() / bs * ts;
    if data.len() != expected {
        bail!("{ty} data is {} bytes, expected {expected} for {} elements", data.len(), out.len());
    }
    if !decode_blocks(ty, data, out) {
        bail!("unsupported tensor type {ty}");
    }
    Ok(())
}

/// A GGUF matrix kept in its block-quantized form: `rows` rows of `cols` elements, each row
/// `cols / block_size` consecutive blocks of the ggml type (the file's own layout, row 0 first),
/// borrowed from the file's mapping. Rows are decoded on demand with the same per-block
/// dequantizers as [`dequantize`], so a decoded row equals the dequantized tensor's row bit for bit.
#[derive(Clone)]
pub struct BlockMatrix {
    /// The tensor's name in the file (for messages).
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    bytes: Bytes,
    /// Stored row of each logical row, when they differ (llama's Q/K head permutation).
    row_map: Option<Arc<[u32]>>,
    /// Stored column of each logical column, when they differ (the value heads of a `qwen35`
    /// file's DeltaNet output projection, which llama.cpp's converter tiles).
    col_map: Option<Arc<[u32]>>,
}

impl fmt::Debug for BlockMatrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockMatrix({} {} [{}, {}])", self.name, self.ty, self.rows, self.cols)
    }
}

impl BlockMatrix {
    /// Whether rows of `ty` can be held as blocks: quantized types with more than one element a
    /// block and a decoder, and F16/BF16 (half the memory of an f32 copy); F32 and F64 are read
    /// as dense tensors instead.
    pub fn supports(ty: GgmlType) -> bool {
        ty.can_dequantize()
            && (ty.block_size().is_some_and(|bs| bs > 1) || matches!(ty, GgmlType::F16 | GgmlType::BF16))
    }

    /// `bytes` must hold exactly `rows` rows of `cols` elements of `ty`; `row_map[r]`, when
    /// given, is the stored row that logical row `r` reads (a permutation of `0..rows`). Any
    /// inconsistency is an error naming the tensor.
    pub fn new(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Bytes,
        row_map: Option<Vec<u32>>,
    ) -> Result<BlockMatrix> {
        if !Self::supports(ty) {
            bail!("tensor {name}: type {ty} is not a block-quantized type Forge can decode");
        }
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
            anyhow!(
                "tensor {name}: row length {cols} is not a whole number of {ty} blocks of {}",
                ty.block_size().unwrap_or(0)
            )
        })?;
        let need =
            row_bytes.checked_mul(rows).ok_or_else(|| anyhow!("tensor {name}: size of [{rows}, {cols}] overflows"))?;
        if bytes.len() != need {
            bail!(
                "tensor {name}: {} bytes of {ty} data, but [{rows}, {cols}] needs {need} (truncated or inconsistent)",
                bytes.len()
            );
        }
        if row_map.as_ref().is_some_and(|m| !is_permutation(m, rows)) {
            bail!("tensor {name}: row map is not a permutation of its {rows} rows");
        }
        let row_map = row_map.map(Arc::from);
        Ok(BlockMatrix { name: name.to_string(), ty, rows, cols, row_bytes, bytes, row_map, col_map: None })
    }

    /// This matrix with logical column `c` read from stored column `map[c]` (a permutation of
    /// `0..cols`). Rows are decoded whole and then gathered, so a map may cross blocks.
    pub fn with_col_map(mut self, map: Vec<u32>) -> Result<BlockMatrix> {
        if !is_permutation(&map, self.cols) {
            bail!("tensor {}: column map is not a permutation of its {} columns", self.name, self.cols);
        }
        self.col_map = Some(Arc::from(map));
        Ok(self)
    }

    /// Bytes of the stored blocks.
    pub fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Decode logical rows `r0..r0 + n` into `out` (`n × cols` values).
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) -> Result<()> {
        if r0.checked_add(n).is_none_or(|end| end > self.rows) || out.len() < n * self.cols {
            bail!(
                "tensor {}: rows {r0}..{} of {} into {} values",
                self.name,
                r0.saturating_add(n),
                self.rows,
                out.len()
            );
        }
        let mut stored = match self.col_map {
            Some(_) => vec![0f32; self.cols],
            None => Vec::new(),
        };
        for (r, o) in (r0..r0 + n).zip(out.chunks_exact_mut(self.cols)) {
            match &self.col_map {
                Some(map) => {
                    self.decode_row(r, &mut stored);
                    o.iter_mut().zip(map.iter()).for_each(|(y, &c)| *y = stored[c as usize]);
                }
                None => self.decode_row(r, o),
            }
        }
        Ok(())
    }

    /// Decode stored row of logical row `r` (< rows) into `out` (`cols` values); checked by
    /// the callers.
    fn decode_row(&self, r: usize, out: &mut [f32]) {
        let s = self.row_map.as_ref().map_or(r, |m| m[r] as usize) * self.row_bytes;
        // `new` checked the type and the sizes, so this cannot refuse.
        let done = decode_blocks(self.ty, &self.bytes[s..s + self.row_bytes], out);
        debug_assert!(done);
    }
}

/// Whether `map` holds each of `0..n` once.
fn is_permutation(map: &[u32], n: usize) -> bool {
    let mut seen = vec![false; n];
    map.len() == n && map.iter().all(|&i| (i as usize) < n && !std::mem::replace(&mut seen[i as usize], true))
}

/// Where a block of `ty` keeps its super-scales (the offsets the dequantizers below read):
/// f16 `d` and, for the types with one, the f16 minimum `m`/`dmin`; Q8_K's `d` is an f32.
fn scale_fields(ty: GgmlType) -> Option<(usize, Option<usize>)> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4NL | IQ4XS | Q8K => (0, None),
        Q4_1 | Q5_1 | Q4K | Q5K => (0, Some(2)),
        Q2K => (80, Some(82)),
        Q3K => (108, None),
        Q6K => (208, None),
        TQ1_0 => (52, None),
        TQ2_0 => (64, None),
        _ => return None,
    })
}

/// Blocks of a block-quantized `ty` for `n` elements (a whole number of blocks) with random
/// quants and each block's scale drawn from `[scale/2, 3·scale/2)` (its minimum, where it has
/// one, at minus half that): finite data of known magnitude for tests and tools. None for types
/// [`BlockMatrix`] does not hold.
pub fn sample_blocks(ty: GgmlType, n: usize, scale: f32, seed: u64) -> Option<Vec<u8>> {
    let (d_at, m_at) = scale_fields(ty)?;
    let ts = ty.type_size()?;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut data: Vec<u8> = (0..ty.row_bytes(n)?).map(|_| (next() >> 32) as u8).collect();
    for block in data.chunks_exact_mut(ts) {
        let d = scale * (0.5 + (next() >> 40) as f32 / (1u64 << 24) as f32);
        if ty == GgmlType::Q8K {
            block[..4].copy_from_slice(&d.to_le_bytes());
            continue;
        }
        block[d_at..d_at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        if let Some(m) = m_at {
            block[m..m + 2].copy_from_slice(&half::f16::from_f32(-d / 2.0).to_le_bytes());
        }
    }
    Some(data)
}

/// Decode the whole blocks of `data` into `out` with the per-block dequantizers below; false
/// (nothing written) for a type without one. The caller checked that `data` holds exactly the
/// blocks of `out.len()` elements.
fn decode_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) -> bool {
    let Some((bs, ts)) = ty.layout() else { return false };
    use GgmlType::*;
    match ty {
        F32 => each_block(data, ts, out, bs, |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        F16 => each_block(data, ts, out, bs, |b, y| y[0] = f16_at(b, 0)),
        BF16 => each_block(data, ts, out, bs, |b, y| y[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        F64 => each_block(data, ts, out, bs, |b, y| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            y[0] = f64::from_le_bytes(a) as f32;
        }),
        Q4_0 => each_block(data, ts, out, bs, dequant_q4_0),
        Q4_1 => each_block(data, ts, out, bs, dequant_q4_1),
        Q5_0 => each_block(data, ts, out, bs, dequant_q5_0),
        Q5_1 => each_block(data, ts, out, bs, dequant_q5_1),
        Q8_0 => each_block(data, ts, out, bs, dequant_q8_0),
        Q2K => each_block(data, ts, out, bs, dequant_q2_k),
        Q3K => each_block(data, ts, out, bs, dequant_q3_k),
        Q4K => each_block(data, ts, out, bs, dequant_q4_k),
        Q5K => each_block(data, ts, out, bs, dequant_q5_k),
        Q6K => each_block(data, ts, out, bs, dequant_q6_k),
        Q8K => each_block(data, ts, out, bs, dequant_q8_k),
        IQ4NL => each_block(data, ts, out, bs, dequant_iq4_nl),
        IQ4XS => each_block(data, ts, out, bs, dequant_iq4_xs),
        TQ1_0 => each_block(data, ts, out, bs, dequant_tq1_0),
        TQ2_0 => each_block(data, ts, out, bs, dequant_tq2_0),
        // Kept in step with `can_dequantize`.
        _ => return false,
    }
    true
}

/// Applies `kernel` to each (block bytes, block output) pair. Generic so that each kernel is
/// inlined into its own loop. The lengths were checked by the caller, so the kernels can index
/// fixed offsets within a block without bounds failures.
#[inline(always)]
fn each_block(data: &[u8], ts: usize, out: &mut [f32], bs: usize, kernel: impl Fn(&[u8], &mut [f32])) {
    for (block, y) in data.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
        kernel(block, y);
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

// The kernels below mirror ggml's `dequantize_row_*` reference code, including the order of
// the float operations, so results match it (and gguf-py) bit for bit.

/// f16 d, 16 bytes of nibbles: low nibbles are elements 0..16, high nibbles 16..32.
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// f16 d, f16 m, 16 bytes of nibbles (same order as Q4_0); y = q*d + m.
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of Q5_0/Q5_1: bit j of the little-endian u32 `qh` belongs to element j.
fn q5_quants(qh: u32, qs: &[u8], j: usize) -> (u32, u32) {
    let x0 = (qs[j] & 0x0F) as u32 | (((qh >> j) << 4) & 0x10);
    let x1 = (qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10);
    (x0, x1)
}

fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let (x0, x1) = q5_quants(qh, qs, j);
        y[j] = (x0 as i32 - 16) as f32 * d;
        y[j + 16] = (x1 as i32 - 16) as f32 * d;
    }
}

fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let (x0, x1) = q5_quants(qh, qs, j);
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = q as i8 as f32 * d;
    }
}

/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
/// Element e uses scale e/16 and the 2-bit field at shift 2*((e%128)/32) of qs[(e/128)*32 + e%32].
fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for (g, ys) in y.chunks_exact_mut(16).enumerate() {
        let sc = scales[g];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let shift = 2 * ((g % 8) / 2);
        let q = &qs[(g / 8) * 32 + (g % 2) * 16..][..16];
        for (y, &q) in ys.iter_mut().zip(q) {
            *y = dl * ((q >> shift) & 3) as f32 - ml;
        }
    }
}

/// Q3_K: hmask[32], qs[64], 12 bytes of packed 6-bit scales, f16 d. Like Q2_K plus a high bit
/// from hmask; a *clear* high bit subtracts 4.
fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let packed = &b[96..108];
    let d = f16_at(b, 108);
    // Scale j: low 4 bits from nibble j of bytes 0..8, high 2 bits from bytes 8..12.
    let scale = |j: usize| {
        let lo = if j < 8 { packed[j] & 0x0F } else { packed[j - 8] >> 4 };
        let hi = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        (lo | (hi << 4)) as i32 - 32
    };
    for (g, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * scale(g) as f32;
        let half = g / 8;
        let j = (g % 8) / 2;
        let l0 = (g % 2) * 16;
        let q = &qs[half * 32 + l0..][..16];
        let h = &hmask[l0..][..16];
        let hbit = 1u8 << (half * 4 + j);
        for ((y, &q), &h) in ys.iter_mut().zip(q).zip(h) {
            let v = ((q >> (2 * j)) & 3) as i32 - if h & hbit != 0 { 0 } else { 4 };
            *y = dl * v as f32;
        }
    }
}

/// ggml's `get_scale_min_k4`: eight 6-bit (scale, min) pairs packed into 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, qs[128]. Each 64 elements share 32 bytes:
/// low nibbles are the first sub-block of 32, high nibbles the second.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (c, ys) in y.chunks_exact_mut(64).enumerate() {
        let q = &qs[c * 32..][..32];
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (lo, hi) = ys.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            hi[l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: Q4_K plus qh[32] holding the fifth bit; bit s of qh[l] belongs to sub-block s.
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (c, ys) in y.chunks_exact_mut(64).enumerate() {
        let q = &qs[c * 32..][..32];
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let (lo, hi) = ys.split_at_mut(32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            lo[l] = d1 * ((q[l] & 0x0F) + h1) as f32 - m1;
            hi[l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d. Each half of
/// 128 elements uses 64 ql bytes and 32 qh bytes; y = d * scale * (q - 32).
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for (n, ys) in y.chunks_exact_mut(128).enumerate() {
        let ql = &b[n * 64..][..64];
        let qh = &b[128 + n * 32..][..32];
        let sc = &b[192 + n * 8..][..8];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &q) in q.iter().enumerate() {
                let scale = sc[is + 2 * k] as i8 as f32;
                ys[l + 32 * k] = d * scale * (q as i32 - 32) as f32;
            }
        }
    }
}

/// Q8_K: f32 d, int8 qs[256], then 16 i16 block sums that only matter for dot products.
fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *y = d * q as i8 as f32;
    }
}

/// Non-linear 4-bit codebook shared by IQ4_NL and IQ4_XS.
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// IQ4_NL: f16 d, 16 bytes of codebook indices in Q4_0 order.
fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

/// IQ4_XS: f16 d, u16 scales_h, scales_l[4], qs[128]; eight sub-blocks of 32 with a 6-bit
/// scale each (low 4 bits in scales_l, high 2 bits in scales_h).
fn dequant_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let hi = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * ((lo | (hi << 4)) as i32 - 32) as f32;
        let q = &qs[ib * 16..][..16];
        for j in 0..16 {
            ys[j] = dl * KVALUES_IQ4NL[(q[j] & 0x0F) as usize] as f32;
            ys[j + 16] = dl * KVALUES_IQ4NL[(q[j] >> 4) as usize] as f32;
        }
    }
}

/// TQ1_0: ternary digits packed five (or four, in qh) per byte as a fixed-point fraction of
/// 3^5; multiplying by 3^n (wrapping in u8) brings digit n to the top, read as (q*3)>>8.
fn dequant_tq1_0(b: &[u8], y: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let qs = &b[0..48];
    let qh = &b[48..52];
    let d = f16_at(b, 52);
    let trit = |q: u8, n: usize| ((q.wrapping_mul(POW3[n]) as u16 * 3) >> 8) as i32 - 1;
    let mut e = 0;
    let mut emit = |v: i32| {
        y[e] = v as f32 * d;
        e += 1;
    };
    // Same traversal as ggml: 32 bytes x 5 digits, then 16 bytes x 5, then qh's 4 bytes x 4.
    for (bytes, digits) in [(&qs[0..32], 5), (&qs[32..48], 5), (qh, 4)] {
        for n in 0..digits {
            for &q in bytes {
                emit(trit(q, n));
            }
        }
    }
}

/// TQ2_0: 2-bit ternary values (0,1,2 => -1,0,1), qs[64] then f16 d; each 32 bytes hold 128
/// elements, four 2-bit planes of 32.
fn dequant_tq2_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 64);
    for (c, ys) in y.chunks_exact_mut(128).enumerate() {
        let q = &b[c * 32..][..32];
        for (l, plane) in ys.chunks_exact_mut(32).enumerate() {
            for (y, &q) in plane.iter_mut().zip(q) {
                *y = (((q >> (2 * l)) & 3) as i32 - 1) as f32 * d;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------

/// Minimal writer (for tests and tools): GGUF v3, alignment 32 (or `general.alignment` if given
/// as U32 in metadata). Tensors are `(name, dims in file order, type, raw data)`.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, GgufValue)],
    tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)],
) -> Result<()> {
    let shown = path.display();
    // Refuse to write what the reader would reject, so round trips are meaningful.
    let alignment = alignment_from(metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY).map(|(_, v)| v))
        .map_err(|m| anyhow!("{shown}: {m}"))?;

    let mut header = Vec::new();
    header.extend_from_slice(GGUF_MAGIC);
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());

    let mut seen = std::collections::HashSet::new();
    for (key, value) in metadata {
        if !seen.insert(key.as_str()) {
            bail!("{shown}: duplicate metadata key '{key}'");
        }
        put_str(&mut header, key);
        header.extend_from_slice(&value_type(value).to_le_bytes());
        put_value(&mut header, value).map_err(|m| anyhow!("{shown}: cannot write metadata key '{key}': {m}"))?;
    }

    let mut seen = std::collections::HashSet::new();
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        if !seen.insert(name.as_str()) {
            bail!("{shown}: duplicate tensor name '{name}'");
        }
        let n_bytes = tensor_n_bytes(*ty, dims).map_err(|m| anyhow!("{shown}: tensor {name}: {m}"))?;
        if data.len() != n_bytes {
            bail!("{shown}: tensor {name}: {} bytes of data, but {dims:?} of {ty} needs {n_bytes}", data.len());
        }
        put_str(&mut header, name);
        header.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&ty.to_u32().to_le_bytes());
        header.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + n_bytes as u64).div_ceil(alignment) * alignment;
    }
    let padding = |len: u64| vec![0u8; (len.div_ceil(alignment) * alignment - len) as usize];
    header.extend(padding(header.len() as u64));

    let file = File::create(path).with_context(|| format!("{shown}: cannot create file"))?;
    let mut w = BufWriter::new(file);
    let io = |e: std::io::Error| anyhow!("{shown}: write failed: {e}");
    w.write_all(&header).map_err(io)?;
    for (_, _, _, data) in tensors {
        w.write_all(data).map_err(io)?;
        w.write_all(&padding(data.len() as u64)).map_err(io)?;
    }
    w.flush().map_err(io)
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn value_type(v: &GgufValue) -> u32 {
    use GgufValue::*;
    match v {
        U8(_) => vtype::U8,
        I8(_) => vtype::I8,
        U16(_) => vtype::U16,
        I16(_) => vtype::I16,
        U32(_) => vtype::U32,
        I32(_) => vtype::I32,
        U64(_) => vtype::U64,
        I64(_) => vtype::I64,
        F32(_) => vtype::F32,
        F64(_) => vtype::F64,
        Bool(_) => vtype::BOOL,
        String(_) => vtype::STRING,
        Array(_) => vtype::ARRAY,
    }
}

/// Writes the payload of `v` (its type id is written by the caller, or once per array).
fn put_value(buf: &mut Vec<u8>, v: &GgufValue) -> std::result::Result<(), String> {
    use GgufValue::*;
    match v {
        U8(x) => buf.push(*x),
        I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Bool(x) => buf.push(u8::from(*x)),
        String(s) => put_str(buf, s),
        Array(items) => {
            // GGUF arrays are homogeneous; an empty one still needs some element type.
            let ty = items.first().map_or(vtype::U8, value_type);
            if items.iter().any(|i| value_type(i) != ty) {
                return Err("array elements must all have the same type".into());
            }
            buf.extend_from_slice(&ty.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A unique scratch file path, removed on drop.
    struct TempPath(PathBuf);

    impl TempPath {
        fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let name = format!("forge-gguf-test-{}-{n}-{tag}.gguf", std::process::id());
            TempPath(std::env::temp_dir().join(name))
        }
        fn with(tag: &str, bytes: &[u8]) -> Self {
            let t = Self::new(tag);
            std::fs::write(&t.0, bytes).unwrap();
            t
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn f32s_le(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn fixture() -> serde_json::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quants.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (see tools/make_gguf_quant_fixtures.py)", path.display()));
        serde_json::from_str(&text).unwrap()
    }

    /// Small deterministic PRNG (xorshift64*), so the tests need no extra dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Random blocks of a type that starts with f16 d (and possibly f16 m/dmin), with both of
    /// those finite so results can be compared with `==`.
    fn random_blocks(rng: &mut Rng, ty: GgmlType, n_blocks: usize) -> Vec<u8> {
        let ts = ty.type_size().unwrap();
        let mut data = rng.bytes(n_blocks * ts);
        for block in data.chunks_exact_mut(ts) {
            block[..2].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
            block[2..4].copy_from_slice(&half::f16::from_f32(-1.5).to_le_bytes());
        }
        data
    }

    fn assert_one_line_err<T: fmt::Debug>(r: Result<T>, path: &Path, needle: &str) -> String {
        let msg = format!("{:#}", r.expect_err(&format!("expected an error containing {needle:?}")));
        assert!(msg.contains(&path.display().to_string()), "no path in: {msg}");
        assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
        assert!(!msg.contains('\n'), "multi-line error: {msg}");
        msg
    }

    #[test]
    fn gguf_dequantize_matches_gguf_py() {
        let fx = fixture();
        let mut covered = Vec::new();
        for case in fx["cases"].as_array().unwrap() {
            let name = case["type"].as_str().unwrap();
            let ty = GgmlType::from_u32(case["type_id"].as_u64().unwrap() as u32);
            assert_eq!(ty.name(), name);
            assert!(ty.can_dequantize(), "{name}");
            let data = unhex(case["data_hex"].as_str().unwrap());
            let expected = f32s_le(&unhex(case["expected_f32_hex"].as_str().unwrap()));
            assert_eq!(expected.len() as u64, case["n_elements"].as_u64().unwrap());
            let mut out = vec![f32::NAN; expected.len()];
            dequantize(ty, &data, &mut out).unwrap();
            for (i, (&got, &want)) in out.iter().zip(&expected).enumerate() {
                let close =
                    got.to_bits() == want.to_bits() || (got.is_finite() && (got - want).abs() <= 1e-6 * want.abs());
                assert!(close, "{name} element {i}: got {got:e}, gguf-py {want:e}");
            }
            covered.push(name.to_string());
        }
        for required in ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"] {
            assert!(covered.iter().any(|c| c == required), "fixture lacks {required}");
        }
    }

    #[test]
    fn gguf_type_sizes_match_gguf_py_table() {
        let fx = fixture();
        for (name, v) in fx["quant_sizes"].as_object().unwrap() {
            let v: Vec<usize> = v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let ty = GgmlType::from_u32(v[0] as u32);
            if ty.layout().is_none() {
                // Newer than this reader (e.g. NVFP4): must be unknown, not guessed.
                assert!(matches!(ty, GgmlType::Other(_)), "{name}");
                continue;
            }
            assert_eq!(ty.name(), name);
            if ty == GgmlType::Q8_1 {
                // gguf-py still lists the old f32-scaled layout (40 bytes); ggml's is 36.
                assert_eq!(ty.type_size(), Some(36));
                continue;
            }
            assert_eq!((ty.block_size(), ty.type_size()), (Some(v[1]), Some(v[2])), "{name}");
        }
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(100), None);
        assert_eq!(GgmlType::Other(200).row_bytes(32), None);
        for id in 0..64 {
            assert_eq!(GgmlType::from_u32(id).to_u32(), id);
        }
    }

    fn sample_metadata() -> Vec<(String, GgufValue)> {
        use GgufValue::*;
        let kv = |k: &str, v| (k.to_string(), v);
        vec![
            kv("general.architecture", String("llama".into())),
            kv("u8", U8(200)),
            kv("i8", I8(-5)),
            kv("u16", U16(60000)),
            kv("i16", I16(-30000)),
            kv("u32", U32(4_000_000_000)),
            kv("i32", I32(-2_000_000_000)),
            kv("u64", U64(u64::MAX)),
            kv("i64", I64(i64::MIN)),
            kv("f32", F32(1.5)),
            kv("f64", F64(0.125)),
            kv("bool", Bool(true)),
            kv("empty", String(std::string::String::new())),
            kv("unicode", String("héllo ✓ 日本".into())),
            kv("tokens", Array(vec![String("<s>".into()), String("▁a".into()), String("".into())])),
            kv("ids", Array(vec![I32(-1), I32(7), I32(i32::MAX)])),
            kv("big_ids", Array(vec![U64(1), U64(u64::MAX)])),
            kv("scores", Array(vec![F32(-0.5), F32(2.0)])),
            kv("nested", Array(vec![Array(vec![U8(1), U8(2)]), Array(vec![String("x".into())])])),
            kv("empty_arr", Array(vec![])),
        ]
    }

    #[test]
    fn gguf_write_open_round_trip() {
        let mut rng = Rng(7);
        let f32_vals: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let f32_bytes: Vec<u8> = f32_vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let tensors = vec![
            ("a.f32".to_string(), vec![3, 2], GgmlType::F32, f32_bytes),
            ("b.f16".to_string(), vec![5], GgmlType::F16, half::f16::from_f32(3.0).to_le_bytes().repeat(5)),
            ("c.q4_0".to_string(), vec![64, 2], GgmlType::Q4_0, random_blocks(&mut rng, GgmlType::Q4_0, 4)),
            ("d.q4_k".to_string(), vec![256, 1, 2], GgmlType::Q4K, random_blocks(&mut rng, GgmlType::Q4K, 2)),
            ("e.i32".to_string(), vec![3], GgmlType::I32, rng.bytes(12)),
        ];
        let metadata = sample_metadata();
        let tmp = TempPath::new("roundtrip");
        write_gguf(&tmp.0, &metadata, &tensors).unwrap();
        let f = GgufFile::open(&tmp.0).unwrap();

        assert_eq!(f.version, 3);
        assert_eq!(f.metadata, metadata.iter().cloned().collect::<BTreeMap<_, _>>());
        assert_eq!(f.tensors.len(), tensors.len());
        for ((name, dims, ty, data), info) in tensors.iter().zip(&f.tensors) {
            assert_eq!((&info.name, &info.dims, info.ty), (name, dims, *ty));
            assert_eq!(info.n_bytes, data.len());
            assert_eq!(info.offset % DEFAULT_ALIGNMENT, 0);
            assert_eq!(f.tensor_data(info), &data[..]);
            assert_eq!(f.tensor(name), Some(info));
        }
        let a = f.tensor("a.f32").unwrap();
        assert_eq!((a.shape(), a.n_elements()), (vec![2, 3], 6));
        assert_eq!(f.dequantize("a.f32").unwrap(), f32_vals);
        assert_eq!(f.dequantize("b.f16").unwrap(), vec![3.0; 5]);
        assert_eq!(f.tensor("d.q4_k").unwrap().shape(), vec![2, 1, 256]);
        let mut want = vec![0f32; 512];
        dequantize(GgmlType::Q4K, &tensors[3].3, &mut want).unwrap();
        assert_eq!(f.dequantize("d.q4_k").unwrap(), want);
        assert!(f.tensor("missing").is_none());
        assert_one_line_err(f.dequantize("missing"), &tmp.0, "no tensor named 'missing'");

        // Typed getters convert between integer widths but never lose sign or range.
        assert_eq!(f.get_str("general.architecture"), Some("llama"));
        assert_eq!(f.get_u64("u8"), Some(200));
        assert_eq!(f.get_u64("u64"), Some(u64::MAX));
        assert_eq!(f.get_u64("i8"), None);
        assert_eq!(f.get_u64("f32"), None);
        assert_eq!(f.get_f32("f32"), Some(1.5));
        assert_eq!(f.get_f32("f64"), Some(0.125));
        assert_eq!(f.get_f32("u8"), None);
        assert_eq!(f.get_bool("bool"), Some(true));
        assert_eq!(f.get_str("u8"), None);
        assert_eq!(f.get_str_array("tokens"), Some(vec!["<s>", "▁a", ""]));
        assert_eq!(f.get_str_array("ids"), None);
        assert_eq!(f.get_str_array("empty_arr"), Some(vec![]));
        assert_eq!(f.get_i64_array("ids"), Some(vec![-1, 7, i32::MAX as i64]));
        assert_eq!(f.get_i64_array("big_ids"), None);
        assert_eq!(f.get_f32_array("scores"), Some(vec![-0.5, 2.0]));
        assert_eq!(f.get_f32_array("missing"), None);
    }

    #[test]
    fn gguf_custom_alignment() {
        let tensors = vec![
            ("x".to_string(), vec![3], GgmlType::F32, vec![0u8; 12]),
            ("y".to_string(), vec![1], GgmlType::F16, vec![0u8; 2]),
        ];
        let meta = vec![(ALIGNMENT_KEY.to_string(), GgufValue::U32(64))];
        let tmp = TempPath::new("align");
        write_gguf(&tmp.0, &meta, &tensors).unwrap();
        let f = GgufFile::open(&tmp.0).unwrap();
        assert!(f.tensors.iter().all(|t| t.offset % 64 == 0));
        assert_eq!(f.tensors[1].offset - f.tensors[0].offset, 64);

        for bad in [GgufValue::U32(48), GgufValue::U32(0), GgufValue::U64(32)] {
            let meta = vec![(ALIGNMENT_KEY.to_string(), bad)];
            assert_one_line_err(write_gguf(&tmp.0, &meta, &tensors), &tmp.0, ALIGNMENT_KEY);
        }
        let wrong_len = vec![("x".to_string(), vec![4], GgmlType::F32, vec![0u8; 12])];
        assert_one_line_err(write_gguf(&tmp.0, &[], &wrong_len), &tmp.0, "needs 16");
    }

    #[test]
    fn gguf_unsupported_types_are_reported() {
        let mut rng = Rng(3);
        let tensors = vec![
            ("iq2".to_string(), vec![256], GgmlType::IQ2XXS, rng.bytes(66)),
            ("mx".to_string(), vec![32], GgmlType::Other(MXFP4_ID), rng.bytes(17)),
        ];
        let tmp = TempPath::new("unsupported");
        write_gguf(&tmp.0, &[], &tensors).unwrap();
        let f = GgufFile::open(&tmp.0).unwrap();
        let shown = tmp.0.display();
        let msg = format!("{:#}", f.dequantize("iq2").unwrap_err());
        assert_eq!(msg, format!("unsupported tensor type IQ2_XXS for tensor iq2 in {shown}"));
        let msg = format!("{:#}", f.dequantize("mx").unwrap_err());
        assert_eq!(msg, format!("unsupported tensor type MXFP4 for tensor mx in {shown}"));

        let mut out = [0f32; 32];
        let err = dequantize(GgmlType::Other(99), &[], &mut out).unwrap_err();
        assert_eq!(err.to_string(), "unsupported tensor type unknown type id 99");
        let err = dequantize(GgmlType::Q4_0, &[0; 18], &mut out[..31]).unwrap_err();
        assert!(err.to_string().contains("not a multiple"), "{err}");
        let err = dequantize(GgmlType::Q4_0, &[0; 17], &mut out).unwrap_err();
        assert!(err.to_string().contains("expected 18"), "{err}");
    }

    /// A valid file with metadata and several tensor types, as raw bytes.
    fn sample_file_bytes(rng: &mut Rng) -> (Vec<u8>, usize) {
        let tensors = vec![
            ("t.q6k".to_string(), vec![256, 2], GgmlType::Q6K, rng.bytes(2 * 210)),
            ("t.q4_1".to_string(), vec![32], GgmlType::Q4_1, random_blocks(rng, GgmlType::Q4_1, 1)),
            ("t.f16".to_string(), vec![7, 3], GgmlType::F16, rng.bytes(42)),
        ];
        let tmp = TempPath::new("sample");
        write_gguf(&tmp.0, &sample_metadata(), &tensors).unwrap();
        let f = GgufFile::open(&tmp.0).unwrap();
        let data_end = f.tensors.iter().map(|t| t.offset as usize + t.n_bytes).max().unwrap();
        (std::fs::read(&tmp.0).unwrap(), data_end)
    }

    #[test]
    fn gguf_truncated_files_error() {
        let (bytes, data_end) = sample_file_bytes(&mut Rng(11));
        let header_end = GgufFile::open(&TempPath::with("full", &bytes).0).unwrap().tensors[0].offset as usize;
        for cut in 0..data_end {
            let tmp = TempPath::with("cut", &bytes[..cut]);
            let needle = match cut {
                0 => "empty file",
                c if c < header_end => "truncated",
                _ => "exceeds file size",
            };
            assert_one_line_err(GgufFile::open(&tmp.0), &tmp.0, needle);
        }
    }

    /// Raw GGUF building blocks, for headers the writer would refuse to produce.
    fn raw_header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b
    }

    fn raw_kv(b: &mut Vec<u8>, key: &[u8], ty: u32, payload: &[u8]) {
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(payload);
    }

    fn raw_tensor(b: &mut Vec<u8>, name: &str, dims: &[u64], ty: u32, offset: u64) {
        put_str(b, name);
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend_from_slice(&d.to_le_bytes()));
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
    }

    /// One tensor, padded header, then `data_len` bytes of data.
    fn raw_one_tensor(dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
        let mut b = raw_header(3, 1, 0);
        raw_tensor(&mut b, "t", dims, ty, offset);
        b.resize(b.len().div_ceil(32) * 32 + data_len, 0);
        b
    }

    #[test]
    fn gguf_corrupt_headers_are_rejected() {
        let le64 = |v: u64| v.to_le_bytes().to_vec();
        let cat = |parts: &[&[u8]]| parts.concat();
        let with_kv = |n_kv: u64, key: &[u8], ty: u32, payload: &[u8]| {
            let mut b = raw_header(3, 0, n_kv);
            raw_kv(&mut b, key, ty, payload);
            b.extend_from_slice(&[0; 64]);
            b
        };
        let mut nested = Vec::new();
        for _ in 0..12 {
            nested.extend_from_slice(&cat(&[&vtype::ARRAY.to_le_bytes(), &le64(1)]));
        }
        nested.extend_from_slice(&cat(&[&vtype::U8.to_le_bytes(), &le64(0)]));
        let mut dup = raw_header(3, 0, 2);
        raw_kv(&mut dup, b"a", vtype::U8, &[1]);
        raw_kv(&mut dup, b"a", vtype::U8, &[2]);
        let mut dup_t = raw_header(3, 2, 0);
        raw_tensor(&mut dup_t, "t", &[8], 0, 0);
        raw_tensor(&mut dup_t, "t", &[8], 0, 32);
        dup_t.resize(256, 0);

        let mut bad_magic = raw_header(3, 0, 0);
        bad_magic[3] = b'X';
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("magic", bad_magic, "not a GGUF file"),
            ("v1", raw_header(1, 0, 0), "version 1 is not supported"),
            ("bigendian", raw_header(0x0300_0000, 0, 0), "big-endian"),
            ("v7", raw_header(7, 0, 0), "unsupported GGUF version 7"),
            ("short", b"GGUF\x03\x00".to_vec(), "truncated GGUF header while reading version"),
            ("ntensors", raw_header(3, u64::MAX, 0), "cannot fit"),
            ("nkv", raw_header(3, 0, 1 << 40), "cannot fit"),
            ("keylen", cat(&[&raw_header(3, 0, 1), &le64(u64::MAX), &[0; 16]]), "the name of metadata key #0"),
            (
                "strlen",
                with_kv(1, b"k", vtype::STRING, &le64(1 << 62)),
                "truncated GGUF header while reading metadata key 'k'",
            ),
            (
                "arrlen",
                with_kv(1, b"arr", vtype::ARRAY, &cat(&[&vtype::U32.to_le_bytes(), &le64(1 << 60)])),
                "metadata key 'arr'",
            ),
            ("vtype", with_kv(1, b"k", 13, &[]), "unknown value type 13"),
            (
                "etype",
                with_kv(1, b"k", vtype::ARRAY, &cat(&[&99u32.to_le_bytes(), &le64(1)])),
                "unknown array element type 99",
            ),
            ("nested", with_kv(1, b"k", vtype::ARRAY, &nested), "nested more than"),
            ("utf8", with_kv(1, b"\xff\xfe", vtype::U8, &[0]), "UTF-8"),
            ("dupkey", dup, "duplicate metadata key 'a'"),
            ("align0", with_kv(1, ALIGNMENT_KEY.as_bytes(), vtype::U32, &0u32.to_le_bytes()), ALIGNMENT_KEY),
            ("align3", with_kv(1, ALIGNMENT_KEY.as_bytes(), vtype::U32, &3u32.to_le_bytes()), ALIGNMENT_KEY),
            ("align64", with_kv(1, ALIGNMENT_KEY.as_bytes(), vtype::U64, &le64(32)), ALIGNMENT_KEY),
            ("ndims", raw_one_tensor(&[1, 1, 1, 1, 1], 0, 0, 4), "5 dimensions"),
            ("zerodim", raw_one_tensor(&[4, 0], 0, 0, 16), "zero dimension"),
            ("overflow", raw_one_tensor(&[1 << 32, 1 << 32], 0, 0, 16), "overflows"),
            ("ggmltype", raw_one_tensor(&[4], 99, 0, 16), "unknown ggml type id 99"),
            ("blocks", raw_one_tensor(&[31], 2, 0, 18), "not a multiple of the Q4_0 block size 32"),
            ("misaligned", raw_one_tensor(&[1], 0, 4, 16), "not a multiple of the alignment 32"),
            ("range", raw_one_tensor(&[1024], 0, 0, 16), "tensor t: data range"),
            ("hugeoffset", raw_one_tensor(&[4], 0, u64::MAX - 31, 16), "exceeds file size"),
            ("duptensor", dup_t, "duplicate tensor name 't'"),
        ];
        for (tag, bytes, needle) in cases {
            let tmp = TempPath::with(tag, &bytes);
            let msg = assert_one_line_err(GgufFile::open(&tmp.0), &tmp.0, needle);
            if tag == "range" {
                assert!(msg.contains("exceeds file size") && msg.contains("(truncated file?)"), "{msg}");
            }
        }
        // The well-formed base of these cases does open.
        let tmp = TempPath::with("ok", &raw_one_tensor(&[4], 0, 0, 16));
        assert_eq!(GgufFile::open(&tmp.0).unwrap().dequantize("t").unwrap(), vec![0.0; 4]);
        // Version 2 has the same layout as 3.
        let tmp = TempPath::with("v2", &raw_header(2, 0, 0));
        assert_eq!(GgufFile::open(&tmp.0).unwrap().version, 2);
    }

    #[test]
    fn gguf_random_corruption_never_panics() {
        let mut rng = Rng(0x5eed);
        let (bytes, _) = sample_file_bytes(&mut rng);
        let tmp = TempPath::new("fuzz");
        let (mut opened, mut failed) = (0, 0);
        for _ in 0..1500 {
            let mut b = bytes.clone();
            for _ in 0..1 + rng.below(4) {
                // Mostly hit the header, where the structure is.
                let span = if rng.below(4) == 0 { b.len() } else { 400 };
                let at = rng.below(span);
                b[at] = rng.next() as u8;
            }
            if rng.below(8) == 0 {
                b.truncate(rng.below(b.len()));
            }
            std::fs::write(&tmp.0, &b).unwrap();
            match GgufFile::open(&tmp.0) {
                Ok(f) => {
                    opened += 1;
                    for t in &f.tensors {
                        let _ = f.dequantize(&t.name);
                    }
                }
                Err(e) => {
                    failed += 1;
                    assert!(!format!("{e:#}").contains('\n'));
                }
            }
        }
        assert!(opened > 0 && failed > 0, "opened {opened}, failed {failed}");
    }

    #[test]
    fn gguf_absurd_counts_are_refused_before_allocating() {
        let path = Path::new("absurd.gguf");
        let err = |bytes: Vec<u8>| format!("{:#}", GgufFile::from_bytes(path, bytes).unwrap_err());
        // More tensors than any model has, in a file large enough to hold their minimal entries.
        let mut b = raw_header(3, MAX_TENSORS + 1, 0);
        b.resize(b.len() + 24 * (MAX_TENSORS as usize + 1), 0);
        let e = err(b);
        assert!(e.contains("absurd.gguf") && e.contains("at most 1048576"), "{e}");
        // A U8 array of one byte per element parses to 32 bytes per element: the metadata budget
        // refuses it before the array is allocated, naming the key.
        let n = MAX_METADATA_VALUES + 1;
        let mut b = raw_header(3, 0, 1);
        let mut payload = vtype::U8.to_le_bytes().to_vec();
        payload.extend_from_slice(&n.to_le_bytes());
        raw_kv(&mut b, b"tokenizer.ggml.precompiled_charsmap", vtype::ARRAY, &payload);
        b.resize(b.len() + n as usize, 0);
        let e = err(b);
        assert!(e.contains("'tokenizer.ggml.precompiled_charsmap'") && e.contains("metadata values"), "{e}");
        // The budget is shared: two arrays of 5M values each fit the file but not the budget.
        let half: usize = 5 << 20;
        let mut b = raw_header(3, 0, 2);
        for key in [&b"a"[..], b"b"] {
            let mut payload = vtype::U8.to_le_bytes().to_vec();
            payload.extend_from_slice(&(half as u64).to_le_bytes());
            payload.resize(payload.len() + half, 1);
            raw_kv(&mut b, key, vtype::ARRAY, &payload);
        }
        let e = err(b);
        assert!(e.contains("metadata key 'b'") && e.contains("metadata values"), "{e}");
        // Nested empty arrays (12 bytes each in the file) count against the same budget.
        let mut b = raw_header(3, 0, 1);
        let mut payload = vtype::ARRAY.to_le_bytes().to_vec();
        payload.extend_from_slice(&n.to_le_bytes());
        raw_kv(&mut b, b"nested", vtype::ARRAY, &payload);
        b.resize(b.len() + 12 * n as usize, 0);
        let e = err(b);
        assert!(e.contains("'nested'") && e.contains("metadata values"), "{e}");
        // Counts and lengths beyond the bytes left in the file.
        let e = err(raw_header(3, 1_000_000_000, 0));
        assert!(e.contains("1000000000 tensors") && e.contains("cannot fit"), "{e}");
    }

    #[test]
    fn gguf_from_bytes_equals_open() {
        let mut rng = Rng(7);
        let (bytes, _) = sample_file_bytes(&mut rng);
        let tmp = TempPath::with("bytes", &bytes);
        let a = GgufFile::open(&tmp.0).unwrap();
        let b = GgufFile::from_bytes(&tmp.0, bytes).unwrap();
        assert_eq!((&a.metadata, &a.tensors), (&b.metadata, &b.tensors));
        for t in &a.tensors {
            assert_eq!(a.tensor_data(t), b.tensor_data(t));
        }
    }

    /// Every type a `BlockMatrix` holds decodes its rows exactly as `dequantize` decodes the
    /// tensor, through a row map too; the sample blocks are finite.
    #[test]
    fn block_matrix_rows_equal_dequantized_tensor() {
        use GgmlType::*;
        let types = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, IQ4NL, IQ4XS, TQ1_0, TQ2_0];
        for (i, ty) in types.into_iter().enumerate() {
            assert!(BlockMatrix::supports(ty), "{ty}");
            let (rows, cols) = (5, 512);
            let data = sample_blocks(ty, rows * cols, 0.01, i as u64).unwrap();
            let mut full = vec![0f32; rows * cols];
            dequantize(ty, &data, &mut full).unwrap();
            assert!(full.iter().all(|v| v.is_finite() && v.abs() < 100.0), "{ty}");
            let map = vec![3, 0, 4, 1, 2];
            let m = BlockMatrix::new("w", ty, rows, cols, Bytes::from_vec(data.clone()), Some(map.clone())).unwrap();
            let mut got = vec![0f32; 3 * cols];
            m.decode_rows(1, 3, &mut got).unwrap();
            for (k, r) in (1..4).enumerate() {
                let src = map[r] as usize;
                assert_eq!(got[k * cols..(k + 1) * cols], full[src * cols..(src + 1) * cols], "{ty} row {r}");
            }
            assert_eq!(m.stored_bytes(), data.len());
            // Columns gathered across block boundaries: logical column c reads stored (7c + 3) mod cols.
            let cmap: Vec<u32> = (0..cols).map(|c| ((7 * c + 3) % cols) as u32).collect();
            let m = m.with_col_map(cmap.clone()).unwrap();
            m.decode_rows(2, 1, &mut got[..cols]).unwrap();
            let src = map[2] as usize * cols;
            assert!(cmap.iter().enumerate().all(|(c, &s)| got[c] == full[src + s as usize]), "{ty} columns");
        }
        let m = |map: Vec<u32>| {
            let data = sample_blocks(Q8_0, 64, 0.01, 0).unwrap();
            BlockMatrix::new("w", Q8_0, 1, 64, Bytes::from_vec(data), None).unwrap().with_col_map(map)
        };
        let err = format!("{:#}", m(vec![0; 64]).unwrap_err());
        assert!(err.contains("tensor w: column map is not a permutation of its 64 columns"), "{err}");
        assert!(m((0..63).collect()).is_err() && m((0..64).rev().collect()).is_ok());
        for ty in [F32, F64, Other(99)] {
            assert!(!BlockMatrix::supports(ty) && sample_blocks(ty, 32, 1.0, 0).is_none(), "{ty}");
        }
        // 16-bit floats are held as they are stored too.
        let halves: Vec<half::f16> = (0..64).map(|i| half::f16::from_f32(i as f32 / 8.0 - 3.0)).collect();
        let data: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
        let m = BlockMatrix::new("h", F16, 2, 32, Bytes::from_vec(data), Some(vec![1, 0])).unwrap();
        let mut got = vec![0f32; 64];
        m.decode_rows(0, 2, &mut got).unwrap();
        let want: Vec<f32> = halves[32..].iter().chain(&halves[..32]).map(|h| h.to_f32()).collect();
        assert!(BlockMatrix::supports(BF16) && got == want);
    }

    /// A truncated, mis-sized or misdescribed block tensor is an error naming the tensor, never
    /// a panic, whether built directly or read from a file.
    #[test]
    fn bad_block_tensors_are_errors_naming_the_tensor() {
        let data = sample_blocks(GgmlType::Q4K, 4 * 256, 0.01, 1).unwrap();
        let err = |r: Result<BlockMatrix>| format!("{:#}", r.expect_err("expected an error"));
        let short = Bytes::from_vec(data[..data.len() - 1].to_vec());
        let msg = err(BlockMatrix::new("blk.0.ffn_up.weight", GgmlType::Q4K, 4, 256, short, None));
        assert!(msg.contains("blk.0.ffn_up.weight") && msg.contains("truncated"), "{msg}");
        let msg = err(BlockMatrix::new("w.odd", GgmlType::Q4K, 8, 128, Bytes::from_vec(data.clone()), None));
        assert!(msg.contains("w.odd") && msg.contains("block"), "{msg}");
        let msg = err(BlockMatrix::new("w.f32", GgmlType::F32, 4, 4, Bytes::from_vec(vec![0; 64]), None));
        assert!(msg.contains("w.f32"), "{msg}");
        let msg = err(BlockMatrix::new(
            "w.map",
            GgmlType::Q4K,
            4,
            256,
            Bytes::from_vec(data.clone()),
            Some(vec![0, 1, 1, 3]),
        ));
        assert!(msg.contains("w.map") && msg.contains("permutation"), "{msg}");
        let m = BlockMatrix::new("w.ok", GgmlType::Q4K, 4, 256, Bytes::from_vec(data.clone()), None).unwrap();
        let msg = format!("{:#}", m.decode_rows(3, 2, &mut vec![0f32; 512]).unwrap_err());
        assert!(msg.contains("w.ok"), "{msg}");

        // From a file: a 3-D block tensor is refused by name; a truncated file at open.
        let p = TempPath::new("blocks");
        let q8 = sample_blocks(GgmlType::Q8_0, 2 * 2 * 32, 0.01, 2).unwrap();
        let tensors = vec![
            ("cube".to_string(), vec![32, 2, 2], GgmlType::Q8_0, q8.clone()),
            ("mat".to_string(), vec![256, 4], GgmlType::Q4K, data.clone()),
        ];
        write_gguf(&p.0, &[], &tensors).unwrap();
        let f = GgufFile::open(&p.0).unwrap();
        assert_one_line_err(f.block_matrix("cube", None), &p.0, "cube");
        assert_one_line_err(f.block_matrix("nope", None), &p.0, "nope");
        let m = f.block_matrix("mat", None).unwrap().expect("Q4_K is held in blocks");
        assert_eq!((m.rows, m.cols, m.ty), (4, 256, GgmlType::Q4K));
        let bytes = std::fs::read(&p.0).unwrap();
        std::fs::write(&p.0, &bytes[..bytes.len() - 100]).unwrap();
        assert_one_line_err(GgufFile::open(&p.0), &p.0, "mat");
    }
}
