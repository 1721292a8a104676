//! `forge quantize --dry-run`: the time and peak memory of a run projected from a short one.
//!
//! The short run quantizes the first layers that hold one layer of each kind (four for
//! `qwen3_5`: three Gated DeltaNet and one attention) and the head, on a few calibration rows.
//! Its per-layer stage times are then scaled to the whole model: each kind's mean layer times
//! its count, the stages whose work grows with the calibration tokens (calibration forward,
//! Hessians) by the ratio of tokens, the others as measured. Memory: a streamed run holds one
//! layer at a time, so its peak does not grow with depth; only the calibration hidden states
//! grow with the rows.

use crate::quantize::{Outcome, Stage, STAGES};
use forge_core::config::{LayerKind, ModelConfig};
use serde_json::{json, Value};

/// Calibration rows of the measuring run.
pub const PROBE_ROWS: usize = 8;

/// How many leading layers hold one layer of every kind the model has.
pub fn probe_layers(cfg: &ModelConfig) -> usize {
    let kinds = |n: usize| {
        let mut k: Vec<LayerKind> = cfg.layer_kinds[..n].to_vec();
        k.sort_by_key(|k| *k as u8);
        k.dedup();
        k.len()
    };
    let all = kinds(cfg.num_layers);
    (1..=cfg.num_layers).find(|&n| kinds(n) == all).unwrap_or(cfg.num_layers)
}

/// Whether a stage's work grows with the number of calibration tokens.
fn per_token(s: Stage) -> bool {
    matches!(s, Stage::CalibForward | Stage::Hessians)
}

/// A whole run, projected.
#[derive(Debug, Clone)]
pub struct Projection {
    pub seconds: f64,
    /// Seconds per stage, in [`STAGES`] order.
    pub stages: [f64; STAGES.len()],
    /// Layers of each kind in the whole model, and their projected seconds each.
    pub per_layer: Vec<(LayerKind, usize, f64)>,
    pub peak_bytes: u64,
    pub measured_peak_bytes: u64,
}

/// Project `probe` (a run over the first layers with `probe.calib_rows` rows) to the whole model
/// `cfg` calibrated on `rows` rows; `peak_bytes` is the probe's peak resident set.
pub fn project(probe: &Outcome, cfg: &ModelConfig, rows: usize, peak_bytes: u64) -> Projection {
    let token_ratio = if probe.calib_rows > 0 { rows as f64 / probe.calib_rows as f64 } else { 1.0 };
    let scale = |i: usize| if per_token(STAGES[i]) { token_ratio } else { 1.0 };
    let mut stages = [0f64; STAGES.len()];
    // Outside the layers: the load, the head, the embedding, the check's end.
    for (i, (s, t)) in probe.stages.iter().enumerate() {
        debug_assert_eq!(*s, STAGES[i]);
        let in_layers: f64 = probe.layers.iter().map(|l| l.stages[i]).sum();
        stages[i] += (t - in_layers).max(0.0) * scale(i);
    }
    let mut per_layer = Vec::new();
    let mut kinds: Vec<LayerKind> = probe.layers.iter().map(|l| l.kind).collect();
    kinds.sort_by_key(|k| *k as u8);
    kinds.dedup();
    for kind in kinds {
        let measured: Vec<_> = probe.layers.iter().filter(|l| l.kind == kind).collect();
        let count = cfg.layer_kinds.iter().filter(|&&k| k == kind).count();
        let mut each = 0.0;
        for (i, total) in stages.iter_mut().enumerate() {
            let mean = measured.iter().map(|l| l.stages[i]).sum::<f64>() / measured.len() as f64;
            *total += mean * scale(i) * count as f64;
            each += mean * scale(i);
        }
        // Wall time of a layer beyond its stages (bookkeeping) goes with it.
        let wall =
            measured.iter().map(|l| l.seconds - l.stages.iter().sum::<f64>()).sum::<f64>() / measured.len() as f64;
        stages[Stage::Other as usize] += wall.max(0.0) * count as f64;
        per_layer.push((kind, count, each + wall.max(0.0)));
    }
    let extra_rows = rows.saturating_sub(probe.calib_rows) as u64;
    let states = extra_rows * probe.calib_seq as u64 * cfg.hidden_size as u64 * 4;
    Projection {
        seconds: stages.iter().sum(),
        stages,
        per_layer,
        peak_bytes: peak_bytes + states,
        measured_peak_bytes: peak_bytes,
    }
}

