//! The bit-budget planner: one format per part of the model (a layer's token mixer, its MLP
//! gate+up, its MLP down, the head) that minimizes the predicted KL under a budget of bits per
//! weight, from a sensitivity file.
//!
//! Like ANEMLL Forge's planner (the research notes, "sensitivity"), the prediction assumes the
//! parts' KL costs add up; the combined export's real KL is what `forge eval` then measures.
//! The choice is a multiple-choice knapsack, solved exactly by dynamic programming over the
//! budget cut into [`CELLS`] cells, each option's bits rounded to the nearest cell. Where every
//! cost is a whole number of cells (as in the tests) the optimum is exact; otherwise it is the
//! exact optimum of the rounded costs. A plan never exceeds the budget: when the exact bits of
//! an answer do, the program runs again with the capacity cut by the excess.
//!
//! The sensitivity file (`forge sensitivity` writes it) is JSON:
//!
//! ```json
//! { "base": { "mlp": "lut4", ... },           // the plan every measurement started from
//!   "fixed_bits": 0, "fixed_weights": 0,      // weights outside the parts (embedding, ...)
//!   "parts": [
//!     { "part": "3.mlp_in", "keys": ["3.gate", "3.up"], "weights": 1769472,
//!       "options": { "lut2": { "bpw": 2.25, "dkl": 0.0123 }, "lut4": { "bpw": 4.25, "dkl": 0.0 } } },
//!     { "part": "head", "keys": ["head"], "weights": 28311552, "options": { ... } } ] }
//! ```
//!
//! `dkl` is the KL change when that part alone takes the option (the base's own option has 0).

use crate::plan::Plan;
use anyhow::{anyhow, bail, Context, Result};
use forge_kernels::lut::Format;
use serde_json::{json, Value};
use std::path::Path;

/// Cells the budget is cut into for the dynamic program.
pub const CELLS: u64 = 1 << 16;

/// Parts at most (the choice table holds a byte per part and cell).
const MAX_PARTS: usize = 4096;

/// One option of a part: its format, bits per weight and predicted KL change.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub format: String,
    pub bpw: f64,
    pub dkl: f64,
}

/// A part of the model that takes one format for all its plan keys.
#[derive(Clone, Debug)]
pub struct PartSens {
    pub part: String,
    pub keys: Vec<String>,
    pub weights: u64,
    pub options: Vec<Choice>,
}

#[derive(Clone, Debug)]
pub struct Sensitivity {
    pub base: Value,
    pub fixed_bits: f64,
    pub fixed_weights: u64,
    pub parts: Vec<PartSens>,
}

