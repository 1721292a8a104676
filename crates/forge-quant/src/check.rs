//! The check at the end of `forge quantize`: KL(source ‖ quantized) over a few hundred tokens that
//! no codebook or Hessian saw, set against what the plan's formats reach with a working recipe,
//! and each matrix's held-out output SNR against its format's. A figure far off its expectation
//! means a broken model (an outlier the recipe did not handle, a format too coarse for the method),
//! and the run says so instead of leaving the user to find out from the model's answers.

use crate::plan::Plan;
use crate::quantize::Method;
use anyhow::{bail, Result};
use forge_core::safetensors_dir::SafetensorsSet;
use forge_core::tokenizer::Tokenizer;
use forge_kernels::lut::Format;
use forge_model::model::Model;
use forge_model::sampling::Rng;
use forge_model::Logits;
use serde_json::{json, Value};
use std::path::Path;

/// Tokens per check row.
pub const ROW_TOKENS: usize = 128;
/// Default length of the check, in tokens (two rows: prose and code).
pub const DEFAULT_TOKENS: usize = 256;
/// A quick KL above this many nats is a broken model whatever the format: the quantized model
/// then agrees with the source's top token less than a third of the time.
pub const BROKEN_KL: f64 = 2.0;
/// A quick KL more than this many times the plan's expectation is far off it.
pub const KL_FACTOR: f64 = 4.0;
/// ... and more than this much above it (nats), so that near-lossless formats do not trip on noise.
pub const KL_SLACK: f64 = 0.05;
/// A held-out output SNR this many dB under the format's expectation is far off it.
pub const SNR_MARGIN_DB: f64 = 10.0;

/// Quick KL (nats) on the check text that a working recipe reaches on SmolLM2-135M with the whole
/// model in `format` and the default rotations; larger models lose less. Round-to-nearest: every
/// format measured (`forge quantize --model smollm2 --format F --kv F --head F`); GPTQ: lut4 and
/// vec2x64 measured (`--preset q4`, `--preset q3 --ncal 16`), the others placed from the
/// llama.cpp-protocol figures of docs/results.md at the same ratio of check to protocol KL.
pub fn expected_kl(format: Format, method: Method) -> f64 {
    let (rtn, gptq) = match format {
        Format::F16 | Format::Bf16 => (0.001, 0.001),
        Format::Int8 => (0.004, 0.004),
        Format::Lut4 => (0.52, 0.15),
        Format::Vec2x64 => (2.2, 0.5),
        Format::Lut3 => (2.8, 0.7),
        Format::Vec2x16 => (8.0, 2.8),
        Format::Lut2 => (8.5, 3.0),
    };
    if method == Method::Gptq {
        gptq
    } else {
        rtn
    }
}

/// Weight SNR (dB) of round-to-nearest on i.i.d. Gaussian weights: what a rotated matrix's
/// output SNR is expected to reach at least (GPTQ does better). `None` for the float formats.
pub fn expected_snr_db(format: Format) -> Option<f64> {
    match format {
        Format::F16 | Format::Bf16 => None,
        Format::Int8 => Some(40.0),
        Format::Lut4 => Some(20.1),
        Format::Vec2x64 => Some(15.2),
        Format::Lut3 => Some(14.5),
        Format::Vec2x16 => Some(9.7),
        Format::Lut2 => Some(9.3),
    }
}

