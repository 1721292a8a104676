//! Writing exports in ANEMLL Forge's layout (see docs/export.md): per-layer safetensors
//! (`layer_NN.safetensors` for the MLP, `layer_NN_mixer.safetensors` for the token mixer,
//! `lm_head.safetensors`, `embed.safetensors` for an untied embedding) plus `forge.json`, which
//! is written last: an export directory without it is incomplete.

use crate::quantize_matrix::QuantMatrix;
use anyhow::{anyhow, bail, Context, Result};
use forge_core::fsutil::write_atomic_with;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// One matrix of an export file.
pub struct MatrixEntry {
    /// Key inside the file: the module path within the layer (`mlp.gate_proj`,
    /// `self_attn.k_proj`, `linear_attn.in_proj_qkv`) or `lm_head`.
    pub key: String,
    pub q: QuantMatrix,
    /// Online input rotation: (seed, block).
    pub rotation: Option<(u64, usize)>,
    /// Low-rank factors `A (cout × r)`, `B (r × cin)`, stored as FP16.
    pub lowrank: Option<(usize, Vec<f32>, Vec<f32>)>,
    /// Extra per-matrix metadata (`snr_db`, `heldout_snr_db`, …).
    pub stats: BTreeMap<String, String>,
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect()
}

/// File name for a canonical matrix name (`layers.3.mlp.up_proj` → (`layer_03.safetensors`,
/// `mlp.up_proj`)).
pub fn file_and_key(canonical: &str) -> Result<(String, String)> {
    forge_model::export::file_and_key(canonical).ok_or_else(|| anyhow!("no export file for matrix {canonical}"))
}

/// Serialize entries into one safetensors file (atomically). The bytes are streamed to disk
/// (index and INT8 tensors are not copied), in the deterministic layout of [`serialize`].
pub fn write_file(path: &Path, kind: &str, entries: &[MatrixEntry], extra: &BTreeMap<String, String>) -> Result<()> {
    let (specs, data, meta) = file_tensors(kind, entries, extra);
    write_streaming(path, &specs, &meta, |i, w| {
        w.write_all(&data[i])?;
        Ok(())
    })
    .with_context(|| format!("writing {}", path.display()))
}

/// The tensors (name, dtype, shape), their bytes and the metadata of one export file.
#[allow(clippy::type_complexity)]
fn file_tensors<'a>(
    kind: &str,
    entries: &'a [MatrixEntry],
    extra: &BTreeMap<String, String>,
) -> (Vec<TensorSpec>, Vec<Cow<'a, [u8]>>, BTreeMap<String, String>) {
    let mut specs: Vec<TensorSpec> = Vec::new();
    let mut data: Vec<Cow<'a, [u8]>> = Vec::new();
    let mut push = |name: String, dtype: Dtype, shape: Vec<usize>, bytes: Cow<'a, [u8]>| {
        specs.push(TensorSpec { name, dtype, shape });
        data.push(bytes);
    };
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    meta.insert("kind".into(), kind.into());
    for (k, v) in extra {
        meta.insert(k.clone(), v.clone());
    }
    for e in entries {
        let key = &e.key;
        let (cout, cin) = e.q.shape();
        meta.insert(format!("{key}.format"), e.q.format().long_name().into());
        match &e.q {
            QuantMatrix::Lut(m) => {
                let d = m.format.vec_dim();
                push(format!("{key}.lut"), Dtype::F16, vec![m.format.entries(), d], f16_bytes(&m.codebook).into());
                push(format!("{key}.idx"), Dtype::U8, vec![cout / d, cin], Cow::Borrowed(&m.idx[..]));
                push(format!("{key}.scale"), Dtype::F16, vec![cout], f16_bytes(&m.scale).into());
            }
            QuantMatrix::Int8(m) => {
                let q: Vec<u8> = m.q.iter().map(|&v| v as u8).collect();
                push(format!("{key}.int8"), Dtype::I8, vec![cout, cin], q.into());
                push(format!("{key}.scale"), Dtype::F16, vec![cout], f16_bytes(&m.scale).into());
            }
            QuantMatrix::Float { format, data, .. } => {
                let (dt, bytes) = match format {
                    forge_kernels::lut::Format::F16 => (Dtype::F16, f16_bytes(data)),
                    _ => (Dtype::BF16, data.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()),
                };
                push(format!("{key}.weight"), dt, vec![cout, cin], bytes.into());
            }
        }
        if let Some((seed, block)) = e.rotation {
            meta.insert(format!("{key}.rotation_seed"), seed.to_string());
            meta.insert(format!("{key}.rotation_block"), block.to_string());
        }
        if let Some((r, a, b)) = &e.lowrank {
            push(format!("{key}.lr_a"), Dtype::F16, vec![cout, *r], f16_bytes(a).into());
            push(format!("{key}.lr_b"), Dtype::F16, vec![*r, cin], f16_bytes(b).into());
        }
        for (k, v) in &e.stats {
            meta.insert(format!("{key}.{k}"), v.clone());
        }
    }
    (specs, data, meta)
}

