//! Ablation selection: which linears of a quantized candidate keep their quantized weights
//! (`--parts mlp,gdn,attn,head`, `--layers lo-hi`); every other linear runs the teacher's dense
//! weights, so a KL figure can be attributed to a part of the model, as in ANEMLL Forge's ablations.

use anyhow::{bail, Context, Result};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    /// `layers.N.mlp.{gate,up,down}_proj`
    Mlp,
    /// Gated DeltaNet token mixer, `layers.N.linear_attn.*`
    Gdn,
    /// Full attention token mixer, `layers.N.self_attn.*`
    Attn,
    /// `lm_head` (the tied embedding's head use included)
    Head,
}

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Mlp => "mlp",
            Part::Gdn => "gdn",
            Part::Attn => "attn",
            Part::Head => "head",
        }
    }

    /// The part a canonical linear name belongs to (`None` for names outside these parts).
    pub fn of(linear_name: &str) -> Option<Part> {
        if linear_name == "lm_head" {
            return Some(Part::Head);
        }
        let rest = linear_name.strip_prefix("layers.")?;
        let (idx, rest) = rest.split_once('.')?;
        if idx.is_empty() || !idx.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (module, _) = rest.split_once('.')?;
        match module {
            "mlp" => Some(Part::Mlp),
            "linear_attn" => Some(Part::Gdn),
            "self_attn" => Some(Part::Attn),
            _ => None,
        }
    }
}

/// `None` fields select everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartFilter {
    parts: Option<Vec<Part>>,
    /// Inclusive layer range.
    layers: Option<(usize, usize)>,
}

impl PartFilter {
    /// The filter that keeps every linear quantized (no ablation).
    pub fn all() -> Self {
        PartFilter::default()
    }

    /// Parses `--parts` (comma-separated `mlp`, `gdn`, `attn`, `head`) and `--layers` (`lo-hi`,
    /// inclusive, or a single `n`).
    pub fn parse(parts: Option<&str>, layers: Option<&str>) -> Result<Self> {
        let parts = match parts {
            None => None,
            Some(s) => {
                let mut v = Vec::new();
                for item in s.split(',').map(str::trim) {
                    let p = match item {
                        "mlp" => Part::Mlp,
                        "gdn" => Part::Gdn,
                        "attn" => Part::Attn,
                        "head" => Part::Head,
                        "" => bail!("--parts '{s}': empty entry"),
                        other => bail!("--parts '{s}': unknown part '{other}' (known: mlp, gdn, attn, head)"),
                    };
                    if !v.contains(&p) {
                        v.push(p);
                    }
                }
                v.sort();
                Some(v)
            }
        };
        let layers = match layers {
            None => None,
            Some(s) => {
                let num = |t: &str| {
                    t.trim().parse::<usize>().with_context(|| format!("--layers '{s}': '{t}' is not a layer index"))
                };
                let (lo, hi) = match s.split_once('-') {
                    Some((a, b)) => (num(a)?, num(b)?),
                    None => {
                        let n = num(s)?;
                        (n, n)
                    }
                };
                if lo > hi {
                    bail!("--layers '{s}': the range is empty ({lo} > {hi})");
                }
                Some((lo, hi))
            }
        };
        Ok(PartFilter { parts, layers })
    }

    pub fn is_all(&self) -> bool {
        self.parts.is_none() && self.layers.is_none()
    }

    pub fn layer_range(&self) -> Option<(usize, usize)> {
        self.layers
    }

    /// Whether the linear `linear_name` (canonical, e.g. `layers.3.mlp.down_proj`, `lm_head`) at
    /// layer `layer` keeps its quantized weights. `lm_head` belongs to no layer: a layer range
    /// alone leaves it dense, and `--parts …,head` selects it whatever the range. Names outside
    /// the four parts (none today) are never selected by a restrictive filter.
    pub fn includes(&self, layer: usize, linear_name: &str) -> bool {
        if self.is_all() {
            return true;
        }
        let Some(part) = Part::of(linear_name) else { return false };
        if let Some(parts) = &self.parts {
            if !parts.contains(&part) {
                return false;
            }
        }
        match (part, self.layers) {
            (Part::Head, _) => self.parts.is_some() || self.layers.is_none(),
            (_, None) => true,
            (_, Some((lo, hi))) => (lo..=hi).contains(&layer),
        }
    }
}