/// The check text: the last `ROW_TOKENS`-token window of `data/calib/prose.txt` and of
/// `code.txt` (the default calibration takes the first windows, so these are held out), or
/// seeded random token ids when there is no tokenizer or no calibration directory.
pub fn check_rows(tok: Option<&Tokenizer>, vocab: usize, tokens: usize) -> (Vec<Vec<u32>>, String) {
    let n_rows = tokens.div_ceil(ROW_TOKENS).max(1);
    let len = tokens.clamp(2, ROW_TOKENS);
    if let (Some(tok), Some(dir)) = (tok, crate::calib::calib_dir()) {
        let mut rows = Vec::new();
        for (r, file) in ["prose.txt", "code.txt"].iter().cycle().take(n_rows).enumerate() {
            let Ok(text) = std::fs::read_to_string(dir.join(file)) else { break };
            let Ok(ids) = tok.encode(&text, false) else { break };
            // Row r of a file counts back from its end: windows r/2 + 1 from the end.
            let back = (r / 2 + 1) * len;
            if ids.len() < back {
                break;
            }
            rows.push(ids[ids.len() - back..ids.len() - back + len].to_vec());
        }
        if rows.len() == n_rows {
            let ok = rows.iter().all(|r| r.iter().all(|&t| (t as usize) < vocab));
            if ok {
                return (rows, format!("data/calib prose.txt and code.txt, last windows, {n_rows} × {len} tokens"));
            }
        }
    }
    let mut rng = Rng::new(0xC4EC);
    let rows = (0..n_rows).map(|_| (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()).collect();
    (rows, format!("seeded random token ids, {n_rows} × {len} tokens"))
}

/// The source model's log-probabilities on the check rows, taken before any matrix changes.
///
/// Either whole ([`Teacher::new`]: the source model's forward before the run) or streamed
/// alongside a layer-by-layer run ([`Teacher::streamed`]): the check rows' hidden states are then
/// carried through each source layer before it is quantized ([`Teacher::source_layer`]) and
/// through the quantized layer after ([`Teacher::quantized_layer`]), so a run that lets go of
/// each layer as it finishes never needs the whole model, source or quantized, at once. The
/// same operations in the same order: both ways give the same bits.
pub struct Teacher {
    pub rows: Vec<Vec<u32>>,
    pub text: String,
    logp: Vec<Vec<f32>>,
    /// Streamed: the rows' hidden states through the source's layers so far.
    source: Vec<Vec<f32>>,
    /// Streamed: the rows' hidden states through the quantized layers so far.
    quantized: Vec<Vec<f32>>,
}

/// Full-vocabulary log-probabilities of each row of `z`.
fn log_probs(z: &[f32], v: usize) -> Vec<f32> {
    let all = vec![true; v];
    let mut lp = vec![0f32; z.len()];
    for (zr, lr) in z.chunks(v).zip(lp.chunks_mut(v)) {
        let st = crate::eval::kl::row_stats(zr, &all);
        for (i, l) in lr.iter_mut().enumerate() {
            *l = crate::eval::kl::logp(zr, i, &st);
        }
    }
    lp
}

/// Layer `l` of `model` over each row's hidden states, each row from a fresh state.
fn advance(model: &Model, l: usize, xs: &mut [Vec<f32>]) -> Result<()> {
    let fresh = forge_model::Session::new(&model.cfg);
    for x in xs.iter_mut() {
        let t = x.len() / model.cfg.hidden_size;
        model.forward_layer(l, &mut fresh.layers[l].clone(), x, t, 0)?;
    }
    Ok(())
}

impl Teacher {
    pub fn new(model: &Model, rows: Vec<Vec<u32>>, text: String) -> Result<Teacher> {
        let v = model.cfg.vocab_size;
        let mut logp = Vec::with_capacity(rows.len());
        for r in &rows {
            logp.push(log_probs(&model.forward(&mut model.new_session(), r, Logits::All)?, v));
        }
        Ok(Teacher { rows, text, logp, source: Vec::new(), quantized: Vec::new() })
    }

    /// A teacher to be carried through the run: the rows' embeddings in `model`.
    pub fn streamed(model: &Model, rows: Vec<Vec<u32>>, text: String) -> Result<Teacher> {
        let xs = rows.iter().map(|r| model.embed(r)).collect::<Result<Vec<_>>>()?;
        Ok(Teacher { rows, text, logp: Vec::new(), source: xs.clone(), quantized: xs })
    }

    /// Streamed: layer `l` of the source (call before it changes).
    pub fn source_layer(&mut self, model: &Model, l: usize) -> Result<()> {
        advance(model, l, &mut self.source)
    }

    /// Streamed: layer `l` as quantized (call once it is final).
    pub fn quantized_layer(&mut self, model: &Model, l: usize) -> Result<()> {
        advance(model, l, &mut self.quantized)
    }

    /// Streamed: the source's distribution through the final norm and `model`'s head (call
    /// before the head changes).
    pub fn source_head(&mut self, model: &Model) -> Result<()> {
        let mut z = Vec::new();
        for x in std::mem::take(&mut self.source) {
            model.logits_into(&x, x.len() / model.cfg.hidden_size, &mut z)?;
            self.logp.push(log_probs(&z, model.cfg.vocab_size));
        }
        Ok(())
    }

    /// Mean KL(teacher ‖ `model`) over every position, and top-1 agreement; streamed, `model`'s
    /// head over the rows carried through its quantized layers.
    pub fn measure(&self, model: &Model) -> Result<(f64, f64, usize)> {
        let v = model.cfg.vocab_size;
        let (mut kl, mut agree, mut n) = (0f64, 0usize, 0usize);
        let none = vec![false; v];
        for (r, tl) in self.logp.iter().enumerate() {
            let z = match self.quantized.get(r) {
                Some(x) => {
                    let mut z = Vec::new();
                    model.logits_into(x, x.len() / model.cfg.hidden_size, &mut z)?;
                    z
                }
                None => model.forward(&mut model.new_session(), &self.rows[r], Logits::All)?,
            };
            if z.len() != tl.len() {
                bail!("check: vocabulary changed ({} logits, {} expected)", z.len(), tl.len());
            }
            for (zr, lr) in z.chunks(v).zip(tl.chunks(v)) {
                let st = crate::eval::kl::row_stats(zr, &none);
                kl += crate::eval::kl::kl_full_vs_logits(lr, zr, &st);
                agree += (crate::eval::kl::argmax(zr) == crate::eval::kl::argmax(lr)) as usize;
                n += 1;
            }
        }
        Ok((kl / n.max(1) as f64, agree as f64 / n.max(1) as f64, n))
    }
}

/// A matrix whose held-out output SNR is far below its format's expectation.
#[derive(Clone, Debug, PartialEq)]
pub struct LowSnr {
    pub name: String,
    pub format: Format,
    pub snr_db: f64,
    pub expected_db: f64,
}

/// The outcome of the check.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    pub kl: f64,
    pub top1: f64,
    pub positions: usize,
    pub text: String,
    /// The plan's expected quick KL (parameter-weighted over its matrices' formats).
    pub expected_kl: f64,
    /// The largest quick KL that still counts as working.
    pub limit: f64,
    pub low_snr: Vec<LowSnr>,
    /// Why the model counts as broken (empty: it does not).
    pub problems: Vec<String>,
}

