//! `forge quantize`: a model through a plan, layer by layer, into an export.
//!
//! Layers are written one file at a time (atomically), so a killed run restarted with
//! `--resume` continues at the first unfinished layer; `forge.json`, written last, marks the
//! export complete. Every random choice derives from the recorded `--seed`.

use crate::calib::CalibConfig;
use crate::export::{write_embedding, write_file, MatrixEntry};
use crate::gptq::{gptq, gptq_factored};
pub use crate::input_stats::{HeldOut, InputStats};
use crate::lowrank::lowrank_factors;
use crate::plan::{Basis, Part, Plan};
use crate::quantize_matrix::{fit_codebook, normalize, row_scales, QuantMatrix};
use crate::quantize_matrix::{quantize_rtn, snr_db};
use crate::row_blocks::{quantize_rows, RowBlocks};
use anyhow::{anyhow, bail, Context, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::fsutil::write_atomic;
use forge_kernels::lut::{Format, LutMatrix};
use forge_kernels::rotation::Rotation;
use forge_model::linear::{LowRank, Observer, Weight};
use forge_model::model::{Embedding, Mixer, Model};
use forge_model::Linear;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub const TOOL_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Rtn,
    Gptq,
}

impl Method {
    pub fn parse(s: &str) -> Result<Method> {
        match s {
            "rtn" => Ok(Method::Rtn),
            "gptq" => Ok(Method::Gptq),
            _ => bail!("unknown method '{s}' (known: rtn, gptq)"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Method::Rtn => "rtn",
            Method::Gptq => "gptq",
        }
    }
}

pub struct Options {
    /// The `--model` argument as given (a path or a short name, recorded in forge.json).
    pub source_arg: String,
    pub source: PathBuf,
    pub plan: Plan,
    pub method: Method,
    pub seed: u64,
    pub output: PathBuf,
    pub resume: bool,
    /// Testing aid: fail (as a crash would) before quantizing this layer.
    pub stop_before_layer: Option<usize>,
    /// A measuring run (`--dry-run`): only the first layers and a few calibration rows.
    pub probe: Option<Probe>,
    /// Calibration (GPTQ).
    pub calib: Option<CalibConfig>,
    /// Weight codebook fits by `diag(H)` (ANEMLL Forge's AW=1); needs calibration.
    pub aw: bool,
    pub lowrank: Option<LowRankConfig>,
    /// Tokens of the end-of-run check ([`crate::check`]); 0 skips it.
    pub check_tokens: usize,
    /// Block reconstruction rounds after each LUT matrix's fit ([`crate::reconstruct`]); 0: none.
    /// Needs calibration.
    pub reconstruct: usize,
}

/// What a measuring run quantizes: the first `layers` layers (the model cut there) and the head,
/// calibrated on at most `calib_rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    pub layers: usize,
    pub calib_rows: usize,
}

/// One layer's share of a run.
#[derive(Clone, Debug)]
pub struct LayerTime {
    pub kind: forge_core::config::LayerKind,
    pub seconds: f64,
    /// Seconds per stage, in [`STAGES`] order.
    pub stages: [f64; STAGES.len()],
}

/// The stages a run's wall time is reported in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Opening the checkpoint, loading the model and the calibration rows.
    Load,
    /// Calibration passes through the model (without the Hessian accumulation).
    CalibForward,
    /// Accumulating the Hessians over the calibration tokens.
    Hessians,
    /// Finishing the Hessians and turning them into the matrices' bases (one pass over each,
    /// whatever the number of tokens).
    HessianBasis,
    /// Codebook fits and round-to-nearest assignment.
    Fit,
    Gptq,
    /// Refitting codebooks and scales to the calibration stream.
    Reconstruct,
    LowRank,
    /// Writing the export's files.
    Write,
    /// The end-of-run check: the source's and the export's logits on the check rows.
    Check,
    /// Everything else: weight rotations, error figures, bookkeeping.
    Other,
}

pub const STAGES: [Stage; 11] = [
    Stage::Load,
    Stage::CalibForward,
    Stage::Hessians,
    Stage::HessianBasis,
    Stage::Fit,
    Stage::Gptq,
    Stage::Reconstruct,
    Stage::LowRank,
    Stage::Write,
    Stage::Check,
    Stage::Other,
];

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Load => "load",
            Stage::CalibForward => "calibration forward",
            Stage::Hessians => "Hessians",
            Stage::HessianBasis => "Hessian bases",
            Stage::Fit => "fit",
            Stage::Gptq => "GPTQ",
            Stage::Reconstruct => "reconstruction",
            Stage::LowRank => "low-rank",
            Stage::Write => "write",
            Stage::Check => "check",
            Stage::Other => "other",
        }
    }
    /// Key in the JSON report.
    pub fn key(self) -> &'static str {
        match self {
            Stage::Load => "load",
            Stage::CalibForward => "calib_forward",
            Stage::Hessians => "hessians",
            Stage::HessianBasis => "hessian_basis",
            Stage::Fit => "fit",
            Stage::Gptq => "gptq",
            Stage::Reconstruct => "reconstruct",
            Stage::LowRank => "lowrank",
            Stage::Write => "write",
            Stage::Check => "check",
            Stage::Other => "other",
        }
    }
}

/// Seconds per stage, summed over the run.
#[derive(Debug, Default)]
pub struct Timings {
    secs: Mutex<[f64; STAGES.len()]>,
}

