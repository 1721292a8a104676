//! Evaluation text: a spec of files with byte limits, concatenated as raw bytes and decoded the way
//! llama.cpp decodes them.
//!
//! Spec syntax: `FILE[:MAX_BYTES][,FILE[:MAX_BYTES]...]`, e.g. `eval/prose.txt:81920,eval/code.txt:81920`.
//! Relative paths resolve against a base directory (`--data-dir`) when one is given, else the
//! current directory. A `:N` suffix counts only when N is all digits, so other colons in a path
//! survive; a path containing a comma cannot be named.
//!
//! llama-perplexity reads its file into a `std::string` and tokenizes those bytes. A byte cut can
//! split a multi-byte character; llama.cpp's `unicode_cpts_from_utf8` then turns every byte that
//! does not start a well-formed sequence into its own U+FFFD (one per byte, where Rust's
//! `from_utf8_lossy` would write one per maximal invalid subpart). [`decode_like_llama_cpp`]
//! reproduces that rule, so Forge's tokenizer (which takes `&str`) sees the same code points.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextPart {
    pub path: PathBuf,
    /// Use at most this many leading bytes of the file (the file must have at least that many).
    pub max_bytes: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextSpec {
    pub parts: Vec<TextPart>,
}

/// What was read for one part, recorded in reference headers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PartInfo {
    pub path: String,
    pub max_bytes: Option<usize>,
    pub file_bytes: u64,
    pub bytes_used: usize,
    pub sha256: String,
}

/// The concatenated bytes of a spec.
#[derive(Clone, Debug)]
pub struct TextBytes {
    /// The spec with resolved paths (`/abs/prose.txt:81920,...`): re-parsing it reads the same bytes.
    pub spec: String,
    pub parts: Vec<PartInfo>,
    pub bytes: Vec<u8>,
}

impl TextBytes {
    pub fn sha256(&self) -> String {
        sha256_hex(&self.bytes)
    }
}