impl Check {
    pub fn broken(&self) -> bool {
        !self.problems.is_empty()
    }

    /// Judge a measured quick KL and the matrices' held-out SNRs.
    pub fn judge(kl: f64, top1: f64, positions: usize, text: String, expected_kl: f64, low_snr: Vec<LowSnr>) -> Check {
        let limit = (KL_FACTOR * expected_kl).max(expected_kl + KL_SLACK).min(BROKEN_KL);
        let mut problems = Vec::new();
        if !kl.is_finite() || kl > limit {
            let why = if limit < expected_kl {
                format!("above {BROKEN_KL} nats no model is usable, and these formats by this method reach about {expected_kl:.3}")
            } else {
                "expected for these formats".to_string()
            };
            problems.push(format!(
                "quick KL {kl:.3} nats (top-1 agreement {:.1} %) against at most {limit:.3} {why}",
                100.0 * top1
            ));
        }
        if let Some(m) = low_snr.first() {
            problems.push(format!(
                "{} matri{} with held-out SNR far below the format's, worst {} ({}) at {:.1} dB against {:.1} dB",
                low_snr.len(),
                if low_snr.len() == 1 { "x" } else { "ces" },
                m.name,
                m.format.name(),
                m.snr_db,
                m.expected_db
            ));
        }
        Check { kl, top1, positions, text, expected_kl, limit, low_snr, problems }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "kl": round(self.kl, 4),
            "top1": round(self.top1, 4),
            "positions": self.positions,
            "text": self.text,
            "expected_kl": round(self.expected_kl, 4),
            "limit": round(self.limit, 4),
            "low_snr": self.low_snr.iter().map(|m| json!({
                "name": m.name, "format": m.format.name(), "heldout_snr_db": round(m.snr_db, 2),
                "expected_db": m.expected_db,
            })).collect::<Vec<_>>(),
            "verdict": if self.broken() { "broken" } else { "ok" },
            "problems": self.problems,
        })
    }

    /// The loud end-of-run message for a broken model.
    pub fn warning(&self) -> Option<String> {
        if !self.broken() {
            return None;
        }
        let mut s = String::from("WARNING: this quantized model looks broken:\n");
        for p in &self.problems {
            s += &format!("  - {p}\n");
        }
        s += "  Rotations (the default; not --rotate none), --method gptq or a --preset, or a format with more \
              bits usually fix it.";
        Some(s)
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// The matrices of the export files in `dir` whose held-out output SNR lies more than
/// [`SNR_MARGIN_DB`] under their format's expectation, worst first.
pub fn low_snr(dir: &Path) -> Result<Vec<LowSnr>> {
    let mut files: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().to_string()))
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with('.') && n != "embed.safetensors")
        .collect();
    files.sort();
    let mut low = Vec::new();
    for file in files {
        let set = SafetensorsSet::open_files(&[dir.join(&file)])?;
        let prefix = match file.strip_prefix("layer_") {
            Some(rest) => {
                format!("layers.{}.", rest.split(['_', '.']).next().unwrap_or("").parse::<usize>().unwrap_or(0))
            }
            None => String::new(),
        };
        let mut keys: Vec<&String> = set.metadata.keys().filter(|k| k.ends_with(".heldout_snr_db")).collect();
        keys.sort();
        for k in keys {
            let key = k.trim_end_matches(".heldout_snr_db");
            let (Some(f), Ok(snr)) = (set.metadata.get(&format!("{key}.format")), set.metadata[k].parse::<f64>())
            else {
                continue;
            };
            let format = Format::parse(f)?;
            if let Some(want) = expected_snr_db(format) {
                if snr < want - SNR_MARGIN_DB {
                    low.push(LowSnr { name: format!("{prefix}{key}"), format, snr_db: snr, expected_db: want });
                }
            }
        }
    }
    low.sort_by(|a, b| (a.snr_db - a.expected_db).total_cmp(&(b.snr_db - b.expected_db)).then(a.name.cmp(&b.name)));
    Ok(low)
}