impl Sensitivity {
    pub fn from_file(path: &Path) -> Result<Sensitivity> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", path.display()))?;
        Self::from_json(&v).with_context(|| format!("{}", path.display()))
    }

    pub fn from_json(v: &Value) -> Result<Sensitivity> {
        let base = v.get("base").cloned().unwrap_or_else(|| json!({}));
        let num = |k: &str| -> Result<f64> {
            match v.get(k) {
                None => Ok(0.0),
                Some(x) => x
                    .as_f64()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| anyhow!("'{k}' must be a non-negative number")),
            }
        };
        let (fixed_bits, fixed_weights) = (num("fixed_bits")?, num("fixed_weights")? as u64);
        let list = v.get("parts").and_then(Value::as_array).ok_or_else(|| anyhow!("'parts' must be an array"))?;
        if list.is_empty() || list.len() > MAX_PARTS {
            bail!("'parts' holds {} parts (1 to {MAX_PARTS})", list.len());
        }
        let mut parts = Vec::with_capacity(list.len());
        for (i, p) in list.iter().enumerate() {
            let name = p.get("part").and_then(Value::as_str).unwrap_or("").to_string();
            let at = || format!("parts[{i}] ({name})");
            let keys: Vec<String> = p
                .get("keys")
                .and_then(Value::as_array)
                .ok_or_else(|| anyhow!("{}: 'keys' must be an array of plan keys", at()))?
                .iter()
                .map(|k| k.as_str().map(str::to_string).ok_or_else(|| anyhow!("{}: a key is not a string", at())))
                .collect::<Result<_>>()?;
            if keys.is_empty() {
                bail!("{}: no plan keys", at());
            }
            let weights = p
                .get("weights")
                .and_then(Value::as_u64)
                .filter(|&w| w > 0)
                .ok_or_else(|| anyhow!("{}: 'weights' must be a positive integer", at()))?;
            let opts = p
                .get("options")
                .and_then(Value::as_object)
                .filter(|o| !o.is_empty())
                .ok_or_else(|| anyhow!("{}: 'options' must be a non-empty object", at()))?;
            if opts.len() > u8::MAX as usize {
                bail!("{}: {} options (at most {})", at(), opts.len(), u8::MAX);
            }
            let mut options = Vec::with_capacity(opts.len());
            for (f, o) in opts {
                Format::parse(f).with_context(|| format!("{}: option '{f}'", at()))?;
                let get = |k: &str| {
                    o.get(k)
                        .and_then(Value::as_f64)
                        .filter(|x| x.is_finite())
                        .ok_or_else(|| anyhow!("{}: option '{f}': '{k}' must be a finite number", at()))
                };
                let (bpw, dkl) = (get("bpw")?, get("dkl")?);
                if !(0.0..=64.0).contains(&bpw) {
                    bail!("{}: option '{f}': bpw {bpw} is outside 0..=64", at());
                }
                options.push(Choice { format: f.clone(), bpw, dkl });
            }
            parts.push(PartSens { part: name, keys, weights, options });
        }
        Ok(Sensitivity { base, fixed_bits, fixed_weights, parts })
    }

    /// All weights the budget is over.
    pub fn total_weights(&self) -> u64 {
        self.fixed_weights + self.parts.iter().map(|p| p.weights).sum::<u64>()
    }
}

/// The planner's answer: one option index per part, with what it predicts.
#[derive(Clone, Debug)]
pub struct Planned {
    pub choice: Vec<usize>,
    pub bpw: f64,
    pub predicted_dkl: f64,
}

/// The exact multiple-choice knapsack over integer costs: one option per item, total cost at
/// most `capacity`, least total loss. `None` when even the cheapest options exceed it.
pub fn knapsack(items: &[Vec<(u64, f64)>], capacity: u64) -> Option<Vec<usize>> {
    let cap = capacity as usize;
    // best[c]: least loss of the items so far at total cost exactly ≤ c (∞: none).
    let mut best = vec![0f64; cap + 1];
    let mut pick = vec![0u8; items.len() * (cap + 1)];
    for (i, opts) in items.iter().enumerate() {
        let mut next = vec![f64::INFINITY; cap + 1];
        let row = &mut pick[i * (cap + 1)..(i + 1) * (cap + 1)];
        for (k, &(cost, loss)) in opts.iter().enumerate() {
            let Ok(cost) = usize::try_from(cost) else { continue };
            for c in cost..=cap {
                let v = best[c - cost] + loss;
                // Ties keep the earlier option: the answer does not depend on float noise.
                if v < next[c] {
                    next[c] = v;
                    row[c] = k as u8;
                }
            }
        }
        best = next;
    }
    if !best[cap].is_finite() {
        return None;
    }
    let mut c = cap;
    let mut choice = vec![0; items.len()];
    for i in (0..items.len()).rev() {
        let k = pick[i * (cap + 1) + c] as usize;
        choice[i] = k;
        c -= items[i][k].0 as usize;
    }
    Some(choice)
}

