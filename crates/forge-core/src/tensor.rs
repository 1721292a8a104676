//! Host tensors that either own f32 data or borrow a memory-mapped checkpoint region.
//!
//! Checkpoint bytes are never copied: a BF16/F16 weight stays in the mapping and kernels convert
//! rows on the fly. Only when a region is misaligned for its element type (possible in
//! safetensors, whose offsets are byte offsets) is it copied once into an owned buffer.

use anyhow::{bail, Result};
use half::{bf16, f16};
use std::sync::Arc;

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    I8,
    U8,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
            DType::I64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::I32 => "I32",
            DType::I64 => "I64",
        }
    }
}

/// A byte range inside a shared owner (a memory map or an owned buffer).
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        Bytes { owner, start, len }
    }
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Bytes { owner: Arc::new(v), start: 0, len }
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Self {
        Bytes::from_vec(v)
    }
}

impl FromIterator<u8> for Bytes {
    fn from_iter<I: IntoIterator<Item = u8>>(it: I) -> Self {
        Bytes::from_vec(it.into_iter().collect())
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}

/// Equal contents, wherever they live.
impl PartialEq for Bytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// Tensor storage: owned f32 or raw (possibly mapped) bytes of a given dtype.
#[derive(Clone)]
pub enum Storage {
    F32(Arc<Vec<f32>>),
    Raw { bytes: Bytes, dtype: DType },
}

/// A named-free tensor: shape (row-major) plus storage.
#[derive(Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub storage: Storage,
}

/// Borrowed view of a float matrix in its stored precision, for kernels.
#[derive(Clone, Copy)]
pub enum FloatSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    F16(&'a [u16]),
}

impl FloatSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(s) => s.len(),
            FloatSlice::BF16(s) | FloatSlice::F16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Convert `range` into f32 values in `out`.
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            FloatSlice::F32(s) => out.copy_from_slice(&s[start..start + n]),
            FloatSlice::BF16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            FloatSlice::F16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f16::from_bits(b).to_f32();
                }
            }
        }
    }
}

impl HostTensor {
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor { shape, storage: Storage::F32(Arc::new(data)) }
    }

    /// Wrap raw bytes; copies once only if misaligned for the element type.
    pub fn from_raw(shape: Vec<usize>, dtype: DType, bytes: Bytes) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n * dtype.size() != bytes.len() {
            bail!(
                "tensor of shape {:?} and dtype {} needs {} bytes, found {}",
                shape,
                dtype.name(),
                n * dtype.size(),
                bytes.len()
            );
        }
        let aligned = (bytes.as_slice().as_ptr() as usize).is_multiple_of(dtype.size());
        let bytes = if aligned { bytes } else { aligned_copy(bytes.as_slice(), dtype.size()) };
        Ok(HostTensor { shape, storage: Storage::Raw { bytes, dtype } })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::F32(_) => DType::F32,
            Storage::Raw { dtype, .. } => *dtype,
        }
    }

    /// The float view for kernels, or an error for integer tensors.
    pub fn floats(&self) -> Result<FloatSlice<'_>> {
        Ok(match &self.storage {
            Storage::F32(v) => FloatSlice::F32(v.as_slice()),
            Storage::Raw { bytes, dtype } => match dtype {
                DType::F32 => FloatSlice::F32(bytemuck::cast_slice(bytes.as_slice())),
                DType::BF16 => FloatSlice::BF16(bytemuck::cast_slice(bytes.as_slice())),
                DType::F16 => FloatSlice::F16(bytemuck::cast_slice(bytes.as_slice())),
                other => bail!("expected a float tensor, found {}", other.name()),
            },
        })
    }

    /// All elements as an owned f32 vector (for small tensors: norms, biases, gates).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        if let Storage::Raw { bytes, dtype } = &self.storage {
            match dtype {
                DType::I8 => return Ok(bytes.as_slice().iter().map(|&b| b as i8 as f32).collect()),
                DType::U8 => return Ok(bytes.as_slice().iter().map(|&b| b as f32).collect()),
                _ => {}
            }
        }
        let f = self.floats()?;
        let mut out = vec![0f32; f.len()];
        f.read_into(0, &mut out);
        Ok(out)
    }

    /// The raw byte range itself (a view of the mapping, not a copy), for holding it.
    pub fn raw(&self) -> Option<&Bytes> {
        match &self.storage {
            Storage::Raw { bytes, .. } => Some(bytes),
            Storage::F32(_) => None,
        }
    }

    /// Raw bytes (for integer tensors such as LUT indices).
    pub fn raw_bytes(&self) -> Option<&[u8]> {
        self.raw().map(|b| b.as_slice())
    }
}

fn aligned_copy(src: &[u8], align: usize) -> Bytes {
    // A Vec<u8> from the global allocator is at least 8-aligned in practice but not guaranteed;
    // copy through a u64 buffer to be sure.
    let words = src.len().div_ceil(8);
    let mut buf = vec![0u64; words];
    bytemuck::cast_slice_mut::<u64, u8>(&mut buf)[..src.len()].copy_from_slice(src);
    debug_assert!(align <= 8);
    struct Words(Vec<u64>, usize);
    impl AsRef<[u8]> for Words {
        fn as_ref(&self) -> &[u8] {
            &bytemuck::cast_slice(&self.0)[..self.1]
        }
    }
    let len = src.len();
    Bytes::new(Arc::new(Words(buf, len)), 0, len)
}

pub fn bf16_to_f32(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}
pub fn f16_to_f32(b: u16) -> f32 {
    f16::from_bits(b).to_f32()
}
