//! The per-position math: log-softmax, top-K selection, KL(teacher ‖ candidate) over top-K + tail
//! or the full vocabulary, and the summary statistics.
//!
//! Teacher and candidate rows go through the same functions with the same summation order, and
//! every log-probability is rounded to f32 exactly where the stored reference rounds it. A model
//! evaluated against its own reference therefore gives KL = 0 exactly, not merely ~1e-9.

use serde::{Deserialize, Serialize};

/// Normalizer of one logit row, with the probability mass split between a token set (the
/// teacher's top-K) and the rest.
#[derive(Clone, Copy, Debug)]
pub struct RowStats {
    /// `log Σ exp(z)`.
    pub lse: f64,
    /// `log Σ_{j ∉ set} exp(z_j) − lse`: log of the mass outside the set, summed directly (never
    /// as `1 − Σ_set`, which cancels catastrophically when the set holds nearly all the mass).
    /// `-inf` when the set is the whole vocabulary.
    pub log_rest: f64,
}

/// `in_set[j]` marks the set. One pass, f64 accumulation in index order.
pub fn row_stats(z: &[f32], in_set: &[bool]) -> RowStats {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let (mut s_set, mut s_rest) = (0f64, 0f64);
    for (&v, &inside) in z.iter().zip(in_set) {
        let e = (v as f64 - m).exp();
        if inside {
            s_set += e;
        } else {
            s_rest += e;
        }
    }
    let s = s_set + s_rest;
    let log_rest = if s_rest > 0.0 { s_rest.ln() - s.ln() } else { f64::NEG_INFINITY };
    RowStats { lse: m + s.ln(), log_rest }
}

/// Log-probability of token `i` as stored (f32).
#[inline]
pub fn logp(z: &[f32], i: usize, st: &RowStats) -> f32 {
    (z[i] as f64 - st.lse) as f32
}

/// Ids of the `k` largest logits, largest first, ties by lower id (so the first is the argmax
/// that [`argmax`] returns). `idx` is scratch.
pub fn top_k(z: &[f32], k: usize, idx: &mut Vec<u32>) -> Vec<u32> {
    let k = k.min(z.len());
    idx.clear();
    idx.extend(0..z.len() as u32);
    let cmp = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    let mut top = idx[..k].to_vec();
    top.sort_unstable_by(cmp);
    top
}

/// First index of the largest value (the sampler's greedy choice).
pub fn argmax(z: &[f32]) -> usize {
    forge_model::sampling::argmax(z) as usize
}

/// `p · (log p − log q)` with the conventions 0·log 0 = 0 and p > 0, q = 0 → +inf.
#[inline]
fn term(lp: f64, lq: f64) -> f64 {
    if lp == f64::NEG_INFINITY {
        return 0.0;
    }
    let p = lp.exp();
    if p == 0.0 {
        return 0.0;
    }
    p * (lp - lq)
}

/// Top-K + tail KL: `Σ_{i∈topK} p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail)`.
/// `t_logp`/`t_tail` are the teacher's stored values; `q_logp[i]` is the candidate's log-prob of
/// token `ids[i]` and `q_tail` the log of its mass outside `ids`. This is KL between the two
/// distributions coarsened to K+1 outcomes, hence ≤ the full-vocabulary KL (log-sum inequality).
pub fn kl_topk_tail(t_logp: &[f32], t_tail: f32, q_logp: &[f32], q_tail: f64) -> f64 {
    let mut kl = 0f64;
    for (&lp, &lq) in t_logp.iter().zip(q_logp) {
        kl += term(lp as f64, lq as f64);
    }
    kl + term(t_tail as f64, q_tail)
}

/// Exact KL over the whole vocabulary from two rows of log-probabilities.
pub fn kl_full(t_logp: &[f32], q_logp: &[f32]) -> f64 {
    t_logp.iter().zip(q_logp).map(|(&lp, &lq)| term(lp as f64, lq as f64)).sum()
}

/// [`kl_full`] against a candidate's raw logits, without materializing its log-prob row; each
/// log q is rounded to f32 exactly as [`logp`] rounds it.
pub fn kl_full_vs_logits(t_logp: &[f32], z: &[f32], st: &RowStats) -> f64 {
    t_logp.iter().zip(z).map(|(&lp, &zj)| term(lp as f64, ((zj as f64 - st.lse) as f32) as f64)).sum()
}

/// Mean and quantiles. Median and percentiles follow llama-perplexity's `--kl-divergence`
/// output: the median averages the two middle values of an even count, a percentile
/// interpolates linearly at `fraction · (n − 1)` of the sorted values.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub min: f64,
    pub max: f64,
}

