//! Sensitivity sweeps: for each part of a model (a layer's token mixer, its attention K/V, its
//! MLP gate+up, its MLP down, the head), the KL change when that part alone takes another format, the rest
//! staying as in the base export (ANEMLL Forge's research notes, "sensitivity"). Each candidate
//! format is a whole export made with the base's recipe; a part "takes" a format by swapping
//! its matrices in from that export, so the figure is what the final mix would hold. KL is
//! measured against the source model on held-out calibration text ([`crate::check::check_rows`],
//! never the evaluation text). The result is the planner's input ([`crate::budget`]).

use crate::check::Teacher;
use crate::plan::{role_of, Plan};
use anyhow::{anyhow, bail, Result};
use forge_model::model::{Embedding, Model};
use forge_model::Linear;
use serde_json::{json, Value};

/// One part of the sweep: the plan keys it sets and the matrices they name.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// `3.mixer`, `3.kv`, `3.mlp_in`, `3.down`, `head`.
    pub name: String,
    pub keys: Vec<String>,
    /// Canonical names of its matrices.
    pub matrices: Vec<String>,
}

/// The plan key of a matrix (`3.gate`, `head`), or `None` for one that stays in floating point
/// (a DeltaNet's `a`/`b`).
fn plan_key(name: &str) -> Result<Option<String>> {
    let r = role_of(name)?;
    Ok(match (r.layer, r.short) {
        (None, _) => Some("head".into()),
        (Some(_), "a" | "b") => None,
        (Some(l), s) => Some(format!("{l}.{s}")),
    })
}

/// The parts of `model`, in layer order, the head last.
pub fn parts(model: &Model) -> Result<Vec<Part>> {
    let mut out = Vec::new();
    for l in 0..model.layers.len() {
        // Attention K/V apart from Q/O: their default format is a plan setting of its own.
        let mut groups: [(String, Vec<String>, Vec<String>); 4] = [
            (format!("{l}.mixer"), vec![], vec![]),
            (format!("{l}.kv"), vec![], vec![]),
            (format!("{l}.mlp_in"), vec![], vec![]),
            (format!("{l}.down"), vec![], vec![]),
        ];
        for lin in crate::quantize::layer_linears(model, l) {
            let Some(key) = plan_key(&lin.name)? else { continue };
            let g = match role_of(&lin.name)?.short {
                "k" | "v" => 1,
                "gate" | "up" => 2,
                "down" => 3,
                _ => 0,
            };
            groups[g].1.push(key);
            groups[g].2.push(lin.name.clone());
        }
        out.extend(groups.into_iter().filter(|g| !g.1.is_empty()).map(|(name, keys, matrices)| Part {
            name,
            keys,
            matrices,
        }));
    }
    out.push(Part { name: "head".into(), keys: vec!["head".into()], matrices: vec![model.head.name.clone()] });
    Ok(out)
}

fn linear_mut<'a>(model: &'a mut Model, name: &str) -> Result<&'a mut Linear> {
    if model.head.name == name {
        return Ok(&mut model.head);
    }
    let l = role_of(name)?.layer.ok_or_else(|| anyhow!("{name}: not a layer matrix"))?;
    model
        .layer_linears_mut(l)
        .into_iter()
        .find(|x| x.name == name)
        .ok_or_else(|| anyhow!("{name}: no such matrix in the model"))
}

fn linear<'a>(model: &'a Model, name: &str) -> Result<&'a Linear> {
    model.linears().into_iter().find(|x| x.name == name).ok_or_else(|| anyhow!("{name}: no such matrix in the model"))
}

/// Weights and stored bits of `part` in `model`.
fn size(model: &Model, part: &Part) -> Result<(u64, f64)> {
    let (mut w, mut bits) = (0u64, 0f64);
    for m in &part.matrices {
        let l = linear(model, m)?;
        w += (l.out_f * l.in_f) as u64;
        bits += l.weight_bytes() as f64 * 8.0;
    }
    Ok((w, bits))
}

/// Weights outside every part and their stored bits (a DeltaNet's `a`/`b`, an untied
/// embedding table).
pub fn fixed(model: &Model, parts: &[Part]) -> (u64, f64) {
    let inside: std::collections::HashSet<&str> =
        parts.iter().flat_map(|p| p.matrices.iter().map(String::as_str)).collect();
    let (mut w, mut bits) = (0u64, 0f64);
    for l in model.linears() {
        if !inside.contains(l.name.as_str()) {
            w += (l.out_f * l.in_f) as u64;
            bits += l.weight_bytes() as f64 * 8.0;
        }
    }
    match &model.embed {
        Embedding::Table(t) => {
            w += t.numel() as u64;
            bits += (t.numel() * t.dtype().size() * 8) as f64;
        }
        Embedding::Blocks(m) => {
            w += (m.rows * m.cols) as u64;
            bits += m.stored_bytes() as f64 * 8.0;
        }
        Embedding::TiedHead => {}
    }
    (w, bits)
}