impl Timings {
    pub fn add(&self, stage: Stage, secs: f64) {
        self.secs.lock().unwrap()[stage as usize] += secs;
    }
    pub fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.add(stage, t.elapsed().as_secs_f64());
        r
    }
    pub fn get(&self, stage: Stage) -> f64 {
        self.secs.lock().unwrap()[stage as usize]
    }
    fn snapshot(&self) -> [f64; STAGES.len()] {
        *self.secs.lock().unwrap()
    }
    /// Run `f`, whose stages overlap in time (matrices quantized concurrently), and scale what
    /// it added to the stages down to its wall time, so that the stages still add up.
    pub fn concurrent<T>(&self, f: impl FnOnce() -> T) -> T {
        let before = *self.secs.lock().unwrap();
        let t = Instant::now();
        let r = f();
        let wall = t.elapsed().as_secs_f64();
        let mut s = self.secs.lock().unwrap();
        let added: f64 = s.iter().zip(&before).map(|(a, b)| a - b).sum();
        if added > wall {
            for (a, b) in s.iter_mut().zip(&before) {
                *a = b + (*a - b) * wall / added;
            }
        }
        r
    }
}

/// What a run produced besides its files.
#[derive(Debug)]
pub struct Outcome {
    pub manifest: Value,
    /// Seconds per stage ([`Stage::Other`] is the wall time no other stage accounts for).
    pub stages: Vec<(Stage, f64)>,
    pub total_seconds: f64,
    pub check: Option<crate::check::Check>,
    /// Each layer's seconds (a layer resumed from an earlier run included).
    pub layers: Vec<LayerTime>,
    /// Number of calibration rows and tokens per row the run used (0, 0 without calibration).
    pub calib_rows: usize,
    pub calib_seq: usize,
}

impl Outcome {
    pub fn stages_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        for (s, t) in &self.stages {
            m.insert(s.key().to_string(), json!((t * 1000.0).round() / 1000.0));
        }
        m.insert("total".to_string(), json!((self.total_seconds * 1000.0).round() / 1000.0));
        Value::Object(m)
    }

    /// The per-stage table printed at the end of a run.
    pub fn stages_table(&self) -> String {
        let mut s = format!("{:<22} {:>9} {:>6}\n", "stage", "seconds", "share");
        for (st, t) in &self.stages {
            if *t > 0.0005 {
                s += &format!("{:<22} {:>9.2} {:>5.1}%\n", st.name(), t, 100.0 * t / self.total_seconds.max(1e-9));
            }
        }
        s += &format!("{:<22} {:>9.2}\n", "total", self.total_seconds);
        s
    }
}

/// Low-rank residual correction.
#[derive(Clone, Debug)]
pub struct LowRankConfig {
    pub rank: usize,
    pub parts: Vec<Part>,
    /// Fit the factors first and quantize `W − AB` (release 0.2) instead of fitting the error after.
    pub inside: bool,
}

impl LowRankConfig {
    fn applies(&self, name: &str) -> bool {
        crate::plan::role_of(name).map(|r| self.parts.contains(&r.part)).unwrap_or(false)
    }
}

/// Linear layers of layer `l`, token mixer first (execution order).
pub fn layer_linears(m: &Model, l: usize) -> Vec<&Linear> {
    let layer = &m.layers[l];
    let mut v: Vec<&Linear> = match &layer.mixer {
        Mixer::Attention(a) => vec![&a.q, &a.k, &a.v, &a.o],
        Mixer::DeltaNet(d) => vec![&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out],
    };
    v.extend([&layer.mlp.gate, &layer.mlp.up, &layer.mlp.down]);
    v
}

/// A stable per-matrix seed from the run seed and the matrix name.
pub fn matrix_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf29ce484222325u64 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h
}