impl TextSpec {
    pub fn parse(spec: &str, base: Option<&Path>) -> Result<Self> {
        let mut parts = Vec::new();
        for item in spec.split(',') {
            let item = item.trim();
            if item.is_empty() {
                bail!("text spec '{spec}': empty entry (expected FILE[:MAX_BYTES][,FILE[:MAX_BYTES]...])");
            }
            let (path, max_bytes) = match item.rsplit_once(':') {
                Some((p, n)) if !p.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                    let n: usize =
                        n.parse().with_context(|| format!("text spec '{spec}': byte limit '{n}' is too large"))?;
                    if n == 0 {
                        bail!("text spec '{spec}': byte limit of '{p}' is 0");
                    }
                    (p, Some(n))
                }
                _ => (item, None),
            };
            let p = Path::new(path);
            let path = match base {
                Some(b) if p.is_relative() => b.join(p),
                _ => p.to_path_buf(),
            };
            parts.push(TextPart { path, max_bytes });
        }
        Ok(TextSpec { parts })
    }

    /// The spec string with the paths as resolved.
    pub fn to_spec_string(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p.max_bytes {
                Some(n) => format!("{}:{n}", p.path.display()),
                None => p.path.display().to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn read(&self) -> Result<TextBytes> {
        let mut bytes = Vec::new();
        let mut infos = Vec::new();
        for part in &self.parts {
            let data = std::fs::read(&part.path).with_context(|| format!("{}: cannot read", part.path.display()))?;
            let file_bytes = data.len() as u64;
            let used = match part.max_bytes {
                Some(n) if n > data.len() => bail!(
                    "{}: the text spec asks for its first {n} bytes but the file has only {}",
                    part.path.display(),
                    data.len()
                ),
                Some(n) => &data[..n],
                None => &data[..],
            };
            let abs = std::fs::canonicalize(&part.path).unwrap_or_else(|_| part.path.clone());
            infos.push(PartInfo {
                path: abs.display().to_string(),
                max_bytes: part.max_bytes,
                file_bytes,
                bytes_used: used.len(),
                sha256: sha256_hex(used),
            });
            bytes.extend_from_slice(used);
        }
        if bytes.is_empty() {
            bail!("text spec '{}' yields no bytes", self.to_spec_string());
        }
        let spec = infos
            .iter()
            .map(|i| match i.max_bytes {
                Some(n) => format!("{}:{n}", i.path),
                None => i.path.clone(),
            })
            .collect::<Vec<_>>()
            .join(",");
        Ok(TextBytes { spec, parts: infos, bytes })
    }
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes decoded to text as llama.cpp's tokenizer front end sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    pub text: String,
    /// Bytes that did not start a well-formed sequence; each became one U+FFFD, as in llama.cpp.
    pub invalid_bytes: usize,
    /// Sequences llama.cpp accepts but that are no Unicode scalar value (UTF-16 surrogates, code
    /// points above U+10FFFF). llama.cpp passes surrogates on as raw bytes and fails on the others;
    /// a Rust string can hold neither, so each becomes U+FFFD here and the tokenization differs
    /// from llama.cpp's at that spot. Callers warn when this is non-zero.
    pub unrepresentable: usize,
}

/// llama.cpp's `unicode_cpt_from_utf8`: lenient (accepts overlong forms and surrogates), and a
/// failure consumes one byte.
fn cpt_from_utf8(b: &[u8], off: usize) -> Option<(u32, usize)> {
    let c0 = b[off] as u32;
    let cont = |i: usize| b.get(off + i).filter(|&&c| c & 0xc0 == 0x80).map(|&c| (c & 0x3f) as u32);
    if c0 & 0x80 == 0 {
        return Some((c0, 1));
    }
    if c0 & 0x40 == 0 {
        return None;
    }
    if c0 & 0x20 == 0 {
        let c1 = cont(1)?;
        return Some((((c0 & 0x1f) << 6) | c1, 2));
    }
    if c0 & 0x10 == 0 {
        let (c1, c2) = (cont(1)?, cont(2)?);
        return Some((((c0 & 0x0f) << 12) | (c1 << 6) | c2, 3));
    }
    if c0 & 0x08 == 0 {
        let (c1, c2, c3) = (cont(1)?, cont(2)?, cont(3)?);
        return Some((((c0 & 0x07) << 18) | (c1 << 12) | (c2 << 6) | c3, 4));
    }
    None
}

pub fn decode_like_llama_cpp(bytes: &[u8]) -> Decoded {
    // Fast path: valid UTF-8 decodes identically under both rules.
    if let Ok(s) = std::str::from_utf8(bytes) {
        return Decoded { text: s.to_string(), invalid_bytes: 0, unrepresentable: 0 };
    }
    let mut text = String::with_capacity(bytes.len() + 16);
    let (mut invalid_bytes, mut unrepresentable) = (0, 0);
    let mut off = 0;
    while off < bytes.len() {
        match cpt_from_utf8(bytes, off) {
            Some((cpt, n)) => {
                match char::from_u32(cpt) {
                    Some(c) => text.push(c),
                    None => {
                        text.push('\u{FFFD}');
                        unrepresentable += 1;
                    }
                }
                off += n;
            }
            None => {
                text.push('\u{FFFD}');
                invalid_bytes += 1;
                off += 1;
            }
        }
    }
    Decoded { text, invalid_bytes, unrepresentable }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        let s = TextSpec::parse("eval/prose.txt:81920,eval/code.txt:81920", Some(Path::new("/d"))).unwrap();
        assert_eq!(
            s.parts,
            vec![
                TextPart { path: "/d/eval/prose.txt".into(), max_bytes: Some(81920) },
                TextPart { path: "/d/eval/code.txt".into(), max_bytes: Some(81920) },
            ]
        );
        assert_eq!(s.to_spec_string(), "/d/eval/prose.txt:81920,/d/eval/code.txt:81920");
        // Absolute paths ignore the base; a non-numeric suffix is part of the path.
        let s = TextSpec::parse("/x/a.txt,b:c.txt", Some(Path::new("/d"))).unwrap();
        assert_eq!(s.parts[0], TextPart { path: "/x/a.txt".into(), max_bytes: None });
        assert_eq!(s.parts[1], TextPart { path: "/d/b:c.txt".into(), max_bytes: None });
        assert!(TextSpec::parse("a.txt,,b.txt", None).is_err());
        assert!(TextSpec::parse("a.txt:0", None).is_err());
        assert!(TextSpec::parse("a.txt:99999999999999999999999", None).is_err());
    }

    #[test]
    fn reading_concatenates_and_checks_limits() {
        let dir = std::env::temp_dir().join(format!("forge-eval-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.txt"), b"hello world").unwrap();
        std::fs::write(dir.join("b.txt"), "\u{20ac}uro".as_bytes()).unwrap();
        let t = TextSpec::parse("a.txt:5,b.txt:2", Some(&dir)).unwrap().read().unwrap();
        assert_eq!(t.bytes, b"hello\xe2\x82");
        assert_eq!(t.parts[1].bytes_used, 2);
        assert_eq!(t.parts[1].file_bytes, 6);
        // The resolved spec reads the same bytes again.
        assert_eq!(TextSpec::parse(&t.spec, None).unwrap().read().unwrap().bytes, t.bytes);
        let e = TextSpec::parse("a.txt:100", Some(&dir)).unwrap().read().unwrap_err();
        assert!(format!("{e:#}").contains("only 11"), "{e:#}");
        let e = TextSpec::parse("missing.txt", Some(&dir)).unwrap().read().unwrap_err();
        assert!(format!("{e:#}").contains("missing.txt"), "{e:#}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn invalid_utf8_like_llama_cpp() {
        // A euro sign cut after two of its three bytes: llama.cpp gives one U+FFFD per byte.
        let d = decode_like_llama_cpp(b"ab\xe2\x82");
        assert_eq!(d.text, "ab\u{FFFD}\u{FFFD}");
        assert_eq!(d.invalid_bytes, 2);
        assert_eq!(String::from_utf8_lossy(b"ab\xe2\x82"), "ab\u{FFFD}"); // Rust's rule differs
                                                                          // A stray continuation byte in the middle, then valid text resumes.
        let d = decode_like_llama_cpp(b"x\x80y\xc3\xa9");
        assert_eq!(d.text, "x\u{FFFD}y\u{e9}");
        // Overlong NUL is accepted by llama.cpp's decoder.
        assert_eq!(decode_like_llama_cpp(b"\xc0\x80a").text, "\0a");
        // A surrogate: accepted by llama.cpp, not representable in Rust.
        let d = decode_like_llama_cpp(b"\xed\xa0\x80z");
        assert_eq!((d.text.as_str(), d.invalid_bytes, d.unrepresentable), ("\u{FFFD}z", 0, 1));
        // Four-byte sequence and a 0xF8 lead byte.
        assert_eq!(decode_like_llama_cpp(b"\xf0\x9f\x98\x80\xf8").text, "\u{1F600}\u{FFFD}");
        assert_eq!(decode_like_llama_cpp("plain é".as_bytes()).text, "plain é");
    }
}
