//! From `forge quantize`'s choices to [`Options`]: the defaults every run gets, presets, and
//! explicit overrides. The defaults are the ones a model needs to come out usable: online
//! rotations on every MLP, token-mixer and head input (small models have outlier channels that a
//! per-row scale with one shared codebook cannot hold), and codebooks fitted activation-weighted
//! whenever calibration is loaded.

use crate::calib::CalibConfig;
use crate::plan::{Basis, Part, Plan};
use crate::preset::Preset;
use crate::quantize::{LowRankConfig, Method, Options};
use anyhow::{bail, Context, Result};
use forge_kernels::lut::Format;
use std::path::PathBuf;

/// Rotations when `--rotate` is not given.
pub const DEFAULT_ROTATE: &str = "mlp,mixer,head";

/// What the command line asked for; `None` means "not given".
#[derive(Clone, Debug, Default)]
pub struct Choices {
    pub preset: Option<String>,
    pub plan_file: Option<PathBuf>,
    /// MLP and token-mixer format.
    pub format: Option<String>,
    pub mixer: Option<String>,
    /// Attention K/V projections (default int8, or the preset's).
    pub kv: Option<String>,
    /// LM head (default lut4, or the preset's).
    pub head: Option<String>,
    /// `none` or a list of `mlp`, `mixer`, `head` (default [`DEFAULT_ROTATE`]).
    pub rotate: Option<String>,
    /// `rtn` or `gptq` (default rtn; gptq with a preset).
    pub method: Option<String>,
    /// Calibration spec; loading calibration for RTN too when given.
    pub calib: Option<String>,
    pub ncal: usize,
    pub seq: usize,
    pub holdout: usize,
    /// Activation-weighted codebook fits (default: whenever calibration is loaded).
    pub aw: Option<bool>,
    pub lowrank: usize,
    pub lowrank_parts: Option<String>,
    pub lowrank_inside: bool,
    /// Block reconstruction rounds (0: none).
    pub reconstruct: usize,
}

impl Choices {
    /// The command line's own defaults for the numeric options.
    pub fn new() -> Choices {
        Choices { ncal: 32, seq: 512, holdout: 4, ..Default::default() }
    }
}

/// The resolved recipe, ready for [`Options`].
#[derive(Clone, Debug)]
pub struct Recipe {
    pub plan: Plan,
    pub method: Method,
    pub calib: Option<CalibConfig>,
    pub aw: bool,
    pub lowrank: Option<LowRankConfig>,
    pub reconstruct: usize,
}

impl Recipe {
    /// Options for quantizing `source` (named `source_arg`) into `output` with this recipe.
    pub fn options(self, source_arg: &str, source: PathBuf, output: PathBuf, seed: u64) -> Options {
        Options {
            source_arg: source_arg.into(),
            source,
            plan: self.plan,
            method: self.method,
            seed,
            output,
            resume: false,
            stop_before_layer: None,
            probe: None,
            calib: self.calib,
            aw: self.aw,
            lowrank: self.lowrank,
            check_tokens: crate::check::DEFAULT_TOKENS,
            reconstruct: self.reconstruct,
        }
    }
}

/// Apply a `--rotate` value to a plan.
pub fn apply_rotate(plan: &mut Plan, rotate: &str) -> Result<()> {
    plan.mlp_basis = Basis::Plain;
    plan.mixer_basis = Basis::Plain;
    plan.head_basis = Basis::Plain;
    let parts: Vec<&str> = rotate.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if parts.contains(&"none") && parts.len() > 1 {
        bail!("--rotate: 'none' cannot be combined with other parts");
    }
    for part in parts.into_iter().filter(|&p| p != "none") {
        match part {
            "mlp" => plan.mlp_basis = Basis::Online,
            "mixer" => plan.mixer_basis = Basis::Online,
            "head" => plan.head_basis = Basis::Online,
            _ => bail!("--rotate: unknown part '{part}' (none, mlp, mixer, head)"),
        }
    }
    Ok(())
}