/// Fingerprint of the source checkpoint: SHA-256 of a GGUF file, or of a directory's
/// config.json plus its weight files' names and sizes (hashing 50 GB of shards is not useful).
pub fn source_fingerprint(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    if path.is_dir() {
        let mut names: Vec<PathBuf> = std::fs::read_dir(path)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        names.sort();
        for p in names {
            let n = p.file_name().unwrap().to_string_lossy().to_string();
            if n == "config.json" {
                h.update(std::fs::read(&p)?);
            } else if n.ends_with(".safetensors") {
                h.update(n.as_bytes());
                h.update(std::fs::metadata(&p)?.len().to_le_bytes());
            }
        }
    } else {
        let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        std::io::copy(&mut f, &mut h)?;
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The rotation a matrix is quantized in, if any: online bases apply to the LUT and INT8 formats.
pub(crate) fn rotation_for(lin: &Linear, o: &Options) -> Result<Option<Rotation>> {
    let format = o.plan.format_for(&lin.name)?;
    let online = o.plan.basis_for(&lin.name)? == Basis::Online && (format.is_lut() || format == Format::Int8);
    Ok(if online { Some(Rotation::new(lin.in_f, Plan::rotation_seed(&lin.name)?)) } else { None })
}

/// Finish the statistics of an input read by `lins`, put the fitting Hessian into their bases
/// and, for GPTQ, factor it once per basis for the matrices that will run GPTQ.
pub(crate) fn prepare_stats(stats: &mut InputStats, lins: &[&Linear], o: &Options, tm: &Timings) -> Result<()> {
    let rots = lins.iter().map(|l| rotation_for(l, o)).collect::<Result<Vec<_>>>()?;
    let bases: Vec<Option<&Rotation>> = rots.iter().map(|r| r.as_ref()).collect();
    tm.time(Stage::HessianBasis, || stats.prepare(&bases))?;
    if o.method == Method::Gptq {
        for (lin, rot) in lins.iter().zip(&rots) {
            if o.plan.format_for(&lin.name)?.is_lut() {
                tm.time(Stage::Gptq, || stats.make_factor(rot.as_ref()))
                    .with_context(|| format!("GPTQ of {}", lin.name))?;
            }
        }
    }
    Ok(())
}

/// Quantize one linear layer: returns the export entry and the quantized `Linear`.
pub(crate) fn quantize_linear(
    lin: &Linear,
    o: &Options,
    stats: Option<&InputStats>,
    tm: &Timings,
) -> Result<(MatrixEntry, Linear)> {
    let name = &lin.name;
    let plan = &o.plan;
    let format = plan.format_for(name)?;
    let (out, cin) = (lin.out_f, lin.in_f);
    let rot = rotation_for(lin, o)?;
    let seed = matrix_seed(o.seed, name);
    let lr_cfg = o.lowrank.as_ref().filter(|c| c.applies(name) && format != Format::Bf16 && format != Format::F16);
    let rows_ok = lin.rotation.is_none() && lin.lowrank.is_none() && o.reconstruct == 0;
    let big = out * cin > RowBlocks::DEFAULT.above;
    if big && lr_cfg.is_none() && rows_ok && (format.is_lut() || format == Format::Int8) {
        return quantize_rows(lin, o, stats, tm, format, rot, seed, RowBlocks::DEFAULT);
    }
    let w = lin.effective_weight()?;
    let rotate = |v: &mut Vec<f32>| {
        if let Some(r) = &rot {
            r.rotate_weight(v, out)
        }
    };
    // The matrix the format must represent (in the stored basis).
    let mut inside_ab: Option<(Vec<f32>, Vec<f32>)> = None;
    let mut target = w.clone();
    if let Some(c) = lr_cfg.filter(|c| c.inside) {
        // Release 0.2: factors from the round-to-nearest error, then quantize W − AB.
        let mut wr = w.clone();
        rotate(&mut wr);
        let (a, b) = tm.time(Stage::LowRank, || -> Result<_> {
            let rtn = quantize_rtn(&wr, out, cin, format, None, seed)?;
            let mut back = rtn.reconstruct();
            if let Some(r) = &rot {
                r.unrotate_weight(&mut back, out);
            }
            let e: Vec<f32> = w.iter().zip(&back).map(|(a, b)| a - b).collect();
            Ok(lowrank_factors(&e, out, cin, c.rank, seed ^ 0x5EED))
        })?;
        let ab = dense_ab(&a, &b, out, c.rank, cin);
        target.iter_mut().zip(&ab).for_each(|(t, x)| *t -= x);
        inside_ab = Some((a, b));
    }
    rotate(&mut target);
    let h_fit = match stats {
        Some(s) => Some(s.fit_in(rot.as_ref()).with_context(|| format!("{name}: input statistics not prepared"))?),
        None => None,
    };
    let q = match (&h_fit, format.is_lut()) {
        (Some(h), true) if o.method == Method::Gptq => {
            let scale = row_scales(&target, out, cin);
            let mut wn = normalize(&target, cin, &scale);
            let diag: Vec<f32> = (0..cin).map(|i| h[i * cin + i]).collect();
            let cb = tm.time(Stage::Fit, || fit_codebook(&wn, out, cin, format, o.aw.then_some(&diag[..]), seed));
            let factor = stats.and_then(|s| s.factor(rot.as_ref()));
            let idx = tm
                .time(Stage::Gptq, || match factor {
                    Some(f) => gptq_factored(&mut wn, out, f, &cb, format.vec_dim()),
                    None => gptq(&mut wn, out, cin, h, &cb, format.vec_dim()),
                })
                .with_context(|| format!("GPTQ of {name}"))?;
            QuantMatrix::Lut(LutMatrix { format, cout: out, cin, codebook: cb, idx: idx.into(), scale })
        }
        _ => {
            let diag: Option<Vec<f32>> = h_fit.as_ref().map(|h| (0..cin).map(|i| h[i * cin + i]).collect());
            tm.time(Stage::Fit, || {
                quantize_rtn(&target, out, cin, format, if o.aw { diag.as_deref() } else { None }, seed)
            })
            .with_context(|| format!("quantizing {name}"))?
        }
    };
    let mut st = BTreeMap::new();
    let q = match (q, &h_fit) {
        (QuantMatrix::Lut(m), Some(h)) if o.reconstruct > 0 => {
            let hold = stats.filter(|s| s.hold.rows > 0).map(|s| match &rot {
                Some(r) => std::borrow::Cow::Owned(s.hold.rotated(r)),
                None => std::borrow::Cow::Borrowed(&s.hold),
            });
            let (m, rf) = tm.time(Stage::Reconstruct, || reconstruct_checked(&target, m, h, hold.as_deref(), o));
            st.insert("recon_fit_gain_db".to_string(), format!("{:.4}", rf.fit_gain_db));
            if let Some(g) = rf.heldout_gain_db {
                st.insert("recon_heldout_gain_db".to_string(), format!("{g:.4}"));
            }
            st.insert("recon_kept".to_string(), rf.kept.to_string());
            QuantMatrix::Lut(m)
        }
        (q, _) => q,
    };
    // Effective weight in the original basis, for the error figures and the low-rank fit.
    let mut eff = q.reconstruct();
    if let Some(r) = &rot {
        r.unrotate_weight(&mut eff, out);
    }
    let lowrank = match (inside_ab, lr_cfg) {
        (Some((a, b)), Some(c)) => Some((c.rank, a, b)),
        (None, Some(c)) => {
            let e: Vec<f32> = w.iter().zip(&eff).map(|(a, b)| a - b).collect();
            let (a, b) = tm.time(Stage::LowRank, || lowrank_factors(&e, out, cin, c.rank, seed ^ 0x5EED));
            Some((c.rank, a, b))
        }
        _ => None,
    };
    if let Some((r, a, b)) = &lowrank {
        let ab = dense_ab(a, b, out, *r, cin);
        eff.iter_mut().zip(&ab).for_each(|(e, x)| *e += x);
    }
    let (_, key) = crate::export::file_and_key(name)?;
    st.insert("snr_db".to_string(), format!("{:.4}", snr_db(&w, &eff)));
    if let Some(s) = stats.filter(|s| s.hold.rows > 0) {
        let signal = s.hold.loss(&w, None, out);
        let noise = s.hold.loss(&w, Some(&eff), out);
        st.insert("heldout_snr_db".to_string(), format!("{:.4}", 10.0 * (signal / noise.max(1e-300)).log10()));
    }
    let weight = match &q {
        QuantMatrix::Lut(m) => Weight::Lut(Arc::new(m.clone())),
        QuantMatrix::Int8(m) => Weight::Int8(Arc::new(m.clone())),
        QuantMatrix::Float { data, .. } => {
            Weight::Dense(forge_core::tensor::HostTensor::from_f32(vec![out, cin], data.clone()))
        }
    };
    let mut new = Linear::with_weight(name.clone(), out, cin, weight);
    new.bias = lin.bias.clone();
    new.rotation = rot.as_ref().map(|r| Arc::new(r.clone()) as Arc<dyn forge_model::linear::InputRotation>);
    // FP16 factors, as the export stores them: the model evaluated here is the one exported.
    new.lowrank = lowrank.as_ref().map(|(r, a, b)| LowRank::from_f32(*r, a, b));
    let entry = MatrixEntry { key, q, rotation: rot.map(|r| (r.seed, r.block)), lowrank, stats: st };
    Ok((entry, new))
}

/// Rows of the embedding table written between two releases of its source pages.
const EMBED_RELEASE_ROWS: usize = 1 << 15;

/// What block reconstruction did to one matrix.
struct Reconstructed {
    fit_gain_db: f64,
    heldout_gain_db: Option<f64>,
    kept: bool,
}

/// Refit `m` to `target` under the fitting Hessian, and keep the refit only if it also lowers
/// the error on the held-out rows (when there are any).
fn reconstruct_checked(
    target: &[f32],
    m: LutMatrix,
    h: &[f32],
    hold: Option<&HeldOut>,
    o: &Options,
) -> (LutMatrix, Reconstructed) {
    let (new, rf) = crate::reconstruct::refit(target, &m, h, o.reconstruct);
    if !rf.improved() {
        return (m, Reconstructed { fit_gain_db: 0.0, heldout_gain_db: None, kept: false });
    }
    let heldout_gain_db = hold.map(|hh| {
        let before = hh.loss(target, Some(&m.reconstruct()), m.cout);
        let after = hh.loss(target, Some(&new.reconstruct()), m.cout);
        10.0 * (before / after.max(1e-300)).log10()
    });
    let kept = heldout_gain_db.is_none_or(|g| g > 0.0);
    let r = Reconstructed { fit_gain_db: if kept { rf.gain_db() } else { 0.0 }, heldout_gain_db, kept };
    (if kept { new } else { m }, r)
}

fn dense_ab(a: &[f32], b: &[f32], out: usize, r: usize, cin: usize) -> Vec<f32> {
    let mut ab = vec![0f32; out * cin];
    for o in 0..out {
        for k in 0..r {
            forge_kernels::simd::axpy(a[o * r + k], &b[k * cin..(k + 1) * cin], &mut ab[o * cin..(o + 1) * cin]);
        }
    }
    ab
}

/// Collects a linear layer's input statistics during calibration passes.
struct StatsObserver {
    stats: InputStats,
    holdout: bool,
    /// Seconds spent accumulating (reported as the Hessians stage, not the forward).
    secs: f64,
}

impl Observer for StatsObserver {
    fn observe(&mut self, _name: &str, x: &[f32], t: usize) {
        let t0 = Instant::now();
        if self.holdout {
            self.stats.hold.add(x, t)
        } else {
            self.stats.fit.add(x, t)
        }
        self.secs += t0.elapsed().as_secs_f64();
    }
}

/// Calibration state: the hidden states of each row (rows may differ in length: a row of `t`
/// tokens holds `t × hidden` values) where the current layer has got to: entering it, or past its
/// token mixer once [`Calib::pass`] has advanced over [`Half::Mixer`].
struct Calib {
    xs: Vec<Vec<f32>>,
    n_fit: usize,
}

/// The part of a layer a calibration pass runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Half {
    /// `x += mixer(input_norm(x))`.
    Mixer,
    /// `x += mlp(post_norm(x))`.
    Mlp,
    Whole,
}

/// Where the input of a group of linears comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    /// The input norm of the layer's input: no forward needed.
    InputNorm,
    /// Inside the token mixer (its output projection's input).
    MixerInner,
    /// The post-mixer norm: the hidden states are advanced past the mixer, then normed.
    PostNorm,
    /// Inside the MLP (the down projection's input).
    MlpInner,
}