impl fmt::Display for PartFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_all() {
            return write!(f, "all linears");
        }
        let parts = match &self.parts {
            Some(p) => p.iter().map(|p| p.name()).collect::<Vec<_>>().join(","),
            None => "mlp,gdn,attn,head".into(),
        };
        match self.layers {
            Some((lo, hi)) => write!(f, "parts {parts}, layers {lo}-{hi}"),
            None => write!(f, "parts {parts}, all layers"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_of_canonical_names() {
        assert_eq!(Part::of("layers.3.mlp.down_proj"), Some(Part::Mlp));
        assert_eq!(Part::of("layers.0.linear_attn.in_proj_qkv"), Some(Part::Gdn));
        assert_eq!(Part::of("layers.12.self_attn.q_proj"), Some(Part::Attn));
        assert_eq!(Part::of("lm_head"), Some(Part::Head));
        assert_eq!(Part::of("embed_tokens"), None);
        assert_eq!(Part::of("layers.x.mlp.up_proj"), None);
        assert_eq!(Part::of("layers.3.mlp"), None);
        assert_eq!(Part::of("layers.3.input_layernorm.weight"), None);
    }

    #[test]
    fn filters() {
        let all = PartFilter::parse(None, None).unwrap();
        assert!(all.is_all());
        assert!(all.includes(5, "layers.5.self_attn.o_proj") && all.includes(0, "lm_head"));

        let f = PartFilter::parse(Some("mlp,head"), None).unwrap();
        assert!(f.includes(3, "layers.3.mlp.down_proj"));
        assert!(f.includes(30, "lm_head"));
        assert!(!f.includes(3, "layers.3.self_attn.q_proj"));
        assert!(!f.includes(0, "layers.0.linear_attn.in_proj_qkv"));

        let f = PartFilter::parse(Some("gdn,attn"), Some("2-4")).unwrap();
        assert!(f.includes(2, "layers.2.linear_attn.out_proj"));
        assert!(f.includes(4, "layers.4.self_attn.k_proj"));
        assert!(!f.includes(5, "layers.5.self_attn.k_proj"));
        assert!(!f.includes(1, "layers.1.linear_attn.in_proj_z"));
        assert!(!f.includes(3, "layers.3.mlp.gate_proj"));
        assert!(!f.includes(3, "lm_head"));
        assert_eq!(f.to_string(), "parts gdn,attn, layers 2-4");

        // A layer range alone: every part in those layers; the head is in no layer.
        let f = PartFilter::parse(None, Some("7")).unwrap();
        assert_eq!(f.layer_range(), Some((7, 7)));
        assert!(f.includes(7, "layers.7.mlp.up_proj") && !f.includes(6, "layers.6.mlp.up_proj"));
        assert!(!f.includes(7, "lm_head"));
        assert!(!f.includes(7, "embed_tokens"));
        // Asked for by name, the head is selected whatever the range.
        let f = PartFilter::parse(Some("mlp,head"), Some("0-1")).unwrap();
        assert!(f.includes(99, "lm_head") && f.includes(1, "layers.1.mlp.down_proj"));
        assert!(!f.includes(2, "layers.2.mlp.down_proj"));
    }

    #[test]
    fn bad_input_is_an_error() {
        for (p, l) in [(Some("mlp,foo"), None), (Some("mlp,,head"), None), (None, Some("4-2")), (None, Some("a-b"))] {
            assert!(PartFilter::parse(p, l).is_err(), "{p:?} {l:?}");
        }
        let e = PartFilter::parse(Some("ffn"), None).unwrap_err().to_string();
        assert!(e.contains("ffn") && e.contains("mlp, gdn, attn, head"), "{e}");
    }
}
