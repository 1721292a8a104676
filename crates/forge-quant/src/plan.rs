//! Mixed-bit plans: which format (and which basis) each matrix gets.
//!
//! ANEMLL Forge's plan JSON (`configs/quantization/*.json` upstream) is a flat object:
//! `"<layer>.gate|up|down": "<format>"`, `"<layer>.mixer": "<format>"`,
//! `"<layer>.basis": "online"|"plain"`, with `"bf16"` keeping a matrix. Defaults for the MLP,
//! the token mixer, attention K/V projections and the head come from the command line (as the
//! ANEMLL Forge's `FORMAT`, `MIXER`, `KV_FMT`, `HEAD`), or from the optional keys `"mlp"`, `"mixer"`,
//! `"kv"`, `"head"` and `"basis"`/`"mixer_basis"` in the file. Forge also accepts per-matrix
//! mixer keys (`"<layer>.q"`, `.k`, `.v`, `.o`, `.qkv`, `.z`, `.out`).

use anyhow::{anyhow, bail, Context, Result};
use forge_kernels::lut::Format;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    Plain,
    /// Online block-Hadamard rotation of the matrix input.
    Online,
}

impl Basis {
    pub fn parse(s: &str) -> Result<Basis> {
        match s {
            "plain" => Ok(Basis::Plain),
            "online" => Ok(Basis::Online),
            _ => bail!("basis must be \"online\" or \"plain\", found \"{s}\""),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Basis::Plain => "plain",
            Basis::Online => "online",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub mlp: Format,
    pub mixer: Format,
    pub kv: Format,
    pub head: Format,
    /// Default basis of MLP inputs (gate/up and down).
    pub mlp_basis: Basis,
    /// Default basis of token-mixer inputs (release 0.2 rotates them too).
    pub mixer_basis: Basis,
    /// Basis of the head input (a Forge extension; seed 5000).
    pub head_basis: Basis,
    /// Per-matrix / per-layer entries from the plan file.
    pub entries: BTreeMap<String, String>,
}

/// The role of a linear layer in the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Role {
    pub layer: Option<usize>,
    /// `gate`, `up`, `down`, `q`, `k`, `v`, `o`, `qkv`, `z`, `a`, `b`, `out`, `head`.
    pub short: &'static str,
    pub part: Part,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    Mlp,
    Attn,
    Gdn,
    Head,
}

impl Part {
    pub fn parse(s: &str) -> Result<Part> {
        match s {
            "mlp" => Ok(Part::Mlp),
            "attn" => Ok(Part::Attn),
            "gdn" => Ok(Part::Gdn),
            "head" => Ok(Part::Head),
            _ => bail!("unknown part '{s}' (gdn, attn, mlp, head)"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Part::Mlp => "mlp",
            Part::Attn => "attn",
            Part::Gdn => "gdn",
            Part::Head => "head",
        }
    }
}

/// Classify a canonical linear name (`layers.3.mlp.down_proj`, `lm_head`, …).
pub fn role_of(name: &str) -> Result<Role> {
    if name == "lm_head" {
        return Ok(Role { layer: None, short: "head", part: Part::Head });
    }
    let rest = name.strip_prefix("layers.").ok_or_else(|| anyhow!("not a layer matrix: {name}"))?;
    let (l, tail) = rest.split_once('.').ok_or_else(|| anyhow!("not a layer matrix: {name}"))?;
    let layer: usize = l.parse().map_err(|_| anyhow!("bad layer index in {name}"))?;
    let (short, part) = match tail {
        "mlp.gate_proj" => ("gate", Part::Mlp),
        "mlp.up_proj" => ("up", Part::Mlp),
        "mlp.down_proj" => ("down", Part::Mlp),
        "self_attn.q_proj" => ("q", Part::Attn),
        "self_attn.k_proj" => ("k", Part::Attn),
        "self_attn.v_proj" => ("v", Part::Attn),
        "self_attn.o_proj" => ("o", Part::Attn),
        "linear_attn.in_proj_qkv" => ("qkv", Part::Gdn),
        "linear_attn.in_proj_z" => ("z", Part::Gdn),
        "linear_attn.in_proj_a" => ("a", Part::Gdn),
        "linear_attn.in_proj_b" => ("b", Part::Gdn),
        "linear_attn.out_proj" => ("out", Part::Gdn),
        _ => bail!("unknown matrix {name}"),
    };
    Ok(Role { layer: Some(layer), short, part })
}

impl Plan {
    pub fn uniform(format: Format) -> Plan {
        Plan {
            mlp: format,
            mixer: format,
            kv: Format::Int8,
            head: Format::Lut4,
            mlp_basis: Basis::Plain,
            mixer_basis: Basis::Plain,
            head_basis: Basis::Plain,
            entries: BTreeMap::new(),
        }
    }