pub fn percentile_sorted(v: &[f64], fraction: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    if fraction <= 0.0 {
        return v[0];
    }
    if fraction >= 1.0 {
        return v[v.len() - 1];
    }
    let p = fraction * (v.len() - 1) as f64;
    let ip = p as usize;
    let frac = p - ip as f64;
    (1.0 - frac) * v[ip] + frac * v[(ip + 1).min(v.len() - 1)]
}

pub fn summarize(values: &[f64]) -> Distribution {
    let n = values.len();
    if n == 0 {
        let nan = f64::NAN;
        return Distribution { count: 0, mean: nan, median: nan, p90: nan, p99: nan, p999: nan, min: nan, max: nan };
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let median = if n.is_multiple_of(2) { 0.5 * (v[n / 2] + v[n / 2 - 1]) } else { v[n / 2] };
    Distribution {
        count: n,
        mean: v.iter().sum::<f64>() / n as f64,
        median,
        p90: percentile_sorted(&v, 0.90),
        p99: percentile_sorted(&v, 0.99),
        p999: percentile_sorted(&v, 0.999),
        min: v[0],
        max: v[n - 1],
    }
}

/// `exp(mean NLL)`.
pub fn perplexity(nll: &[f64]) -> f64 {
    if nll.is_empty() {
        return f64::NAN;
    }
    (nll.iter().sum::<f64>() / nll.len() as f64).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small deterministic generator (SplitMix64), so the property tests need no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn unif(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.unif().max(1e-300), self.unif());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    /// Teacher-side quantities of a row as the reference stores them.
    fn teacher_side(z: &[f32], k: usize) -> (Vec<u32>, Vec<f32>, f32, Vec<f32>) {
        let ids = top_k(z, k, &mut Vec::new());
        let mut mask = vec![false; z.len()];
        ids.iter().for_each(|&i| mask[i as usize] = true);
        let st = row_stats(z, &mask);
        let lp = ids.iter().map(|&i| logp(z, i as usize, &st)).collect();
        let full = (0..z.len()).map(|j| logp(z, j, &st)).collect();
        (ids, lp, st.log_rest as f32, full)
    }

    fn candidate_side(z: &[f32], ids: &[u32]) -> (Vec<f32>, f64, Vec<f32>) {
        let mut mask = vec![false; z.len()];
        ids.iter().for_each(|&i| mask[i as usize] = true);
        let st = row_stats(z, &mask);
        let lq = ids.iter().map(|&i| logp(z, i as usize, &st)).collect();
        let full = (0..z.len()).map(|j| logp(z, j, &st)).collect();
        (lq, (st.log_rest as f32) as f64, full)
    }

    /// KL by the definition, in f64 straight from the logits: an oracle independent of the
    /// functions above.
    fn kl_oracle(zp: &[f32], zq: &[f32]) -> f64 {
        let ls = |z: &[f32]| {
            let m = z.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = z.iter().map(|&v| (v as f64 - m).exp()).sum();
            z.iter().map(|&v| v as f64 - m - s.ln()).collect::<Vec<f64>>()
        };
        let (lp, lq) = (ls(zp), ls(zq));
        lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum()
    }

    #[test]
    fn closed_form_kl() {
        // p = (1/2, 1/4, 1/4), q = (1/4, 1/2, 1/4): KL = ½ln2 + ¼ln(½) = ¼ ln 2.
        let zp = [2f32.ln(), 0.0, 0.0];
        let zq = [0.0, 2f32.ln(), 0.0];
        let want = 0.25 * 2f64.ln();
        let (ids, lp, tail, full_p) = teacher_side(&zp, 3);
        let (lq, qtail, full_q) = candidate_side(&zq, &ids);
        assert_eq!(tail, f32::NEG_INFINITY);
        assert!((kl_topk_tail(&lp, tail, &lq, qtail) - want).abs() < 1e-7);
        assert!((kl_full(&full_p, &full_q) - want).abs() < 1e-7);
        // Top-1 + tail: p coarsened to (½, ½), q to (¼, ¾): ½ln2 + ½ln(2/3).
        let (ids, lp, tail, _) = teacher_side(&zp, 1);
        assert_eq!(ids, vec![0]);
        let (lq, qtail, _) = candidate_side(&zq, &ids);
        let want1 = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_topk_tail(&lp, tail, &lq, qtail) - want1).abs() < 1e-7);
        assert!(want1 < want);
    }

    #[test]
    fn self_kl_is_exactly_zero() {
        let mut r = Rng(7);
        for _ in 0..20 {
            let z: Vec<f32> = (0..1000).map(|_| (3.0 * r.normal()) as f32).collect();
            let (ids, lp, tail, full) = teacher_side(&z, 64);
            let (lq, qtail, fq) = candidate_side(&z, &ids);
            assert_eq!(kl_topk_tail(&lp, tail, &lq, qtail), 0.0);
            assert_eq!(kl_full(&full, &fq), 0.0);
            let mut mask = vec![false; z.len()];
            ids.iter().for_each(|&i| mask[i as usize] = true);
            assert_eq!(kl_full_vs_logits(&full, &z, &row_stats(&z, &mask)), 0.0);
        }
    }

    #[test]
    fn topk_tail_is_a_lower_bound_close_to_full_kl() {
        let mut r = Rng(42);
        for case in 0..300 {
            let v = [8, 50, 500, 3000][case % 4];
            let k = [1, 4, 32, 256][(case / 4) % 4].min(v);
            let sharp = [0.5, 2.0, 5.0][case % 3];
            let noise = [0.01, 0.1, 1.0][(case / 3) % 3];
            let zp: Vec<f32> = (0..v).map(|_| (sharp * r.normal()) as f32).collect();
            let zq: Vec<f32> = zp.iter().map(|&x| x + (noise * r.normal()) as f32).collect();
            let (ids, lp, tail, full_p) = teacher_side(&zp, k);
            let (lq, qtail, full_q) = candidate_side(&zq, &ids);
            let coarse = kl_topk_tail(&lp, tail, &lq, qtail);
            let full = kl_full(&full_p, &full_q);
            let mut mask = vec![false; v];
            ids.iter().for_each(|&i| mask[i as usize] = true);
            assert_eq!(kl_full_vs_logits(&full_p, &zq, &row_stats(&zq, &mask)), full);
            let oracle = kl_oracle(&zp, &zq);
            assert!((full - oracle).abs() <= 1e-6 + 1e-5 * oracle, "case {case}: full {full} oracle {oracle}");
            assert!(coarse <= full + 1e-6, "case {case}: top-{k}+tail {coarse} > full {full}");
            assert!(coarse >= -1e-6, "case {case}: {coarse}");
            if k == v {
                assert!((coarse - full).abs() < 1e-6, "case {case}: k = V must be exact");
            }
        }
        // With the mass concentrated in the top-K, the coarse KL captures nearly all of it.
        let zp: Vec<f32> =
            (0..5000).map(|i| if i < 20 { 10.0 + (i as f32) * 0.1 } else { r.normal() as f32 }).collect();
        let zq: Vec<f32> = zp.iter().map(|&x| x + (0.2 * r.normal()) as f32).collect();
        let (ids, lp, tail, full_p) = teacher_side(&zp, 256);
        let (lq, qtail, full_q) = candidate_side(&zq, &ids);
        let (coarse, full) = (kl_topk_tail(&lp, tail, &lq, qtail), kl_full(&full_p, &full_q));
        assert!(coarse <= full + 1e-9 && coarse > 0.95 * full, "coarse {coarse} full {full}");
    }

    #[test]
    fn tail_mass_is_stable_when_the_top_holds_nearly_everything() {
        // Top token has all but ~1e-30 of the mass: 1 − Σ top would round to 0.
        let mut z = vec![0f32; 100];
        z[0] = 80.0;
        let mut mask = vec![false; 100];
        mask[0] = true;
        let st = row_stats(&z, &mask);
        let want = (99f64).ln() - 80.0; // log(99 e^0 / (e^80 + 99)) ≈ ln 99 − 80
        assert!((st.log_rest - want).abs() < 1e-9, "{} vs {want}", st.log_rest);
        assert!(st.log_rest.is_finite());
    }

    #[test]
    fn top_k_order_and_ties() {
        let z = [1.0, 3.0, 3.0, -1.0, 2.0];
        assert_eq!(top_k(&z, 3, &mut Vec::new()), vec![1, 2, 4]);
        assert_eq!(top_k(&z, 10, &mut Vec::new()), vec![1, 2, 4, 0, 3]);
        assert_eq!(argmax(&z), 1);
        assert!(top_k(&z, 0, &mut Vec::new()).is_empty());
    }

    #[test]
    fn statistics_match_llama_perplexity_definitions() {
        let d = summarize(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((d.mean, d.median, d.min, d.max), (2.5, 2.5, 1.0, 4.0));
        // p99 at 0.99·3 = 2.97 → 3 + 0.97·(4 − 3)
        assert!((d.p99 - 3.97).abs() < 1e-12);
        let d = summarize(&[5.0, 1.0, 3.0]);
        assert_eq!(d.median, 3.0);
        assert!((perplexity(&[2f64.ln(), 2f64.ln()]) - 2.0).abs() < 1e-12);
        assert!(summarize(&[]).mean.is_nan());
    }
}