impl Projection {
    pub fn to_json(&self) -> Value {
        let mut st = serde_json::Map::new();
        for (i, s) in STAGES.iter().enumerate() {
            st.insert(s.key().to_string(), json!((self.stages[i] * 10.0).round() / 10.0));
        }
        json!({
            "seconds": self.seconds.round(),
            "hours": (self.seconds / 360.0).round() / 10.0,
            "stages": st,
            "per_layer": self.per_layer.iter().map(|(k, n, t)| json!({
                "kind": format!("{k:?}"), "count": n, "seconds_each": (t * 10.0).round() / 10.0,
            })).collect::<Vec<_>>(),
            "peak_bytes": self.peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
        })
    }

    pub fn to_text(&self) -> String {
        let hms = |t: f64| {
            let t = t.round() as u64;
            format!("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
        };
        let mut s = format!("{:<22} {:>10} {:>6}\n", "stage", "h:mm:ss", "share");
        for (i, st) in STAGES.iter().enumerate() {
            if self.stages[i] > 0.5 {
                let share = 100.0 * self.stages[i] / self.seconds.max(1e-9);
                s += &format!("{:<22} {:>10} {:>5.1}%\n", st.name(), hms(self.stages[i]), share);
            }
        }
        s += &format!("{:<22} {:>10}\n", "total", hms(self.seconds));
        for (k, n, t) in &self.per_layer {
            s += &format!("{n} {k:?} layers at {t:.1} s each\n");
        }
        s += &format!(
            "peak memory {:.2} GiB (measured {:.2} GiB, plus the other calibration rows' hidden states)\n",
            self.peak_bytes as f64 / (1u64 << 30) as f64,
            self.measured_peak_bytes as f64 / (1u64 << 30) as f64
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::LayerTime;

    fn cfg(kinds: &[LayerKind]) -> ModelConfig {
        let mut c = ModelConfig::from_hf_json(&crate::synth::Shape::get("tiny").unwrap().config).unwrap();
        c.num_layers = kinds.len();
        c.layer_kinds = kinds.to_vec();
        c
    }

    #[test]
    fn probe_covers_every_kind() {
        use LayerKind::*;
        assert_eq!(probe_layers(&cfg(&[DeltaNet, DeltaNet, DeltaNet, Attention, DeltaNet])), 4);
        assert_eq!(probe_layers(&cfg(&[Attention, Attention])), 1);
    }

    /// Hand-computed: two measured layers (one per kind) scaled to 3 + 1 layers, token stages
    /// by the row ratio, the rest as measured.
    #[test]
    fn projection_scales_kinds_and_tokens() {
        use LayerKind::*;
        let mut st = [0f64; STAGES.len()];
        st[Stage::CalibForward as usize] = 2.0;
        st[Stage::Gptq as usize] = 3.0;
        let dn = LayerTime { kind: DeltaNet, seconds: 5.0, stages: st };
        let mut st2 = st;
        st2[Stage::Gptq as usize] = 1.0;
        let at = LayerTime { kind: Attention, seconds: 4.0, stages: st2 };
        let mut stages: Vec<(Stage, f64)> = STAGES.iter().map(|&s| (s, 0.0)).collect();
        stages[Stage::CalibForward as usize].1 = 4.0 + 1.0; // 1 s outside the layers (the head)
        stages[Stage::Gptq as usize].1 = 4.0 + 6.0; // 6 s the head's
        stages[Stage::Other as usize].1 = 1.0;
        let o = Outcome {
            manifest: Value::Null,
            stages,
            total_seconds: 21.0,
            check: None,
            layers: vec![dn, at],
            calib_rows: 8,
            calib_seq: 16,
        };
        let c = cfg(&[DeltaNet, DeltaNet, DeltaNet, Attention]);
        let p = project(&o, &c, 32, 1000);
        // calib forward: head 1·4 + 3·2·4 + 1·2·4 = 36; GPTQ: 6 + 3·3 + 1 = 16; other: 1 outside
        // and the attention layer's 1 s beyond its stages.
        assert_eq!(p.stages[Stage::CalibForward as usize], 36.0);
        assert_eq!(p.stages[Stage::Gptq as usize], 16.0);
        assert_eq!(p.stages[Stage::Other as usize], 2.0);
        assert_eq!(p.seconds, 54.0);
        assert_eq!(p.per_layer.iter().map(|x| x.1).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(p.peak_bytes, 1000 + 24 * 16 * c.hidden_size as u64 * 4);
    }
}