    /// Read a plan file on top of `defaults`.
    pub fn from_file(path: &Path, defaults: Plan) -> Result<Plan> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", path.display()))?;
        Self::from_json(&v, defaults).with_context(|| format!("{}", path.display()))
    }

    pub fn from_json(v: &Value, mut plan: Plan) -> Result<Plan> {
        let obj = v.as_object().ok_or_else(|| anyhow!("a plan must be a JSON object"))?;
        for (k, val) in obj {
            let s = val.as_str().ok_or_else(|| anyhow!("plan entry '{k}' must be a string"))?;
            match k.as_str() {
                "mlp" => plan.mlp = Format::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "mixer" => plan.mixer = Format::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "kv" => plan.kv = Format::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "head" => plan.head = Format::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "basis" => plan.mlp_basis = Basis::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "mixer_basis" => plan.mixer_basis = Basis::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                "head_basis" => plan.head_basis = Basis::parse(s).with_context(|| format!("plan entry '{k}'"))?,
                _ => {
                    let (l, what) = k.split_once('.').ok_or_else(|| anyhow!("unknown plan key '{k}'"))?;
                    l.parse::<usize>().map_err(|_| anyhow!("plan key '{k}': '{l}' is not a layer index"))?;
                    match what {
                        "basis" | "mixer_basis" => {
                            Basis::parse(s).with_context(|| format!("plan entry '{k}'"))?;
                        }
                        "gate" | "up" | "down" | "mixer" | "q" | "k" | "v" | "o" | "qkv" | "z" | "out" => {
                            Format::parse(s).with_context(|| format!("plan entry '{k}'"))?;
                        }
                        _ => bail!("unknown plan key '{k}' (expected <layer>.gate|up|down|mixer|basis)"),
                    }
                    plan.entries.insert(k.clone(), s.to_string());
                }
            }
        }
        Ok(plan)
    }

    /// Check that every per-layer key names an existing layer.
    pub fn check_layers(&self, num_layers: usize) -> Result<()> {
        for k in self.entries.keys() {
            let l: usize = k.split('.').next().unwrap().parse().unwrap();
            if l >= num_layers {
                bail!("plan key '{k}' names layer {l}, but the model has {num_layers} layers");
            }
        }
        Ok(())
    }

    /// The format of one matrix.
    pub fn format_for(&self, name: &str) -> Result<Format> {
        let r = role_of(name)?;
        let Some(l) = r.layer else { return Ok(self.head) };
        let get = |key: &str| self.entries.get(&format!("{l}.{key}")).map(|s| Format::parse(s)).transpose();
        Ok(match r.part {
            Part::Mlp => get(r.short)?.unwrap_or(self.mlp),
            Part::Attn | Part::Gdn => {
                if let Some(f) = get(r.short)? {
                    f
                } else if matches!(r.short, "a" | "b") {
                    // DeltaNet's tiny decay/β projections stay in floating point, as in ANEMLL Forge.
                    Format::Bf16
                } else if matches!(r.short, "k" | "v") {
                    self.kv
                } else {
                    get("mixer")?.unwrap_or(self.mixer)
                }
            }
            Part::Head => self.head,
        })
    }