impl Calib {
    /// Run `half` of layer `l` over every row (fresh state per row); with `observe`, gather the
    /// input statistics of that linear; with `advance`, keep the outputs.
    fn pass(
        &mut self,
        model: &mut Model,
        l: usize,
        half: Half,
        observe: Option<usize>,
        advance: bool,
        tm: &Timings,
    ) -> Result<Option<InputStats>> {
        let t0 = Instant::now();
        let obs = observe.map(|i| {
            let dim = model.layer_linears_mut(l)[i].in_f;
            let o = Arc::new(Mutex::new(StatsObserver { stats: InputStats::new(dim), holdout: false, secs: 0.0 }));
            model.layer_linears_mut(l)[i].observer = Some(o.clone() as Arc<Mutex<dyn Observer>>);
            o
        });
        let fresh = forge_model::Session::new(&model.cfg);
        let hidden = model.cfg.hidden_size;
        let mut run = || -> Result<()> {
            for r in 0..self.xs.len() {
                if let Some(o) = &obs {
                    o.lock().unwrap().holdout = r >= self.n_fit;
                }
                let mut st = fresh.layers[l].clone();
                let mut x = self.xs[r].clone();
                let t = x.len() / hidden;
                match half {
                    Half::Mixer => model.forward_mixer(l, &mut st, &mut x, t, 0)?,
                    Half::Mlp => model.forward_mlp(l, &mut x)?,
                    Half::Whole => model.forward_layer(l, &mut st, &mut x, t, 0)?,
                }
                if advance {
                    self.xs[r] = x;
                }
            }
            Ok(())
        };
        let ran = run();
        if let Some(i) = observe {
            model.layer_linears_mut(l)[i].observer = None;
        }
        ran?;
        let (stats, hess) = match obs {
            Some(o) => {
                let o = Arc::try_unwrap(o).map_err(|_| anyhow::anyhow!("observer still shared"))?;
                let o = o.into_inner().unwrap();
                (Some(o.stats), o.secs)
            }
            None => (None, 0.0),
        };
        tm.add(Stage::Hessians, hess);
        tm.add(Stage::CalibForward, t0.elapsed().as_secs_f64() - hess);
        Ok(stats)
    }

