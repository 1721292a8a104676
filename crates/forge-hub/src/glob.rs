//! `--include` patterns over `/`-separated repository paths.

use anyhow::{bail, Result};

/// A pattern: `*` and `?` stay within one path component, `**` crosses `/` (and `**/` also
/// matches no directory at all, so `**/*.json` matches `config.json`). A pattern that matches a
/// leading directory of a path matches everything under it, so `onnx` selects `onnx/**`.
#[derive(Clone, Debug)]
pub struct Glob {
    text: String,
    chars: Vec<char>,
}

impl Glob {
    pub fn new(text: &str) -> Result<Glob> {
        if text.is_empty() {
            bail!("--include: empty pattern");
        }
        // Matching is quadratic in the lengths; this keeps it cheap for any listing.
        if text.chars().count() > 512 {
            bail!("--include: pattern longer than 512 characters");
        }
        let t = text.strip_prefix("./").unwrap_or(text);
        let t = t.strip_suffix('/').unwrap_or(t);
        Ok(Glob { text: text.to_string(), chars: t.chars().collect() })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn matches(&self, path: &str) -> bool {
        let s: Vec<char> = path.chars().collect();
        if matches_at(&self.chars, &s) {
            return true;
        }
        s.iter().enumerate().any(|(i, &c)| c == '/' && matches_at(&self.chars, &s[..i]))
    }
}

/// Whether any of `globs` matches (an empty list selects everything).
pub fn any_match(globs: &[Glob], path: &str) -> bool {
    globs.is_empty() || globs.iter().any(|g| g.matches(path))
}

/// Memoized over (pattern index, path index) so that runs of `*` never backtrack exponentially.
fn matches_at(p: &[char], s: &[char]) -> bool {
    let w = s.len() + 1;
    let mut memo = vec![0u8; (p.len() + 1) * w];
    go(p, s, 0, 0, w, &mut memo)
}

fn go(p: &[char], s: &[char], i: usize, j: usize, w: usize, memo: &mut [u8]) -> bool {
    let k = i * w + j;
    if memo[k] != 0 {
        return memo[k] == 2;
    }
    let r = if i == p.len() {
        j == s.len()
    } else {
        match p[i] {
            '*' if p.get(i + 1) == Some(&'*') => {
                if p.get(i + 2) == Some(&'/') {
                    // `**/`: zero directories, or any prefix ending in `/`.
                    go(p, s, i + 3, j, w, memo) || (j..s.len()).any(|m| s[m] == '/' && go(p, s, i + 3, m + 1, w, memo))
                } else {
                    (j..=s.len()).any(|m| go(p, s, i + 2, m, w, memo))
                }
            }
            '*' => {
                let mut m = j;
                loop {
                    if go(p, s, i + 1, m, w, memo) {
                        break true;
                    }
                    if m == s.len() || s[m] == '/' {
                        break false;
                    }
                    m += 1;
                }
            }
            '?' => j < s.len() && s[j] != '/' && go(p, s, i + 1, j + 1, w, memo),
            c => j < s.len() && s[j] == c && go(p, s, i + 1, j + 1, w, memo),
        }
    };
    memo[k] = if r { 2 } else { 1 };
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, s: &str) -> bool {
        Glob::new(p).unwrap().matches(s)
    }

    #[test]
    fn star_stays_in_a_component() {
        assert!(m("*.json", "config.json"));
        assert!(!m("*.json", "sub/config.json"));
        assert!(m("sub/*.json", "sub/config.json"));
        assert!(m("model-?????-of-*.safetensors", "model-00001-of-00002.safetensors"));
        assert!(!m("?", "/"));
    }

    #[test]
    fn double_star_crosses_directories() {
        assert!(m("**/*.json", "config.json"));
        assert!(m("**/*.json", "a/b/config.json"));
        assert!(m("**", "a/b/c"));
        assert!(m("a/**/z", "a/z"));
        assert!(m("a/**/z", "a/b/c/z"));
        assert!(!m("a/**/z", "b/z"));
        assert!(m("**.gguf", "q/model.gguf"));
    }

    #[test]
    fn directories_select_their_contents() {
        assert!(m("onnx", "onnx/model.onnx"));
        assert!(m("onnx/", "onnx/a/b"));
        assert!(!m("onnx", "onnx2/model.onnx"));
    }

    #[test]
    fn many_stars_stay_fast() {
        let p = "*a*a*a*a*a*a*a*a*a*a*a*a*b";
        let s = "a".repeat(200);
        assert!(!m(p, &s));
        let _ = m(&"**/".repeat(20), &"a/".repeat(100));
    }
}