/// The least predicted KL within `bpw` bits per weight over all of `s`'s weights.
pub fn plan(s: &Sensitivity, bpw: f64) -> Result<Planned> {
    if !(bpw.is_finite() && bpw > 0.0) {
        bail!("--bpw must be a positive number, found {bpw}");
    }
    let total = s.total_weights() as f64;
    let budget = bpw * total - s.fixed_bits;
    let cheapest: f64 =
        s.parts.iter().map(|p| p.weights as f64 * p.options.iter().map(|o| o.bpw).fold(f64::INFINITY, f64::min)).sum();
    if budget < cheapest {
        bail!(
            "a budget of {bpw} bits per weight is below the cheapest plan ({:.3} bits per weight)",
            (cheapest + s.fixed_bits) / total
        );
    }
    let unit = (budget / CELLS as f64).max(f64::MIN_POSITIVE);
    let cost = |p: &PartSens, o: &Choice| (p.weights as f64 * o.bpw / unit).round() as u64;
    let items: Vec<Vec<(u64, f64)>> =
        s.parts.iter().map(|p| p.options.iter().map(|o| (cost(p, o), o.dkl)).collect()).collect();
    let bits_of = |choice: &[usize]| -> f64 {
        s.parts.iter().zip(choice).map(|(p, &k)| p.weights as f64 * p.options[k].bpw).sum()
    };
    // Exact bits within float rounding of the budget count as within it.
    let slack = budget * 1e-12;
    let mut capacity = CELLS;
    let choice = loop {
        let choice = knapsack(&items, capacity).ok_or_else(|| {
            anyhow!("no plan fits {bpw} bits per weight once each option's bits are rounded to the planner's cells")
        })?;
        let over = bits_of(&choice) - budget;
        if over <= slack {
            break choice;
        }
        capacity = capacity.saturating_sub((over / unit).ceil().max(1.0) as u64);
    };
    let bits = bits_of(&choice);
    let dkl = s.parts.iter().zip(&choice).map(|(p, &k)| p.options[k].dkl).sum();
    Ok(Planned { choice, bpw: (bits + s.fixed_bits) / total, predicted_dkl: dkl })
}