    /// Statistics of a norm of the rows, exactly as the forward computes it: the input norm
    /// (the token mixer's input, rows entering the layer) or the post-mixer norm (the MLP's
    /// input, rows past the mixer).
    fn norm_stats(&self, model: &Model, l: usize, post: bool, tm: &Timings) -> InputStats {
        let t0 = Instant::now();
        let h = model.cfg.hidden_size;
        let mut st = InputStats::new(h);
        let layer = &model.layers[l];
        let norm = if post { &layer.post_norm } else { &layer.input_norm };
        let mut secs = 0.0;
        for (r, x) in self.xs.iter().enumerate() {
            let t = x.len() / h;
            let mut normed = vec![0f32; t * h];
            for (xi, o) in x.chunks(h).zip(normed.chunks_mut(h)) {
                forge_kernels::norm::rmsnorm(xi, norm, model.cfg.rms_eps, model.cfg.norm_zero_centered, o);
            }
            let t1 = Instant::now();
            if r >= self.n_fit {
                st.hold.add(&normed, t)
            } else {
                st.fit.add(&normed, t)
            }
            secs += t1.elapsed().as_secs_f64();
        }
        tm.add(Stage::Hessians, secs);
        tm.add(Stage::CalibForward, t0.elapsed().as_secs_f64() - secs);
        st
    }

    /// The statistics of a group's input; a [`Source::PostNorm`] group first advances the rows
    /// past the token mixer (quantized by then), so the MLP's passes need no mixer.
    fn stats_for(
        &mut self,
        model: &mut Model,
        l: usize,
        src: Source,
        first: usize,
        tm: &Timings,
    ) -> Result<InputStats> {
        let stats = match src {
            Source::InputNorm => Some(self.norm_stats(model, l, false, tm)),
            Source::MixerInner => self.pass(model, l, Half::Mixer, Some(first), false, tm)?,
            Source::PostNorm => {
                self.pass(model, l, Half::Mixer, None, true, tm)?;
                Some(self.norm_stats(model, l, true, tm))
            }
            Source::MlpInner => self.pass(model, l, Half::Mlp, Some(first), false, tm)?,
        };
        stats.context("calibration pass gathered no statistics")
    }
}

/// Groups of a layer's linears that share one input (indices into `layer_linears`), in the
/// true-sequential order: mixer inputs, mixer output, MLP gate/up, MLP down.
fn groups(m: &Model, l: usize) -> Vec<(Vec<usize>, Source)> {
    let g = match &m.layers[l].mixer {
        Mixer::Attention(_) => [vec![0, 1, 2], vec![3], vec![4, 5], vec![6]],
        Mixer::DeltaNet(_) => [vec![0, 1, 2, 3], vec![4], vec![5, 6], vec![7]],
    };
    let src = [Source::InputNorm, Source::MixerInner, Source::PostNorm, Source::MlpInner];
    g.into_iter().zip(src).collect()
}

/// Let go of a finished layer: its matrices leave memory (the export's files hold them; nothing
/// later in the run reads them) and the source pages it was read from are given back, which
/// keeps a streamed run's memory at one layer whatever the depth.
fn retire_layer(model: &mut Model, ck: &Checkpoint, l: usize) {
    for lin in model.layer_linears_mut(l) {
        let empty = forge_core::tensor::HostTensor::from_f32(vec![0, 0], Vec::new());
        *lin = Linear::dense(lin.name.clone(), empty, None);
    }
    ck.release(&format!("layers.{l}."));
}

fn put_linear(model: &mut Model, l: Option<usize>, i: usize, lin: Linear) {
    match l {
        Some(l) => *model.layer_linears_mut(l)[i] = lin,
        None => model.head = lin,
    }
}

/// The options as an export records them (`forge.json` → `options`) and as a resumed run must
/// find them.
pub fn options_json(o: &Options) -> Value {
    json!({
        "source": o.source_arg, "plan": o.plan.to_json(), "method": o.method.name(), "seed": o.seed,
        "calibration": o.calib.as_ref().map(|c| json!({"spec": c.spec, "seq": c.seq, "holdout": c.holdout})),
        "aw": o.aw,
        "lowrank": o.lowrank.as_ref().map(|c| json!({
            "rank": c.rank, "parts": c.parts.iter().map(|p| p.name()).collect::<Vec<_>>(), "inside_gptq": c.inside,
        })),
        "check_tokens": o.check_tokens,
        "reconstruct": o.reconstruct,
    })
}