/// One tensor of a safetensors file, before its bytes exist.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn byte_len(&self) -> usize {
        let elem = match self.dtype {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::F16 | Dtype::BF16 => 2,
            _ => 4,
        };
        self.shape.iter().product::<usize>() * elem
    }
}

fn dtype_name(dt: Dtype) -> &'static str {
    match dt {
        Dtype::F16 => "F16",
        Dtype::BF16 => "BF16",
        Dtype::U8 => "U8",
        Dtype::I8 => "I8",
        _ => "F32",
    }
}

/// The deterministic header (tensors in name order, metadata first, padded to 8 bytes) and the
/// order in which the tensors' bytes follow it.
fn header(specs: &[TensorSpec], meta: &BTreeMap<String, String>) -> (Vec<u8>, Vec<usize>) {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| specs[a].name.cmp(&specs[b].name));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(meta).unwrap());
    let mut offset = 0usize;
    for &i in &order {
        let s = &specs[i];
        let n = s.byte_len();
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": dtype_name(s.dtype), "shape": s.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    (out, order)
}

/// Counts what passes through to the file.
struct Counting<'a> {
    inner: &'a mut dyn Write,
    n: usize,
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Write a safetensors file atomically without holding it in memory: after the header,
/// `fill(i, w)` writes the bytes of `specs[i]` (called in name order, the layout of
/// [`serialize`]); a tensor that receives the wrong number of bytes is an error.
pub fn write_streaming(
    path: &Path,
    specs: &[TensorSpec],
    meta: &BTreeMap<String, String>,
    mut fill: impl FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let (head, order) = header(specs, meta);
    write_atomic_with(path, |w| {
        w.write_all(&head)?;
        for i in order {
            let mut c = Counting { inner: &mut *w, n: 0 };
            fill(i, &mut c)?;
            if c.n != specs[i].byte_len() {
                bail!("tensor '{}': {} bytes written, its shape needs {}", specs[i].name, c.n, specs[i].byte_len());
            }
        }
        Ok(())
    })
}

#[cfg(test)]
/// safetensors bytes with a deterministic header (tensors and metadata in sorted order, header
/// padded to 8 bytes), so that the same quantization always produces the same file.
fn serialize(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)], meta: &BTreeMap<String, String>) -> Vec<u8> {
    let specs: Vec<TensorSpec> =
        tensors.iter().map(|(n, d, s, _)| TensorSpec { name: n.clone(), dtype: *d, shape: s.clone() }).collect();
    let (mut out, order) = header(&specs, meta);
    for &i in &order {
        out.extend_from_slice(&tensors[i].3);
    }
    out
}

/// Embedding rows converted per step by [`write_embedding`].
const EMBED_ROWS: usize = 4096;

