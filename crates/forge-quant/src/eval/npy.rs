//! `.npy` (format 1.0) for the reference files: little-endian `<f4` and `<i4` arrays, written
//! whole or streamed row block by row block (the full-vocabulary file is ~1 GB), read whole or
//! by row range. `numpy.load(path, mmap_mode="r")` opens every file the reference writes.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    I32,
}

impl Dtype {
    pub fn descr(self) -> &'static str {
        match self {
            Dtype::F32 => "<f4",
            Dtype::I32 => "<i4",
        }
    }
}

pub fn header(dtype: Dtype, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut h = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape_s}, }}", dtype.descr());
    let total = 10 + h.len() + 1;
    h.push_str(&" ".repeat((64 - total % 64) % 64));
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out
}

pub fn f32_bytes(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(data: &[i32]) -> Vec<u8> {
    data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Complete `.npy` bytes.
pub fn to_bytes_f32(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let mut b = header(Dtype::F32, shape);
    b.extend(f32_bytes(data));
    b
}

pub fn to_bytes_i32(shape: &[usize], data: &[i32]) -> Vec<u8> {
    let mut b = header(Dtype::I32, shape);
    b.extend(i32_bytes(data));
    b
}

/// Parsed header: dtype, shape and where the data starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data_offset: usize,
}

pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        bail!("not an .npy file");
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => bail!("unsupported .npy version {v}"),
    };
    let h = bytes.get(start..start + hlen).context("truncated .npy header")?;
    let h = std::str::from_utf8(h).context(".npy header is not UTF-8")?;
    let dtype = if h.contains("'descr': '<f4'") {
        Dtype::F32
    } else if h.contains("'descr': '<i4'") {
        Dtype::I32
    } else {
        bail!("unsupported .npy dtype (header {h})");
    };
    if h.contains("'fortran_order': True") {
        bail!("Fortran-order arrays are not supported");
    }
    let s = h.find("'shape': (").context("no shape in .npy header")? + 10;
    let e = s + h[s..].find(')').context("bad shape in .npy header")?;
    let shape = h[s..e]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().with_context(|| format!("bad .npy dimension '{d}'")))
        .collect::<Result<Vec<_>>>()?;
    Ok(Header { dtype, shape, data_offset: start + hlen })
}

fn read_whole(path: &Path, want: Dtype) -> Result<(Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let h = parse_header(&bytes).with_context(|| format!("{}", path.display()))?;
    if h.dtype != want {
        bail!("{}: dtype {} where {} was expected", path.display(), h.dtype.descr(), want.descr());
    }
    let n: usize = h.shape.iter().product();
    let data = &bytes[h.data_offset..];
    if data.len() != n * 4 {
        bail!("{}: shape {:?} needs {} data bytes, the file has {}", path.display(), h.shape, n * 4, data.len());
    }
    Ok((h.shape, data.to_vec()))
}

pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let (shape, d) = read_whole(path, Dtype::F32)?;
    Ok((shape, d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

pub fn read_i32(path: &Path) -> Result<(Vec<usize>, Vec<i32>)> {
    let (shape, d) = read_whole(path, Dtype::I32)?;
    Ok((shape, d.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

/// Streams rows of a 2-D f32 array into a file whose header was written up front; `finish`
/// checks that exactly the promised number of values arrived.
pub struct RowWriter {
    file: std::io::BufWriter<File>,
    path: std::path::PathBuf,
    expected: usize,
    written: usize,
    hasher: sha2::Sha256,
}

impl RowWriter {
    pub fn create(path: &Path, shape: &[usize]) -> Result<Self> {
        use sha2::Digest;
        let f = File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
        let mut file = std::io::BufWriter::with_capacity(1 << 20, f);
        let h = header(Dtype::F32, shape);
        file.write_all(&h).with_context(|| format!("{}: write failed", path.display()))?;
        let mut hasher = sha2::Sha256::new();
        hasher.update(&h);
        Ok(RowWriter { file, path: path.to_path_buf(), expected: shape.iter().product(), written: 0, hasher })
    }

    pub fn write(&mut self, rows: &[f32]) -> Result<()> {
        use sha2::Digest;
        let b = f32_bytes(rows);
        self.hasher.update(&b);
        self.file.write_all(&b).with_context(|| format!("{}: write failed", self.path.display()))?;
        self.written += rows.len();
        Ok(())
    }

    /// Flushes and syncs; returns (file bytes, sha256 hex).
    pub fn finish(self) -> Result<(u64, String)> {
        use sha2::Digest;
        if self.written != self.expected {
            bail!("{}: wrote {} values, the header promises {}", self.path.display(), self.written, self.expected);
        }
        let path = self.path.clone();
        let f = self.file.into_inner().map_err(|e| e.into_error()).with_context(|| format!("{}", path.display()))?;
        f.sync_all().ok();
        let len = f.metadata().with_context(|| format!("{}", path.display()))?.len();
        Ok((len, super::text::hex(&self.hasher.finalize())))
    }
}

/// Reads row ranges of a 2-D f32 `.npy`, hashing the bytes as they go by so that a complete
/// in-order pass can be checked against the recorded sha256 at the end.
pub struct RowReader {
    file: File,
    path: std::path::PathBuf,
    pub rows: usize,
    pub cols: usize,
    data_offset: u64,
    hasher: sha2::Sha256,
    /// Next row the running hash expects; out-of-order reads disable the check.
    next_row: Option<usize>,
}

impl RowReader {
    pub fn open(path: &Path) -> Result<Self> {
        use sha2::Digest;
        let mut file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let mut head = vec![0u8; 4096];
        let n = file.read(&mut head).with_context(|| format!("{}: cannot read", path.display()))?;
        let h = parse_header(&head[..n]).with_context(|| format!("{}", path.display()))?;
        if h.dtype != Dtype::F32 || h.shape.len() != 2 {
            bail!("{}: expected a 2-D <f4 array, found {} {:?}", path.display(), h.dtype.descr(), h.shape);
        }
        let len = file.metadata().with_context(|| format!("{}", path.display()))?.len();
        let want = h.data_offset as u64 + (h.shape[0] * h.shape[1] * 4) as u64;
        if len != want {
            bail!("{}: {} bytes where shape {:?} needs {want}", path.display(), len, h.shape);
        }
        let mut hasher = sha2::Sha256::new();
        hasher.update(&head[..h.data_offset]);
        Ok(RowReader {
            file,
            path: path.to_path_buf(),
            rows: h.shape[0],
            cols: h.shape[1],
            data_offset: h.data_offset as u64,
            hasher,
            next_row: Some(0),
        })
    }

    pub fn read_rows(&mut self, r0: usize, n: usize, out: &mut Vec<f32>) -> Result<()> {
        use sha2::Digest;
        if r0 + n > self.rows {
            bail!("{}: rows {r0}..{} out of range ({} rows)", self.path.display(), r0 + n, self.rows);
        }
        let mut buf = vec![0u8; n * self.cols * 4];
        self.file
            .seek(SeekFrom::Start(self.data_offset + (r0 * self.cols * 4) as u64))
            .and_then(|_| self.file.read_exact(&mut buf))
            .with_context(|| format!("{}: cannot read rows {r0}..{}", self.path.display(), r0 + n))?;
        if self.next_row == Some(r0) {
            self.hasher.update(&buf);
            self.next_row = Some(r0 + n);
        } else {
            self.next_row = None;
        }
        out.clear();
        out.extend(buf.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        Ok(())
    }

    /// sha256 of the whole file, when every row was read once in order.
    pub fn finished_sha256(self) -> Option<String> {
        use sha2::Digest;
        (self.next_row == Some(self.rows)).then(|| super::text::hex(&self.hasher.finalize()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_streaming() {
        let dir = std::env::temp_dir().join(format!("forge-eval-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        std::fs::write(&p, to_bytes_i32(&[2, 3], &[1, -2, 3, 4, 5, -6])).unwrap();
        assert_eq!(read_i32(&p).unwrap(), (vec![2, 3], vec![1, -2, 3, 4, 5, -6]));
        assert!(read_f32(&p).is_err(), "dtype must be checked");
        // Same bytes as forge-core's f32 writer.
        let d: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        assert_eq!(to_bytes_f32(&[3, 2], &d), forge_core::npy::to_npy_bytes(&[3, 2], &d));

        let q = dir.join("rows.npy");
        let mut w = RowWriter::create(&q, &[3, 2]).unwrap();
        w.write(&d[..4]).unwrap();
        w.write(&d[4..]).unwrap();
        let (len, sha) = w.finish().unwrap();
        let bytes = std::fs::read(&q).unwrap();
        assert_eq!(len as usize, bytes.len());
        assert_eq!(sha, super::super::text::sha256_hex(&bytes));
        let mut r = RowReader::open(&q).unwrap();
        let mut out = Vec::new();
        r.read_rows(0, 1, &mut out).unwrap();
        assert_eq!(out, &d[..2]);
        r.read_rows(1, 2, &mut out).unwrap();
        assert_eq!(out, &d[2..]);
        assert!(r.read_rows(2, 2, &mut out).is_err());
        assert_eq!(r.finished_sha256(), Some(sha));

        let mut short = RowWriter::create(&dir.join("short.npy"), &[3, 2]).unwrap();
        short.write(&d[..2]).unwrap();
        assert!(short.finish().is_err());
        std::fs::write(&q, &bytes[..bytes.len() - 4]).unwrap();
        assert!(RowReader::open(&q).is_err(), "truncated file must be refused");
        std::fs::remove_dir_all(&dir).ok();
    }
}