/// [`options_json`] read back: the recipe of an existing export, to quantize `source` into
/// `output` the same way.
pub fn options_from_json(v: &Value, source: PathBuf, output: PathBuf) -> Result<Options> {
    let field = |k: &str| v.get(k).ok_or_else(|| anyhow!("options: no '{k}'"));
    let num = |x: &Value, k: &str| {
        x.get(k).and_then(Value::as_u64).map(|n| n as usize).ok_or_else(|| anyhow!("options: '{k}' must be a number"))
    };
    let plan =
        Plan::from_json(field("plan")?, Plan::uniform(forge_kernels::lut::Format::Lut4)).context("options: plan")?;
    let calib = match field("calibration")? {
        Value::Null => None,
        c => Some(CalibConfig {
            spec: c.get("spec").and_then(Value::as_str).ok_or_else(|| anyhow!("options: calibration 'spec'"))?.into(),
            seq: num(c, "seq")?,
            holdout: num(c, "holdout")?,
        }),
    };
    let lowrank = match field("lowrank")? {
        Value::Null => None,
        l => Some(LowRankConfig {
            rank: num(l, "rank")?,
            parts: l
                .get("parts")
                .and_then(Value::as_array)
                .ok_or_else(|| anyhow!("options: lowrank 'parts'"))?
                .iter()
                .map(|p| Part::parse(p.as_str().unwrap_or("")))
                .collect::<Result<_>>()?,
            inside: l.get("inside_gptq").and_then(Value::as_bool).unwrap_or(false),
        }),
    };
    Ok(Options {
        source_arg: field("source")?.as_str().unwrap_or_default().into(),
        source,
        plan,
        method: Method::parse(field("method")?.as_str().unwrap_or_default())?,
        seed: field("seed")?.as_u64().ok_or_else(|| anyhow!("options: 'seed' must be a number"))?,
        output,
        resume: false,
        stop_before_layer: None,
        probe: None,
        calib,
        aw: field("aw")?.as_bool().unwrap_or(false),
        lowrank,
        check_tokens: num(v, "check_tokens")?,
        reconstruct: num(v, "reconstruct")?,
    })
}