    /// The input basis of one matrix.
    pub fn basis_for(&self, name: &str) -> Result<Basis> {
        let r = role_of(name)?;
        let Some(l) = r.layer else { return Ok(self.head_basis) };
        let get = |key: &str| self.entries.get(&format!("{l}.{key}")).map(|s| Basis::parse(s)).transpose();
        Ok(match r.part {
            Part::Mlp => get("basis")?.unwrap_or(self.mlp_basis),
            Part::Attn | Part::Gdn if matches!(r.short, "a" | "b") => Basis::Plain,
            Part::Attn | Part::Gdn => get("mixer_basis")?.unwrap_or(self.mixer_basis),
            Part::Head => Basis::Plain,
        })
    }

    /// Rotation seed of a matrix input, as in ANEMLL Forge: 1000+layer (MLP gate/up input),
    /// 2000+layer (down input), 3000+layer (mixer inputs), 4000+layer (mixer output projection input).
    pub fn rotation_seed(name: &str) -> Result<u64> {
        let r = role_of(name)?;
        let l = r.layer.unwrap_or(0) as u64;
        Ok(match r.short {
            "head" => 5000,
            "gate" | "up" => 1000 + l,
            "down" => 2000 + l,
            "o" | "out" => 4000 + l,
            _ => 3000 + l,
        })
    }

    pub fn to_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("mlp".into(), self.mlp.long_name().into());
        m.insert("mixer".into(), self.mixer.long_name().into());
        m.insert("kv".into(), self.kv.long_name().into());
        m.insert("head".into(), self.head.long_name().into());
        m.insert("basis".into(), self.mlp_basis.name().into());
        m.insert("mixer_basis".into(), self.mixer_basis.name().into());
        if self.head_basis == Basis::Online {
            m.insert("head_basis".into(), self.head_basis.name().into());
        }
        for (k, v) in &self.entries {
            m.insert(k.clone(), v.clone().into());
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn seeds_plan_resolves() {
        let p = Plan::from_json(
            &json!({"23.gate": "LUT4 per-tensor + pcs", "23.up": "vector 2x16 + pcs", "0.mixer": "vector 2x16 + pcs", "5.basis": "online", "7.down": "bf16"}),
            Plan::uniform(Format::Vec2x64),
        )
        .unwrap();
        assert_eq!(p.format_for("layers.23.mlp.gate_proj").unwrap(), Format::Lut4);
        assert_eq!(p.format_for("layers.23.mlp.up_proj").unwrap(), Format::Vec2x16);
        assert_eq!(p.format_for("layers.23.mlp.down_proj").unwrap(), Format::Vec2x64);
        assert_eq!(p.format_for("layers.7.mlp.down_proj").unwrap(), Format::Bf16);
        assert_eq!(p.format_for("layers.0.linear_attn.in_proj_qkv").unwrap(), Format::Vec2x16);
        assert_eq!(p.format_for("layers.0.self_attn.k_proj").unwrap(), Format::Int8);
        assert_eq!(p.format_for("layers.0.linear_attn.in_proj_a").unwrap(), Format::Bf16);
        assert_eq!(p.format_for("layers.1.self_attn.q_proj").unwrap(), Format::Vec2x64);
        assert_eq!(p.format_for("lm_head").unwrap(), Format::Lut4);
        assert_eq!(p.basis_for("layers.5.mlp.down_proj").unwrap(), Basis::Online);
        assert_eq!(p.basis_for("layers.4.mlp.down_proj").unwrap(), Basis::Plain);
        assert_eq!(Plan::rotation_seed("layers.5.mlp.up_proj").unwrap(), 1005);
        assert_eq!(Plan::rotation_seed("layers.5.mlp.down_proj").unwrap(), 2005);
    }

    #[test]
    fn bad_plans_are_rejected_with_the_key() {
        let d = Plan::uniform(Format::Lut4);
        let e = Plan::from_json(&json!({"3.gate": "lut5"}), d.clone()).unwrap_err();
        assert!(format!("{e:#}").contains("3.gate"));
        let e = Plan::from_json(&json!({"3.attention": "lut4"}), d.clone()).unwrap_err();
        assert!(format!("{e:#}").contains("3.attention"));
        let p = Plan::from_json(&json!({"40.up": "lut4"}), d).unwrap();
        assert!(format!("{:#}", p.check_layers(30).unwrap_err()).contains("40.up"));
    }
}