/// One measured part: its entry of the sensitivity file.
pub fn measure_part(
    base: &mut Model,
    base_plan: &Plan,
    base_kl: f64,
    candidates: &[(String, Model)],
    teacher: &Teacher,
    part: &Part,
) -> Result<Value> {
    let (weights, bits) = size(base, part)?;
    let own = base_plan.format_for(&part.matrices[0])?.name().to_string();
    for m in &part.matrices[1..] {
        let f = base_plan.format_for(m)?.name();
        if f != own {
            bail!(
                "{}: the base holds it in several formats ({own}, {f}); sweep a base with one format per part",
                part.name
            );
        }
    }
    let mut options = serde_json::Map::new();
    options.insert(own.clone(), json!({"bpw": bits / weights as f64, "dkl": 0.0}));
    for (format, cand) in candidates {
        if *format == own {
            continue;
        }
        let (w, bits) = size(cand, part)?;
        if w != weights {
            bail!("{}: the candidate {format} has other shapes than the base", part.name);
        }
        let mut kept = Vec::with_capacity(part.matrices.len());
        for m in &part.matrices {
            let new = linear(cand, m)?.clone();
            kept.push(std::mem::replace(linear_mut(base, m)?, new));
        }
        let measured = teacher.measure(base);
        for (m, old) in part.matrices.iter().zip(kept) {
            *linear_mut(base, m)? = old;
        }
        let (kl, _, _) = measured?;
        options.insert(format.clone(), json!({"bpw": bits / weights as f64, "dkl": kl - base_kl}));
    }
    Ok(json!({"part": part.name, "keys": part.keys, "weights": weights, "options": options}))
}

/// An SVG of each part's KL cost per bit saved against the base, one panel per kind of part
/// (token mixer, attention K/V, MLP gate+up, MLP down, head), one line per format.
pub fn plot_svg(sens: &Value) -> String {
    let parts = sens["parts"].as_array().cloned().unwrap_or_default();
    let kinds = ["mixer", "kv", "mlp_in", "down", "head"];
    let kind_of = |name: &str| kinds.iter().position(|k| name.ends_with(k)).unwrap_or(0);
    // (kind, format) → [(layer, nats per bit saved)]
    let mut series: std::collections::BTreeMap<(usize, String), Vec<(f64, f64)>> = Default::default();
    let mut layers = 1f64;
    for (i, p) in parts.iter().enumerate() {
        let name = p["part"].as_str().unwrap_or("");
        let layer = name.split('.').next().and_then(|l| l.parse::<f64>().ok()).unwrap_or(i as f64);
        layers = layers.max(layer + 1.0);
        let opts = p["options"].as_object().cloned().unwrap_or_default();
        let base_bpw = opts.values().find(|o| o["dkl"].as_f64() == Some(0.0)).and_then(|o| o["bpw"].as_f64());
        for (f, o) in &opts {
            let (Some(b0), Some(b), Some(d)) = (base_bpw, o["bpw"].as_f64(), o["dkl"].as_f64()) else { continue };
            if b < b0 {
                series.entry((kind_of(name), f.clone())).or_default().push((layer, (d / (b0 - b)).max(1e-6)));
            }
        }
    }
    let (w, h, pad) = (900.0, 220.0, 50.0);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
    let formats: Vec<String> = {
        let mut f: Vec<String> = series.keys().map(|k| k.1.clone()).collect();
        f.sort();
        f.dedup();
        f
    };
    let ymax = series.values().flatten().map(|p| p.1).fold(1e-5f64, f64::max).log10().ceil();
    let ymin = ymax - 5.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        kinds.len() as f64 * h + 30.0
    );
    for (k, kind) in kinds.iter().enumerate() {
        let y0 = 10.0 + k as f64 * h;
        let x = |l: f64| pad + l / layers.max(1.0) * (w - 2.0 * pad);
        let yv = |v: f64| y0 + (h - 40.0) * (1.0 - (v.log10().clamp(ymin, ymax) - ymin) / (ymax - ymin));
        svg += &format!(
            "<rect x=\"{pad}\" y=\"{y0}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>\n<text x=\"{}\" y=\"{}\">{kind}: KL (nats) per bit per weight saved, by layer (log scale, 10^{ymin}..10^{ymax})</text>\n",
            w - 2.0 * pad,
            h - 40.0,
            pad + 4.0,
            y0 + 12.0
        );
        for (fi, f) in formats.iter().enumerate() {
            let Some(pts) = series.get(&(k, f.clone())) else { continue };
            let c = colors[fi % colors.len()];
            let path: Vec<String> = pts.iter().map(|&(l, v)| format!("{:.1},{:.1}", x(l + 0.5), yv(v))).collect();
            svg += &format!("<polyline fill=\"none\" stroke=\"{c}\" points=\"{}\"/>\n", path.join(" "));
            for &(l, v) in pts {
                svg += &format!("<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2\" fill=\"{c}\"/>\n", x(l + 0.5), yv(v));
            }
        }
    }
    for (fi, f) in formats.iter().enumerate() {
        svg += &format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{}\">{f}</text>\n",
            pad + fi as f64 * 90.0,
            kinds.len() as f64 * h + 20.0,
            colors[fi % colors.len()]
        );
    }
    svg + "</svg>\n"
}