/// Run the quantization; returns the export's manifest.
pub fn quantize(o: &Options) -> Result<Outcome> {
    let t_start = Instant::now();
    let tm = Timings::default();
    let out = &o.output;
    if out.join(forge_model::export::MANIFEST).exists() {
        bail!("{}: already a complete export (remove it to quantize again)", out.display());
    }
    let partial = out.join(".forge-partial.json");
    let opts_json = options_json(o);
    if o.aw && o.calib.is_none() {
        bail!("activation-weighted fits need calibration data");
    }
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        if !o.resume {
            bail!("{}: output directory is not empty (use --resume to continue an interrupted run)", out.display());
        }
        let prev: Value = serde_json::from_str(
            &std::fs::read_to_string(&partial)
                .with_context(|| format!("{}: no interrupted run to resume", partial.display()))?,
        )?;
        if prev != opts_json {
            bail!("{}: the interrupted run used different options: {prev}", partial.display());
        }
    } else {
        std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
        write_atomic(&partial, serde_json::to_string_pretty(&opts_json)?.as_bytes())?;
    }
    let t_load = Instant::now();
    let (ck, mut cfg) = Checkpoint::open(&o.source)?;
    o.plan.check_layers(cfg.num_layers)?;
    if let Some(p) = o.probe {
        cfg.num_layers = p.layers.clamp(1, cfg.num_layers);
        cfg.layer_kinds.truncate(cfg.num_layers);
    }
    let tied = cfg.tie_embeddings;
    // A GGUF source keeps its block-quantized matrices in the file's mapping; each is decoded
    // to f32 only when its turn comes (`Linear::effective_weight`).
    let mut model = forge_model::load::model_with_options(&ck, cfg, &|_, _, _| Ok(None), Default::default())?;
    let n_layers = model.layers.len();
    let tok = forge_model::load::load_tokenizer(&ck).ok();
    tm.add(Stage::Load, t_load.elapsed().as_secs_f64());
    // An untied model streams: each layer leaves memory once written (its source pages too),
    // and the check follows the layers as they go. A tied head is the embedding every layer is
    // calibrated on, so it is quantized first, against the whole source model.
    let streamed = !tied;
    // The source's distribution on the check rows, before any matrix changes.
    let mut teacher = (o.check_tokens > 0)
        .then(|| {
            tm.time(Stage::Check, || {
                let (rows, text) = crate::check::check_rows(tok.as_ref(), model.cfg.vocab_size, o.check_tokens);
                match streamed {
                    true => crate::check::Teacher::streamed(&model, rows, text),
                    false => crate::check::Teacher::new(&model, rows, text),
                }
            })
        })
        .transpose()?;
    let quantized: Vec<(String, usize)> = (0..n_layers)
        .flat_map(|l| {
            layer_linears(&model, l).into_iter().map(|x| (x.name.clone(), x.out_f * x.in_f)).collect::<Vec<_>>()
        })
        .chain([(model.head.name.clone(), model.head.out_f * model.head.in_f)])
        .collect();
    let n_mats: usize = (0..n_layers).map(|l| layer_linears(&model, l).len()).sum::<usize>() + 1;
    let pb = ProgressBar::new(n_mats as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>10} [{bar:30}] {pos}/{len} matrices, {elapsed} elapsed, ETA {eta} {msg}",
        )
        .unwrap()
        .progress_chars("=> "),
    );
    pb.set_prefix(o.method.name());
    let reader = forge_model::export::Export::open_partial(out)?;
    // Calibration rows → embeddings (GPTQ needs them; RTN uses them for activation-weighted fits).
    let t_cal = Instant::now();
    let mut cal = match (o.method, &o.calib) {
        (_, Some(c)) => {
            let mut rows = crate::calib::load_rows(tok.as_ref(), &c.spec, c.seq)?;
            let mut holdout = c.holdout;
            if let Some(p) = o.probe {
                rows.truncate(p.calib_rows.max(2));
                holdout = holdout.min(rows.len() / 2);
            }
            if holdout >= rows.len() {
                bail!("holding out {holdout} of {} calibration rows leaves none to fit", rows.len());
            }
            let xs = rows.iter().map(|r| model.embed(r)).collect::<Result<Vec<_>>>()?;
            Some((Calib { xs, n_fit: rows.len() - holdout }, rows))
        }
        (Method::Gptq, None) => bail!("GPTQ needs calibration data"),
        _ => None,
    };
    tm.add(Stage::Load, t_cal.elapsed().as_secs_f64());
    if streamed {
        // Looking up the rows' embeddings mapped pages all over the table (the kernel maps the
        // neighbours of each page read); nothing reads it again until the export's copy.
        ck.release("embed_tokens.");
    }
    let head_file = out.join("lm_head.safetensors");
    let quantize_head = |model: &mut Model, mut stats: Option<InputStats>| -> Result<()> {
        if o.resume && head_file.exists() {
            let h = &model.head;
            let lin = reader.linear("lm_head", h.out_f, h.in_f)?.context("lm_head.safetensors without lm_head")?;
            model.head = lin;
        } else {
            pb.set_message("lm_head");
            if let Some(st) = &mut stats {
                prepare_stats(st, &[&model.head], o, &tm)?;
            }
            let (e, lin) = quantize_linear(&model.head, o, stats.as_ref(), &tm)?;
            let meta = [("format".to_string(), e.q.format().long_name().to_string())].into();
            tm.time(Stage::Write, || write_file(&head_file, "head", &[e], &meta))?;
            model.head = lin;
        }
        pb.inc(1);
        Ok(())
    };
    // A tied head is also the input embedding: quantize it first (on the dense model's final
    // states) so that every layer is calibrated on the embeddings it will really receive.
    if tied {
        let stats = match &mut cal {
            Some((c, rows)) => {
                let mut st = InputStats::new(model.cfg.hidden_size);
                for (r, row) in rows.iter().enumerate() {
                    let t0 = Instant::now();
                    let mut s = model.new_session();
                    let mut x = c.xs[r].clone();
                    for l in 0..n_layers {
                        model.forward_layer(l, &mut s.layers[l], &mut x, row.len(), 0)?;
                    }
                    let normed = final_norm_rows(&model, &x, row.len());
                    tm.add(Stage::CalibForward, t0.elapsed().as_secs_f64());
                    tm.time(Stage::Hessians, || {
                        if r >= c.n_fit {
                            st.hold.add(&normed, row.len())
                        } else {
                            st.fit.add(&normed, row.len())
                        }
                    });
                }
                Some(st)
            }
            None => None,
        };
        quantize_head(&mut model, stats)?;
        model.embed = Embedding::TiedHead;
        if let Some((c, rows)) = &mut cal {
            c.xs = tm.time(Stage::CalibForward, || rows.iter().map(|r| model.embed(r)).collect::<Result<Vec<_>>>())?;
        }
    }
    let mut layer_times = Vec::with_capacity(n_layers);
    for l in 0..n_layers {
        let (t_layer, before) = (Instant::now(), tm.snapshot());
        let kind = model.cfg.layer_kinds[l];
        // Per-layer pace next to the matrices' ETA: layers of one model cost about the same.
        let done: Vec<f64> = layer_times.iter().filter(|t: &&LayerTime| t.kind == kind).map(|t| t.seconds).collect();
        let pace = match done.len() {
            0 => String::new(),
            n => format!(", {:.0} s a {kind:?} layer", done.iter().sum::<f64>() / n as f64),
        };
        pb.set_prefix(format!("{} layer {}/{n_layers}{pace}", o.method.name(), l + 1));
        let mut timed = |tm: &Timings| {
            let now = tm.snapshot();
            let stages = std::array::from_fn(|i| now[i] - before[i]);
            layer_times.push(LayerTime { kind, seconds: t_layer.elapsed().as_secs_f64(), stages });
        };
        if o.stop_before_layer == Some(l) {
            bail!("stopped before layer {l} (stop_before_layer)");
        }
        let mlp_file = out.join(format!("layer_{l:02}.safetensors"));
        let mixer_file = out.join(format!("layer_{l:02}_mixer.safetensors"));
        let names: Vec<(String, usize, usize)> =
            layer_linears(&model, l).iter().map(|x| (x.name.clone(), x.out_f, x.in_f)).collect();
        if let Some(t) = teacher.as_mut().filter(|_| streamed) {
            tm.time(Stage::Check, || t.source_layer(&model, l))?;
        }
        // The layer is final: the check takes it, and a streamed run lets go of it.
        let finish = |model: &mut Model, teacher: &mut Option<crate::check::Teacher>| -> Result<()> {
            if let Some(t) = teacher.as_mut().filter(|_| streamed) {
                tm.time(Stage::Check, || t.quantized_layer(model, l))?;
            }
            if streamed {
                retire_layer(model, &ck, l);
            }
            Ok(())
        };
        if o.resume && mlp_file.exists() && mixer_file.exists() {
            // Finished before the interruption: load it, so later layers calibrate on it.
            for (i, (name, of, inf)) in names.iter().enumerate() {
                let lin = reader.linear(name, *of, *inf)?.with_context(|| format!("resume: {name} missing"))?;
                let bias = model.layer_linears_mut(l)[i].bias.clone();
                let mut lin = lin;
                lin.bias = bias;
                put_linear(&mut model, Some(l), i, lin);
            }
            if let Some((c, _)) = &mut cal {
                c.pass(&mut model, l, Half::Whole, None, true, &tm)?;
            }
            finish(&mut model, &mut teacher)?;
            timed(&tm);
            pb.inc(names.len() as u64);
            continue;
        }
        let mut entries: Vec<Option<MatrixEntry>> = (0..names.len()).map(|_| None).collect();
        if cal.is_none() {
            // Without calibration no matrix depends on another: quantize the layer's matrices
            // concurrently (each result depends only on its own inputs and seed).
            pb.set_message(format!("layer {l}"));
            let lins: Vec<Linear> = layer_linears(&model, l).into_iter().cloned().collect();
            let done = tm.concurrent(|| {
                lins.par_iter().map(|lin| quantize_linear(lin, o, None, &tm)).collect::<Result<Vec<_>>>()
            })?;
            for (i, (e, q)) in done.into_iter().enumerate() {
                put_linear(&mut model, Some(l), i, q);
                entries[i] = Some(e);
            }
            pb.inc(names.len() as u64);
        }
        let calibrated = cal.is_some();
        for (g, src) in groups(&model, l).into_iter().filter(|_| calibrated) {
            let mut stats = match &mut cal {
                Some((c, _)) => Some(c.stats_for(&mut model, l, src, g[0], &tm)?),
                None => None,
            };
            // The group's matrices share their statistics and nothing else: fit them concurrently.
            pb.set_message(names[g[0]].0.clone());
            let lins: Vec<Linear> = g.iter().map(|&i| model.layer_linears_mut(l)[i].clone()).collect();
            if let Some(st) = &mut stats {
                prepare_stats(st, &lins.iter().collect::<Vec<_>>(), o, &tm)?;
            }
            let done = tm.concurrent(|| {
                lins.par_iter().map(|lin| quantize_linear(lin, o, stats.as_ref(), &tm)).collect::<Result<Vec<_>>>()
            })?;
            for (&i, (e, q)) in g.iter().zip(done) {
                put_linear(&mut model, Some(l), i, q);
                entries[i] = Some(e);
                pb.inc(1);
            }
        }
        if let Some((c, _)) = &mut cal {
            // The rows are past the token mixer (the MLP input group advanced them).
            c.pass(&mut model, l, Half::Mlp, None, true, &tm)?;
        }
        let (mut mixer, mut mlp) = (Vec::new(), Vec::new());
        for e in entries.into_iter().flatten() {
            if e.key.starts_with("mlp.") {
                mlp.push(e)
            } else {
                mixer.push(e)
            }
        }
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), mixer[0].q.format().long_name().to_string());
        meta.insert("kv_format".to_string(), o.plan.kv.long_name().to_string());
        tm.time(Stage::Write, || write_file(&mixer_file, "mixer", &mixer, &meta))?;
        // ANEMLL Forge's file-level rotation metadata (per-matrix keys carry the same facts).
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), mlp[0].q.format().long_name().to_string());
        let rotated = mlp[0].rotation.is_some();
        meta.insert("basis".to_string(), if rotated { "online" } else { "plain" }.to_string());
        meta.insert("seed_in".to_string(), (1000 + l).to_string());
        meta.insert("seed_mid".to_string(), (2000 + l).to_string());
        meta.insert("block".to_string(), mlp[0].rotation.map_or(0, |r| r.1).to_string());
        tm.time(Stage::Write, || write_file(&mlp_file, "mlp", &mlp, &meta))?;
        drop(mlp);
        finish(&mut model, &mut teacher)?;
        timed(&tm);
    }
    if !tied {
        let stats = match &cal {
            Some((c, _)) => {
                let h = model.cfg.hidden_size;
                let mut st = InputStats::new(h);
                for (r, x) in c.xs.iter().enumerate() {
                    let t = x.len() / h;
                    let normed = final_norm_rows(&model, x, t);
                    tm.time(Stage::Hessians, || {
                        if r >= c.n_fit {
                            st.hold.add(&normed, t)
                        } else {
                            st.fit.add(&normed, t)
                        }
                    });
                }
                Some(st)
            }
            None => None,
        };
        if let Some(t) = &mut teacher {
            tm.time(Stage::Check, || t.source_head(&model))?;
        }
        quantize_head(&mut model, stats)?;
        ck.release("lm_head.");
        // The untied embedding is the source's, unchanged (FP16 in the export); its pages are
        // given back as the table streams through.
        tm.time(Stage::Write, || {
            write_embedding(&out.join("embed.safetensors"), model.cfg.vocab_size, model.cfg.hidden_size, |t, row| {
                if t > 0 && t % EMBED_RELEASE_ROWS == 0 {
                    ck.release("embed_tokens.");
                }
                model.embed_row(t as u32, row)
            })
        })?;
        ck.release("embed_tokens.");
    }
    pb.finish_and_clear();
    let check = match &teacher {
        Some(t) => Some(tm.time(Stage::Check, || -> Result<_> {
            let (kl, top1, n) = t.measure(&model)?;
            let expected = crate::check::plan_expectation(&o.plan, o.method, &quantized)?;
            let low = crate::check::low_snr(out)?;
            Ok(crate::check::Check::judge(kl, top1, n, t.text.clone(), expected, low))
        })?),
        None => None,
    };
    let manifest = json!({
        "forge_version": TOOL_VERSION,
        "export_format": 1,
        "source": {
            "path": std::fs::canonicalize(&o.source).unwrap_or(o.source.clone()).to_string_lossy(),
            "name": if o.source_arg.contains('/') || o.source_arg.contains('.') { Value::Null } else { json!(o.source_arg) },
            "fingerprint": source_fingerprint(&o.source)?,
            "model_type": model.cfg.model_type,
        },
        "options": opts_json,
        "tied_embeddings": tied,
        "embedding": if tied { "tied to lm_head" } else { "embed.safetensors (FP16)" },
        "check": check.as_ref().map(|c| c.to_json()),
    });
    tm.time(Stage::Write, || {
        write_atomic(&out.join(forge_model::export::MANIFEST), serde_json::to_string_pretty(&manifest)?.as_bytes())
    })?;
    let _ = std::fs::remove_file(&partial);
    let total_seconds = t_start.elapsed().as_secs_f64();
    let named: f64 = STAGES.iter().filter(|&&s| s != Stage::Other).map(|&s| tm.get(s)).sum();
    tm.add(Stage::Other, (total_seconds - named).max(0.0));
    let stages = STAGES.iter().map(|&s| (s, tm.get(s))).collect();
    let (calib_rows, calib_seq) = match (&cal, &o.calib) {
        (Some((c, _)), Some(cc)) => (c.xs.len(), cc.seq),
        _ => (0, 0),
    };
    Ok(Outcome { manifest, stages, total_seconds, check, layers: layer_times, calib_rows, calib_seq })
}

fn final_norm_rows(model: &Model, x: &[f32], t: usize) -> Vec<f32> {
    let h = model.cfg.hidden_size;
    let mut out = vec![0f32; t * h];
    for (xi, o) in x.chunks(h).zip(out.chunks_mut(h)) {
        forge_kernels::norm::rmsnorm(xi, &model.final_norm, model.cfg.rms_eps, model.cfg.norm_zero_centered, o);
    }
    out
}