/// Parameter-weighted expected quick KL of a plan over the model's quantized matrices.
pub fn plan_expectation(plan: &Plan, method: Method, matrices: &[(String, usize)]) -> Result<f64> {
    let (mut num, mut den) = (0f64, 0f64);
    for (name, params) in matrices {
        num += expected_kl(plan.format_for(name)?, method) * *params as f64;
        den += *params as f64;
    }
    Ok(if den > 0.0 { num / den } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_formats() {
        let ok = Check::judge(0.4, 0.6, 254, String::new(), expected_kl(Format::Lut4, Method::Rtn), vec![]);
        assert!(!ok.broken(), "{:?}", ok.problems);
        let bad = Check::judge(7.6, 0.05, 254, String::new(), expected_kl(Format::Lut4, Method::Rtn), vec![]);
        assert!(bad.broken() && bad.warning().unwrap().contains("quick KL 7.600"));
        // A coarse format whose expectation is itself unusable still trips the absolute limit.
        assert!(Check::judge(8.9, 0.01, 254, String::new(), expected_kl(Format::Lut2, Method::Rtn), vec![]).broken());
        // INT8 has a tight limit: 0.2 nats is far off it.
        assert!(Check::judge(0.2, 0.9, 254, String::new(), expected_kl(Format::Int8, Method::Rtn), vec![]).broken());
        assert!(!Check::judge(0.01, 0.99, 254, String::new(), expected_kl(Format::Int8, Method::Rtn), vec![]).broken());
        let low =
            LowSnr { name: "layers.3.mlp.down_proj".into(), format: Format::Lut4, snr_db: 4.0, expected_db: 20.1 };
        let c = Check::judge(0.1, 0.9, 254, String::new(), 0.45, vec![low]);
        assert!(c.broken() && c.problems[0].contains("layers.3.mlp.down_proj"), "{:?}", c.problems);
        assert_eq!(c.to_json()["verdict"], "broken");
    }
}