/// Write an FP16 embedding table (untied models), `row(t, out)` giving token `t`'s row; streamed
/// a few thousand rows at a time, so a 248,320 × 5,120 table never sits in memory.
pub fn write_embedding(
    path: &Path,
    vocab: usize,
    hidden: usize,
    row: impl Fn(usize, &mut [f32]) -> Result<()>,
) -> Result<()> {
    let spec = [TensorSpec { name: "embed_tokens.weight".into(), dtype: Dtype::F16, shape: vec![vocab, hidden] }];
    let meta: BTreeMap<String, String> = [("kind".to_string(), "embed".to_string())].into();
    write_streaming(path, &spec, &meta, |_, w| {
        let mut buf = vec![0f32; EMBED_ROWS * hidden];
        for t0 in (0..vocab).step_by(EMBED_ROWS) {
            let n = EMBED_ROWS.min(vocab - t0);
            for (i, r) in buf[..n * hidden].chunks_mut(hidden).enumerate() {
                row(t0 + i, r)?;
            }
            w.write_all(&f16_bytes(&buf[..n * hidden]))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_kernels::lut::{Format, Int8Matrix, LutMatrix};

    /// The streaming writer produces exactly the bytes of the in-memory serializer.
    #[test]
    fn streamed_file_equals_serialized_bytes() {
        let lut = LutMatrix {
            format: Format::Vec2x16,
            cout: 4,
            cin: 3,
            codebook: (0..32).map(|i| i as f32 / 8.0 - 2.0).collect(),
            idx: vec![1, 2, 3, 4, 5, 15].into(),
            scale: vec![0.5, 0.25, 1.0, 2.0],
        };
        let i8m = Int8Matrix { cout: 2, cin: 3, q: vec![-127, 0, 5, 127, -1, 3], scale: vec![0.125, 0.5] };
        let entries = vec![
            MatrixEntry {
                key: "mlp.up_proj".into(),
                q: QuantMatrix::Lut(lut),
                rotation: Some((1003, 1)),
                lowrank: Some((1, vec![0.5; 4], vec![0.25; 3])),
                stats: [("snr_db".to_string(), "1.0".to_string())].into(),
            },
            MatrixEntry {
                key: "self_attn.k_proj".into(),
                q: QuantMatrix::Int8(i8m),
                rotation: None,
                lowrank: None,
                stats: BTreeMap::new(),
            },
            MatrixEntry {
                key: "linear_attn.in_proj_a".into(),
                q: QuantMatrix::Float { format: Format::Bf16, cout: 1, cin: 2, data: vec![1.5, -2.0] },
                rotation: None,
                lowrank: None,
                stats: BTreeMap::new(),
            },
        ];
        let extra: BTreeMap<String, String> = [("format".to_string(), "x".to_string())].into();
        let path = std::env::temp_dir().join(format!("forge-export-stream-{}.safetensors", std::process::id()));
        write_file(&path, "mixer", &entries, &extra).unwrap();
        let (specs, data, meta) = file_tensors("mixer", &entries, &extra);
        let owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> =
            specs.iter().zip(&data).map(|(s, d)| (s.name.clone(), s.dtype, s.shape.clone(), d.to_vec())).collect();
        assert_eq!(std::fs::read(&path).unwrap(), serialize(&owned, &meta));
        let st = safetensors::SafeTensors::deserialize(&serialize(&owned, &meta)).unwrap().names().len();
        assert_eq!(st, 8);
        let bad = [TensorSpec { name: "t".into(), dtype: Dtype::U8, shape: vec![3] }];
        let e = write_streaming(&path, &bad, &meta, |_, w| Ok(w.write_all(&[1, 2])?)).unwrap_err();
        assert!(e.to_string().contains("2 bytes written"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }

    /// An export's LUT indices are read as views of the file's mapping, not copied: two reads
    /// of one matrix see the same bytes at the same address (a copy would be a new allocation
    /// each time), equal to what was written.
    #[test]
    fn export_indices_stay_in_the_mapping() {
        use forge_model::linear::Weight;
        let idx: Vec<u8> = (0..48 * 64).map(|i| (i * 7 % 64) as u8).collect();
        let lut = LutMatrix {
            format: Format::Vec2x64,
            cout: 96,
            cin: 64,
            codebook: (0..128).map(|i| (i as f32 - 64.0) / 32.0).collect(),
            idx: idx.clone().into(),
            scale: vec![0.5; 96],
        };
        let entry = MatrixEntry {
            key: "mlp.up_proj".into(),
            q: QuantMatrix::Lut(lut),
            rotation: None,
            lowrank: None,
            stats: BTreeMap::new(),
        };
        let dir = std::env::temp_dir().join(format!("forge-export-mapped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_file(&dir.join("layer_00.safetensors"), "mlp", &[entry], &BTreeMap::new()).unwrap();
        let ex = forge_model::export::Export::open_partial(&dir).unwrap();
        let read = || match ex.linear("layers.0.mlp.up_proj", 96, 64).unwrap().expect("stored").weight {
            Weight::Lut(m) => m,
            _ => panic!("not a LUT weight"),
        };
        let (a, b) = (read(), read());
        assert_eq!(&a.idx[..], &idx[..]);
        assert_eq!(a.idx.as_ptr(), b.idx.as_ptr(), "indices copied on read");
        // The refusal's estimate is the size packing gives.
        let [(file, key, cout, cin)] = &ex.quantized_matrices().unwrap()[..] else { panic!("one matrix") };
        let packed = ex.packed(file, key, *cout, *cin).unwrap();
        assert_eq!(ex.packing_bytes(), packed.packed_bytes() as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
