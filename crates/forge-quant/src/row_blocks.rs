//! Quantizing a matrix too large to hold in f32 several times over, a block of rows at a time.

use crate::export::MatrixEntry;
use crate::gptq::{gptq_factored, Factor};
use crate::quantize::{InputStats, Method, Options, Stage, Timings};
use crate::quantize_matrix::{fit_codebook, normalize, row_scales, QuantMatrix};
use anyhow::{bail, Context, Result};
use forge_kernels::lut::{Format, LutMatrix};
use forge_kernels::rotation::Rotation;
use forge_model::linear::Weight;
use forge_model::Linear;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Where [`quantize_rows`] takes over and the sizes it works in.
#[derive(Clone, Copy, Debug)]
pub struct RowBlocks {
    /// Matrices above this many weights go by blocks of rows.
    pub above: usize,
    /// Weights per block of rows.
    pub block: usize,
    /// Weights of the row sample the codebook is fitted on.
    pub sample: usize,
}

impl RowBlocks {
    /// Above 256 M weights (1 GiB in f32), blocks of 64 M weights (256 MiB), a 16 M-weight sample.
    pub const DEFAULT: RowBlocks = RowBlocks { above: 1 << 28, block: 1 << 26, sample: 1 << 24 };
}

/// [`quantize_linear`] for a matrix too large to hold in f32 several times over (the 27B's head:
/// 1.27 G weights, 5 GB in f32): the codebook is fitted on evenly spaced rows, then blocks of
/// rows are decoded, rotated, scaled and assigned (round-to-nearest or GPTQ, both independent
/// from row to row once the codebook and the Hessian are fixed). Memory: one block of rows and
/// the indices. Figures (SNR, held-out SNR) are sums over the blocks, as over the whole matrix.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_rows(
    lin: &Linear,
    o: &Options,
    stats: Option<&InputStats>,
    tm: &Timings,
    format: Format,
    rot: Option<Rotation>,
    seed: u64,
    sizes: RowBlocks,
) -> Result<(MatrixEntry, Linear)> {
    let (name, out, cin) = (&lin.name, lin.out_f, lin.in_f);
    let d = format.vec_dim();
    if !out.is_multiple_of(d) {
        bail!("{name}: {} needs an even number of output rows, found {out}", format.name());
    }
    let decode = |r0: usize, n: usize| -> Result<Vec<f32>> {
        let mut w = vec![0f32; n * cin];
        lin.decode_rows(r0, n, &mut w).with_context(|| format!("{name}: rows {r0}..{}", r0 + n))?;
        Ok(w)
    };
    let rotate = |v: &mut Vec<f32>, n: usize| {
        if let Some(r) = &rot {
            r.rotate_weight(v, n)
        }
    };
    let h_fit = match stats {
        Some(s) => Some(s.fit_in(rot.as_ref()).with_context(|| format!("{name}: input statistics not prepared"))?),
        None => None,
    };
    let h_hold = stats.filter(|s| s.hold.rows > 0).map(|s| &s.hold);
    // Every block of rows runs GPTQ on the same factor: made here unless the statistics hold it.
    let local: Option<Factor>;
    let factor = match (stats.and_then(|s| s.factor(rot.as_ref())), &h_fit) {
        (Some(f), _) => Some(f),
        (None, Some(h)) if o.method == Method::Gptq && format.is_lut() => {
            local = Some(tm.time(Stage::Gptq, || Factor::new(h, cin)).with_context(|| format!("GPTQ of {name}"))?);
            local.as_ref()
        }
        _ => None,
    };
    let diag: Option<Vec<f32>> = h_fit.as_ref().map(|h| (0..cin).map(|i| h[i * cin + i]).collect());
    let codebook = if format.is_lut() {
        let groups = out / d;
        let take = (sizes.sample / (d * cin)).clamp(1, groups);
        let mut sample = Vec::with_capacity(take * d * cin);
        for i in 0..take {
            sample.extend(decode(i * groups / take * d, d)?);
        }
        rotate(&mut sample, take * d);
        let scale = row_scales(&sample, take * d, cin);
        let wn = normalize(&sample, cin, &scale);
        let aw = if o.aw { diag.as_deref() } else { None };
        tm.time(Stage::Fit, || fit_codebook(&wn, take * d, cin, format, aw, seed))
    } else {
        Vec::new()
    };
    let block = (sizes.block / cin).max(d) / d * d;
    let mut idx: Vec<u8> = Vec::with_capacity(if format.is_lut() { out / d * cin } else { 0 });
    let (mut scales, mut codes) = (Vec::with_capacity(out), Vec::new());
    let (mut signal, mut noise, mut h_signal, mut h_noise) = (0f64, 0f64, 0f64, 0f64);
    for r0 in (0..out).step_by(block) {
        let n = block.min(out - r0);
        let w = decode(r0, n)?;
        let mut t = w.clone();
        rotate(&mut t, n);
        let mut eff = if format.is_lut() {
            let scale = row_scales(&t, n, cin);
            let mut wn = normalize(&t, cin, &scale);
            let i = match factor {
                Some(f) => tm
                    .time(Stage::Gptq, || gptq_factored(&mut wn, n, f, &codebook, d))
                    .with_context(|| format!("GPTQ of {name}"))?,
                _ => tm.time(Stage::Fit, || crate::quantize_matrix::assign_rtn(&wn, n, cin, &codebook, d)),
            };
            let m = LutMatrix { format, cout: n, cin, codebook: codebook.clone(), idx: i.into(), scale };
            let e = m.reconstruct();
            idx.extend_from_slice(&m.idx);
            scales.extend_from_slice(&m.scale);
            e
        } else {
            let m = tm.time(Stage::Fit, || crate::quantize_matrix::quantize_int8(&t, n, cin));
            codes.extend_from_slice(&m.q);
            scales.extend_from_slice(&m.scale);
            m.reconstruct()
        };
        if let Some(r) = &rot {
            r.unrotate_weight(&mut eff, n);
        }
        for (a, b) in w.iter().zip(&eff) {
            signal += *a as f64 * *a as f64;
            noise += (*a as f64 - *b as f64).powi(2);
        }
        if let Some(h) = &h_hold {
            h_signal += h.loss(&w, None, n);
            h_noise += h.loss(&w, Some(&eff), n);
        }
    }
    let mut st = BTreeMap::new();
    let db = |s: f64, e: f64| if e == 0.0 { f64::INFINITY } else { 10.0 * (s / e).log10() };
    st.insert("snr_db".to_string(), format!("{:.4}", db(signal, noise)));
    if h_hold.is_some() {
        st.insert("heldout_snr_db".to_string(), format!("{:.4}", db(h_signal, h_noise.max(1e-300))));
    }
    st.insert("row_blocks".to_string(), out.div_ceil(block).to_string());
    let (q, weight) = if format.is_lut() {
        let m = LutMatrix { format, cout: out, cin, codebook, idx: idx.into(), scale: scales };
        (QuantMatrix::Lut(m.clone()), Weight::Lut(Arc::new(m)))
    } else {
        let m = forge_kernels::lut::Int8Matrix { cout: out, cin, q: codes, scale: scales };
        (QuantMatrix::Int8(m.clone()), Weight::Int8(Arc::new(m)))
    };
    let mut new = Linear::with_weight(name.clone(), out, cin, weight);
    new.bias = lin.bias.clone();
    new.rotation = rot.as_ref().map(|r| Arc::new(r.clone()) as Arc<dyn forge_model::linear::InputRotation>);
    let (_, key) = crate::export::file_and_key(name)?;
    let entry = MatrixEntry { key, q, rotation: rot.map(|r| (r.seed, r.block)), lowrank: None, stats: st };
    Ok((entry, new))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Basis, Plan};
    use crate::quantize::{matrix_seed, quantize_linear};
    use forge_core::tensor::HostTensor;
    use forge_model::sampling::Rng;

    fn options(format: Format, method: Method) -> Options {
        let mut plan = Plan::uniform(format);
        plan.mlp_basis = Basis::Online;
        Options {
            source_arg: "test".into(),
            source: "test".into(),
            plan,
            method,
            seed: 7,
            output: "unused".into(),
            resume: false,
            stop_before_layer: None,
            probe: None,
            calib: None,
            aw: method == Method::Gptq,
            lowrank: None,
            check_tokens: 0,
            reconstruct: 0,
        }
    }

    /// With the codebook's sample covering every row, blocks of rows give exactly the whole
    /// matrix's indices, scales and codebook (every step after the fit is row by row), for
    /// round-to-nearest and GPTQ, LUT and INT8, rotated; the SNR figures agree to rounding.
    #[test]
    fn blocks_of_rows_quantize_as_the_whole_matrix() {
        let (out, cin) = (96, 64);
        let mut rng = Rng::new(5);
        let w = crate::fit::normal_samples(&mut rng, out * cin);
        let name = "layers.0.mlp.gate_proj";
        let lin = Linear::dense(name, HostTensor::from_f32(vec![out, cin], w), None);
        let x = crate::fit::normal_samples(&mut rng, 200 * cin);
        let stats = |o: &Options| {
            let mut s = InputStats::new(cin);
            s.fit.add(&x[..160 * cin], 160);
            s.hold.add(&x[160 * cin..], 40);
            crate::quantize::prepare_stats(&mut s, &[&lin], o, &Timings::default()).unwrap();
            s
        };
        let sizes = RowBlocks { above: 0, block: 10 * cin, sample: out * cin };
        for (format, method) in [
            (Format::Lut4, Method::Rtn),
            (Format::Vec2x16, Method::Gptq),
            (Format::Lut3, Method::Gptq),
            (Format::Int8, Method::Rtn),
        ] {
            let o = options(format, method);
            let tm = Timings::default();
            let stats = stats(&o);
            let (whole, _) = quantize_linear(&lin, &o, Some(&stats), &tm).unwrap();
            let rot = whole.rotation.map(|(seed, _)| Rotation::new(cin, seed));
            assert!(rot.is_some());
            let seed = matrix_seed(o.seed, name);
            let (rows, q) = quantize_rows(&lin, &o, Some(&stats), &tm, format, rot, seed, sizes).unwrap();
            assert_eq!(rows.q, whole.q, "{format:?} {method:?}");
            assert_eq!(rows.rotation, whole.rotation);
            assert_eq!(rows.stats["row_blocks"], "10");
            for k in ["snr_db", "heldout_snr_db"] {
                let (a, b): (f64, f64) = (rows.stats[k].parse().unwrap(), whole.stats[k].parse().unwrap());
                assert!((a - b).abs() < 2e-4, "{format:?} {k}: {a} vs {b}");
            }
            assert_eq!((q.out_f, q.in_f), (out, cin));
        }
    }
}
