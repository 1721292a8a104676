//! Deterministic mutations for the stable driver: bit flips, byte edits, inserts, deletes,
//! duplications, splices with other corpus inputs, interesting integers written over length
//! fields (binary and decimal), and tokens the text formats give meaning to.

/// splitmix64: small, fast and reproducible from its seed on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// Values that break size arithmetic: zero, one, sign and width boundaries, absurd sizes.
pub const INTERESTING: [u64; 20] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1_000_000_000,
    1_000_000_000_000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
    u64::MAX - 7,
    1 << 62,
];

/// The same in the spelling of the text formats, plus JSON and tag tokens.
pub const INTERESTING_TEXT: [&str; 30] = [
    "0",
    "-1",
    "1e308",
    "-1e308",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775808",
    "1000000000000",
    "0.5",
    "null",
    "[]",
    "{}",
    "\"\"",
    "true",
    "\\u0000",
    "\\ud800",
    "\u{0}",
    "\u{fffd}",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<parameter=",
    "</parameter>",
    "<think>",
    "</think>",
    "<|im_start|>",
    "{{ ",
    "{% ",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
];

/// Inputs are kept to this size: the seeds are a few KiB, and the bugs that matter show at any size.
pub const MAX_LEN: usize = 64 << 10;

/// A position in `v` where a little-endian u64 holds a small non-zero count (a length field of a
/// binary header, e.g. a GGUF string length or a safetensors header size), searching from a
/// random start.
fn length_field(rng: &mut Rng, v: &[u8]) -> Option<usize> {
    if v.len() < 8 {
        return None;
    }
    let start = rng.below(v.len() - 7);
    (start..v.len() - 7).take(512).find(|&i| {
        let x = u64::from_le_bytes(v[i..i + 8].try_into().expect("8 bytes"));
        (1..=1 << 24).contains(&x)
    })
}

/// A run of ASCII digits (a number in a JSON document), searching from a random start.
fn digit_run(rng: &mut Rng, v: &[u8]) -> Option<(usize, usize)> {
    let start = rng.below(v.len());
    let i = (start..v.len()).chain(0..start).find(|&i| v[i].is_ascii_digit())?;
    let mut s = i;
    while s > 0 && v[s - 1].is_ascii_digit() {
        s -= 1;
    }
    let mut e = i;
    while e < v.len() && v[e].is_ascii_digit() {
        e += 1;
    }
    Some((s, e))
}

/// One to four mutations of `base`; `others` supplies material for splices.
pub fn mutate(rng: &mut Rng, base: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = v.len();
        match rng.below(12) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next_u64() as u8;
            }
            2 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                v.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below(64.min(len - at));
                v.drain(at..at + n);
            }
            4 if len > 0 => {
                // Duplicate a range (repeated structures: entries, messages, tags).
                let at = rng.below(len);
                let n = 1 + rng.below(256.min(len - at));
                let piece = v[at..at + n].to_vec();
                let to = rng.below(len + 1);
                v.splice(to..to, piece);
            }
            5 if !others.is_empty() => {
                // Splice: our head, another input's tail.
                let o = &others[rng.below(others.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(o.len() + 1);
                v.truncate(cut);
                v.extend_from_slice(&o[from..]);
            }
            6 | 7 => {
                let x = INTERESTING[rng.below(INTERESTING.len())];
                let width = [1, 2, 4, 8][rng.below(4)];
                let at = if rng.below(2) == 0 { length_field(rng, &v) } else { None };
                let at = at.unwrap_or_else(|| rng.below(len.saturating_sub(width - 1).max(1)));
                if at + width <= v.len() {
                    v[at..at + width].copy_from_slice(&x.to_le_bytes()[..width]);
                }
            }
            8 => {
                let tok = INTERESTING_TEXT[rng.below(INTERESTING_TEXT.len())].as_bytes();
                match digit_run(rng, &v) {
                    Some((s, e)) if tok[0].is_ascii_digit() || tok[0] == b'-' => {
                        v.splice(s..e, tok.iter().copied());
                    }
                    _ => {
                        let at = rng.below(len + 1);
                        v.splice(at..at, tok.iter().copied());
                    }
                }
            }
            9 if len > 0 => v.truncate(rng.below(len)),
            10 if !others.is_empty() && len > 0 => {
                // Overwrite a range with bytes from another input.
                let o = &others[rng.below(others.len())];
                if !o.is_empty() {
                    let from = rng.below(o.len());
                    let n = (1 + rng.below(64)).min(o.len() - from).min(len);
                    let at = rng.below(len - n + 1);
                    v[at..at + n].copy_from_slice(&o[from..from + n]);
                }
            }
            _ => {
                // Swap two bytes.
                if len > 1 {
                    let (a, b) = (rng.below(len), rng.below(len));
                    v.swap(a, b);
                }
            }
        }
    }
    v.truncate(MAX_LEN);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_reproducible_and_varied() {
        let base = b"{\"hidden_size\": 64, \"x\": [1, 2, 3]}\x08\0\0\0\0\0\0\0tail".to_vec();
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..2000).map(|_| mutate(&mut rng, &base, std::slice::from_ref(&base))).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        let outs = run(2);
        let distinct: std::collections::HashSet<_> = outs.iter().collect();
        assert!(distinct.len() > 1500, "{}", distinct.len());
        assert!(outs.iter().any(|o| o.windows(8).any(|w| w == u64::MAX.to_le_bytes())));
        let has = |needle: &[u8]| outs.iter().any(|o| o.windows(needle.len()).any(|w| w == needle));
        assert!(has(b"18446744073709551615") && has(b"4294967296") && has(b"<tool_call>"));
    }
}