/// The plan file for `planned`: the sensitivity's base with every part's keys set to its
/// format (the key `head` sets the head's).
pub fn plan_json(s: &Sensitivity, planned: &Planned) -> Result<Value> {
    let mut v = s.base.clone();
    let obj = v.as_object_mut().ok_or_else(|| anyhow!("'base' must be a plan object"))?;
    for (p, &k) in s.parts.iter().zip(&planned.choice) {
        for key in &p.keys {
            obj.insert(key.clone(), Value::String(p.options[k].format.clone()));
        }
    }
    // The result must read back as a plan.
    Plan::from_json(&v, Plan::uniform(Format::Lut4)).context("the planned plan does not parse")?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> u64 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *s >> 33
    }

    fn brute(items: &[Vec<(u64, f64)>], cap: u64) -> Option<f64> {
        let n = items.len();
        let mut idx = vec![0usize; n];
        let mut best: Option<f64> = None;
        loop {
            let cost: u64 = idx.iter().zip(items).map(|(&k, it)| it[k].0).sum();
            if cost <= cap {
                let loss: f64 = idx.iter().zip(items).map(|(&k, it)| it[k].1).sum();
                best = Some(best.map_or(loss, |b: f64| b.min(loss)));
            }
            let mut i = 0;
            loop {
                if i == n {
                    return best;
                }
                idx[i] += 1;
                if idx[i] < items[i].len() {
                    break;
                }
                idx[i] = 0;
                i += 1;
            }
        }
    }

    /// Random small instances against enumerating every combination: the same least loss, a
    /// plan within the capacity, and `None` exactly when nothing fits.
    #[test]
    fn knapsack_finds_the_enumerated_optimum() {
        let mut s = 42u64;
        for case in 0..300 {
            let n = 1 + (lcg(&mut s) % 7) as usize;
            let items: Vec<Vec<(u64, f64)>> = (0..n)
                .map(|_| {
                    (0..1 + lcg(&mut s) % 4).map(|_| (lcg(&mut s) % 20, (lcg(&mut s) % 1000) as f64 / 100.0)).collect()
                })
                .collect();
            let cap = lcg(&mut s) % 80;
            let want = brute(&items, cap);
            let got = knapsack(&items, cap);
            match (want, got) {
                (None, None) => {}
                (Some(w), Some(c)) => {
                    let cost: u64 = c.iter().zip(&items).map(|(&k, it)| it[k].0).sum();
                    let loss: f64 = c.iter().zip(&items).map(|(&k, it)| it[k].1).sum();
                    assert!(cost <= cap, "case {case}: cost {cost} over {cap}");
                    assert!((loss - w).abs() < 1e-9, "case {case}: loss {loss}, optimum {w}");
                }
                (w, g) => panic!("case {case}: enumeration {w:?}, knapsack {g:?}"),
            }
        }
    }

    /// A format's name, its bits per weight and its KL change.
    type Opt<'a> = (&'a str, f64, f64);

    fn sens(parts: &[(&str, u64, &[Opt])]) -> Sensitivity {
        let parts: Vec<Value> = parts
            .iter()
            .map(|(k, w, opts)| {
                let o: serde_json::Map<String, Value> =
                    opts.iter().map(|(f, b, d)| (f.to_string(), json!({"bpw": b, "dkl": d}))).collect();
                json!({"part": k, "keys": [k], "weights": w, "options": o})
            })
            .collect();
        Sensitivity::from_json(&json!({"base": {"mlp": "lut4"}, "parts": parts})).unwrap()
    }

    /// Additive sensitivities with an optimum known by hand: the planner takes it, keeps to the
    /// budget, writes the formats under the parts' keys, and refuses a budget below the
    /// cheapest plan with the figure.
    #[test]
    fn plans_take_the_least_kl_within_the_budget() {
        // Three equal parts; 3 bits per weight on average allow one part at 2 bits and one at 4
        // (or all three at 3). The cheapest KL: down at lut2 costs least, so the other two get
        // the best they can afford.
        let s = sens(&[
            ("0.gate", 1024, &[("lut2", 2.0, 0.30), ("lut3", 3.0, 0.10), ("lut4", 4.0, 0.01)]),
            ("0.up", 1024, &[("lut2", 2.0, 0.25), ("lut3", 3.0, 0.08), ("lut4", 4.0, 0.02)]),
            ("0.down", 1024, &[("lut2", 2.0, 0.05), ("lut3", 3.0, 0.04), ("lut4", 4.0, 0.00)]),
        ]);
        let p = plan(&s, 3.0).unwrap();
        let formats: Vec<&str> = p.choice.iter().zip(&s.parts).map(|(&k, q)| q.options[k].format.as_str()).collect();
        // gate lut4 + up lut3 + down lut2: 0.01 + 0.08 + 0.05 = 0.14 (all lut3: 0.22; gate lut3,
        // up lut4, down lut2: 0.17).
        assert_eq!(formats, ["lut4", "lut3", "lut2"]);
        assert!((p.predicted_dkl - 0.14).abs() < 1e-12);
        assert!(p.bpw <= 3.0);
        let v = plan_json(&s, &p).unwrap();
        assert_eq!(v["0.gate"], "lut4");
        assert_eq!(v["0.down"], "lut2");
        assert_eq!(v["mlp"], "lut4");
        let e = plan(&s, 1.5).unwrap_err().to_string();
        assert!(e.contains("cheapest plan (2.000 bits per weight)"), "{e}");
        // A generous budget takes the least KL everywhere.
        assert!((plan(&s, 8.0).unwrap().predicted_dkl - 0.03).abs() < 1e-12);
    }

    /// Sizes and bits that are no whole number of cells (a real model's): every plan keeps to
    /// its budget exactly, and none is worse than the enumerated optimum at a budget lower by
    /// one cell per part (the rounding's reach).
    #[test]
    fn plans_with_fractional_costs_keep_to_the_budget() {
        let mut r = 7u64;
        let fmts = ["lut2", "lut3", "lut4", "int8"];
        for case in 0..200 {
            let n = 1 + (lcg(&mut r) % 6) as usize;
            let parts: Vec<(String, u64, Vec<Opt>)> = (0..n)
                .map(|i| {
                    let w = 1000 + lcg(&mut r) % 100_000;
                    let opts = fmts
                        .iter()
                        .map(|f| (*f, 2.0 + (lcg(&mut r) % 7000) as f64 / 1000.0, (lcg(&mut r) % 1000) as f64 / 997.0))
                        .collect();
                    (format!("{i}.gate"), w, opts)
                })
                .collect();
            let refs: Vec<(&str, u64, &[Opt])> = parts.iter().map(|(k, w, o)| (k.as_str(), *w, o.as_slice())).collect();
            let s = sens(&refs);
            let bpw = 2.5 + (lcg(&mut r) % 5000) as f64 / 1000.0;
            let total = s.total_weights() as f64;
            let Ok(p) = plan(&s, bpw) else { continue };
            assert!(p.bpw * total <= bpw * total * (1.0 + 1e-12), "case {case}: {} over {bpw}", p.bpw);
            let exact = |budget: f64| -> Option<f64> {
                let unit = 1e-3;
                let items: Vec<Vec<(u64, f64)>> = s
                    .parts
                    .iter()
                    .map(|q| {
                        q.options.iter().map(|o| ((q.weights as f64 * o.bpw / unit).ceil() as u64, o.dkl)).collect()
                    })
                    .collect();
                brute(&items, (budget / unit).floor() as u64)
            };
            let cell = bpw * total / CELLS as f64;
            if let Some(opt) = exact(bpw * total - n as f64 * 2.0 * cell) {
                assert!(p.predicted_dkl <= opt + 1e-9, "case {case}: {} against {opt}", p.predicted_dkl);
            }
        }
    }

    /// Costs that round down to a plan the DP thinks fits while its exact bits do not: the
    /// planner runs again and answers with one that fits.
    #[test]
    fn a_plan_over_the_budget_after_rounding_is_replaced() {
        let unit = 9000.0 / CELLS as f64;
        // Two lut4 parts of 25486.4 cells each and one lut2 of 14563.56: rounded, 65536 cells
        // (the whole capacity); exactly, 0.36 of a cell over.
        let x = 25486.4 * unit / 1000.0;
        let opts: &[Opt] = &[("lut2", 2.0, 1.0), ("lut4", x, 0.0)];
        let s = sens(&[("0.gate", 1000, opts), ("0.up", 1000, opts), ("0.down", 1000, opts)]);
        let p = plan(&s, 3.0).unwrap();
        assert!(p.bpw <= 3.0, "{} bits per weight", p.bpw);
        assert!((p.predicted_dkl - 2.0).abs() < 1e-12, "{}", p.predicted_dkl);
    }

    #[test]
    fn malformed_sensitivity_files_are_refused_by_field() {
        let bad = [
            (json!({"parts": []}), "'parts' holds 0 parts"),
            (
                json!({"parts": [{"part": "x", "keys": [], "weights": 1, "options": {"lut4": {"bpw": 4, "dkl": 0}}}]}),
                "no plan keys",
            ),
            (json!({"parts": [{"part": "x", "keys": ["0.gate"], "weights": 0, "options": {}}]}), "'weights'"),
            (
                json!({"parts": [{"part": "x", "keys": ["0.gate"], "weights": 4, "options": {"lut9": {"bpw": 4, "dkl": 0}}}]}),
                "option 'lut9'",
            ),
            (
                json!({"parts": [{"part": "x", "keys": ["0.gate"], "weights": 4, "options": {"lut4": {"bpw": 4}}}]}),
                "'dkl'",
            ),
        ];
        for (v, want) in bad {
            let e = format!("{:#}", Sensitivity::from_json(&v).unwrap_err());
            assert!(e.contains(want), "{e} (wanted {want})");
        }
    }
}
