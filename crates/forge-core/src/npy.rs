//! Minimal `.npy` (format 1.0) reading and writing of little-endian f32 arrays.

use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;

/// Serialize an f32 array of `shape` as `.npy` bytes.
pub fn to_npy_bytes(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Pad so that magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for x in data {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Write atomically (temp file + rename).
pub fn write_npy(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    crate::fsutil::write_atomic(path, &to_npy_bytes(shape, data))
}

/// Read a little-endian f32 `.npy` file (C order).
pub fn read_npy(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    parse_npy(&bytes).with_context(|| format!("{}", path.display()))
}

pub fn parse_npy(bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>)> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        bail!("not an .npy file");
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                bail!("truncated .npy header");
            }
            (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12)
        }
        v => bail!("unsupported .npy version {v}"),
    };
    let header =
        std::str::from_utf8(bytes.get(hstart..hstart + hlen).ok_or_else(|| anyhow!("truncated .npy header"))?)?;
    if !header.contains("'descr': '<f4'") {
        bail!("only little-endian f32 arrays are supported (header {header})");
    }
    if header.contains("'fortran_order': True") {
        bail!("Fortran-order arrays are not supported");
    }
    let s = header.find("'shape': (").ok_or_else(|| anyhow!("no shape in header"))? + 10;
    let e = s + header[s..].find(')').ok_or_else(|| anyhow!("bad shape in header"))?;
    let shape: Vec<usize> = header[s..e]
        .split(',')
        .map(|d| d.trim())
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().map_err(|_| anyhow!("bad dimension '{d}'")))
        .collect::<Result<_>>()?;
    let n: usize = shape.iter().product();
    let data = &bytes[hstart + hlen..];
    if data.len() != n * 4 {
        bail!("expected {} data bytes for shape {:?}, found {}", n * 4, shape, data.len());
    }
    Ok((shape, data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn round_trip() {
        let d: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b = to_npy_bytes(&[3, 4], &d);
        assert_eq!((10 + u16::from_le_bytes([b[8], b[9]]) as usize) % 64, 0);
        let (s, back) = parse_npy(&b).unwrap();
        assert_eq!(s, vec![3, 4]);
        assert_eq!(back, d);
        assert!(parse_npy(&b[..b.len() - 1]).is_err());
    }
}