pub fn resolve(c: &Choices) -> Result<Recipe> {
    let preset = c.preset.as_deref().map(Preset::get).transpose()?;
    if preset.is_none() && c.format.is_none() && c.plan_file.is_none() {
        bail!("give --preset q4|q3|q2, --plan PLAN.json or --format FMT");
    }
    let mut plan = match (&preset, &c.format) {
        (Some(p), None) => p.plan.clone(),
        (_, f) => Plan::uniform(f.as_deref().map(Format::parse).transpose()?.unwrap_or(Format::Lut4)),
    };
    if let Some(m) = &c.mixer {
        plan.mixer = Format::parse(m)?;
    }
    if let Some(kv) = &c.kv {
        plan.kv = Format::parse(kv)?;
    }
    if let Some(h) = &c.head {
        plan.head = Format::parse(h)?;
    }
    let rotate = c.rotate.as_deref().or(preset.as_ref().map(|p| p.rotate)).unwrap_or(DEFAULT_ROTATE);
    apply_rotate(&mut plan, rotate)?;
    if let Some(p) = &c.plan_file {
        plan = Plan::from_file(p, plan)?;
    }
    let method = match (&c.method, &preset) {
        (Some(m), _) => Method::parse(m)?,
        (None, Some(_)) => Method::Gptq,
        (None, None) => Method::Rtn,
    };
    let calib = (method == Method::Gptq || c.calib.is_some()).then(|| CalibConfig {
        spec: c.calib.clone().unwrap_or_else(|| crate::calib::default_spec(c.ncal)),
        seq: c.seq,
        holdout: c.holdout,
    });
    let aw = match c.aw {
        Some(true) if calib.is_none() => {
            bail!("--aw weights codebook fits by calibration activations: give --calib or --method gptq")
        }
        Some(aw) => aw,
        None => calib.is_some() && preset.as_ref().is_none_or(|p| p.aw),
    };
    let (rank, parts) = match &preset {
        Some(p) if c.lowrank == 0 => (p.lowrank, p.lowrank_parts.to_string()),
        _ => (c.lowrank, c.lowrank_parts.clone().unwrap_or_else(|| "gdn,attn".into())),
    };
    let lowrank = (rank > 0)
        .then(|| -> Result<_> {
            let parts = parts
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|p| Part::parse(p).context("--lowrank-parts"))
                .collect::<Result<Vec<_>>>()?;
            Ok(LowRankConfig { rank, parts, inside: c.lowrank_inside })
        })
        .transpose()?;
    if c.reconstruct > 0 && calib.is_none() {
        bail!("--reconstruct refits codebooks and scales to calibration activations: give --calib or --method gptq");
    }
    Ok(Recipe { plan, method, calib, aw, lowrank, reconstruct: c.reconstruct })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut Choices)) -> Recipe {
        let mut c = Choices::new();
        f(&mut c);
        resolve(&c).unwrap()
    }

    #[test]
    fn defaults_rotate_everything_and_weight_by_activations_with_calibration() {
        let r = with(|c| c.format = Some("lut4".into()));
        assert_eq!(
            (r.plan.mlp_basis, r.plan.mixer_basis, r.plan.head_basis),
            (Basis::Online, Basis::Online, Basis::Online)
        );
        assert_eq!((r.method, r.plan.kv, r.plan.head), (Method::Rtn, Format::Int8, Format::Lut4));
        assert!(r.calib.is_none() && !r.aw, "RTN without --calib loads no calibration");
        let r = with(|c| {
            c.format = Some("lut4".into());
            c.method = Some("gptq".into());
        });
        assert!(r.calib.is_some() && r.aw);
        let r = with(|c| {
            c.format = Some("vec2x64".into());
            c.calib = Some("prose.txt:4".into());
        });
        assert!(r.method == Method::Rtn && r.aw, "RTN with calibration fits activation-weighted");
        let r = with(|c| {
            c.format = Some("lut4".into());
            c.method = Some("gptq".into());
            c.aw = Some(false);
        });
        assert!(!r.aw);
        let mut c = Choices::new();
        c.format = Some("lut4".into());
        c.aw = Some(true);
        assert!(format!("{:#}", resolve(&c).unwrap_err()).contains("--calib"));
    }

    #[test]
    fn rotate_none_and_subsets() {
        let r = with(|c| {
            c.format = Some("lut4".into());
            c.rotate = Some("none".into());
        });
        assert_eq!(
            (r.plan.mlp_basis, r.plan.mixer_basis, r.plan.head_basis),
            (Basis::Plain, Basis::Plain, Basis::Plain)
        );
        let r = with(|c| {
            c.format = Some("lut4".into());
            c.rotate = Some("mlp".into());
        });
        assert_eq!(
            (r.plan.mlp_basis, r.plan.mixer_basis, r.plan.head_basis),
            (Basis::Online, Basis::Plain, Basis::Plain)
        );
        // A preset's rotations give way to an explicit --rotate none.
        let r = with(|c| {
            c.preset = Some("q4".into());
            c.rotate = Some("none".into());
        });
        assert_eq!(r.plan.mlp_basis, Basis::Plain);
        let mut c = Choices::new();
        c.format = Some("lut4".into());
        c.rotate = Some("none,mlp".into());
        assert!(resolve(&c).is_err());
    }

    #[test]
    fn presets_keep_their_recipes_and_yield_to_explicit_flags() {
        for name in ["q4", "q3", "q2"] {
            let p = Preset::get(name).unwrap();
            let r = with(|c| c.preset = Some(name.into()));
            assert_eq!(r.method, Method::Gptq);
            assert!(r.aw && r.calib.is_some());
            assert_eq!(
                (r.plan.mlp, r.plan.mixer, r.plan.kv, r.plan.head),
                (p.plan.mlp, p.plan.mixer, p.plan.kv, p.plan.head)
            );
            assert_eq!(
                (r.plan.mlp_basis, r.plan.mixer_basis, r.plan.head_basis),
                (Basis::Online, Basis::Online, Basis::Online)
            );
            assert_eq!(r.calib.unwrap().spec, "prose.txt:16,code.txt:16");
        }
        let r = with(|c| {
            c.preset = Some("q4".into());
            c.head = Some("int8".into());
        });
        assert_eq!((r.plan.mlp, r.plan.head), (Format::Lut4, Format::Int8));
        let r = with(|c| {
            c.preset = Some("q3".into());
            c.format = Some("lut4".into());
        });
        assert_eq!((r.plan.mlp, r.plan.kv, r.plan.head), (Format::Lut4, Format::Int8, Format::Lut4));
    }
}
