//! Token sampling: temperature, top-k, top-p, min-p, with a seeded RNG (bit-reproducible).

/// SplitMix64-seeded xoshiro256** — small, fast, and fully determined by the seed.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E3779B97F4A7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
            x ^ (x >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }
    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.95, min_p: 0.0, seed: 0 }
    }
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    /// Candidates and their probabilities, kept between calls for their buffers.
    cand: Vec<(u32, f32)>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng, cand: Vec::new(), probs: Vec::new() }
    }

    /// Pick the next token from raw logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        self.rank(logits);
        draw(&self.cand, &mut self.probs, &self.params, &mut self.rng)
    }

    /// The top-k candidates into `cand`, highest logit first; ties broken by id so the order is
    /// deterministic (a total order: partitioning off the top k and sorting those gives the
    /// same list as a full sort).
    fn rank(&mut self, logits: &[f32]) {
        let (cand, top_k) = (&mut self.cand, self.params.top_k);
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if top_k > 0 && top_k < cand.len() {
            cand.select_nth_unstable_by(top_k - 1, order);
            cand.truncate(top_k);
        }
        cand.sort_unstable_by(order);
    }
}

/// A distribution over token ids: each kept candidate and its probability (summing to 1), the
/// most likely first.
pub type Dist = Vec<(u32, f64)>;

impl Sampler {
    /// Whether every draw is the argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    /// The distribution [`Sampler::sample`] draws from for `logits` (one-hot at the argmax when
    /// greedy), into `out`: speculative decoding's target and draft distributions.
    pub fn dist_into(&mut self, logits: &[f32], out: &mut Dist) {
        out.clear();
        if self.is_greedy() {
            out.push((argmax(logits), 1.0));
            return;
        }
        self.rank(logits);
        let (cand, p) = (&self.cand, &self.params);
        let keep = kept(cand, &mut self.probs, p);
        let total: f64 = self.probs[..keep].iter().sum();
        out.extend(cand[..keep].iter().zip(&self.probs[..keep]).map(|(c, &x)| (c.0, x / total)));
    }

    /// One draw from `dist` (which need not be normalized; an empty one gives 0).
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        let total: f64 = dist.iter().map(|d| d.1).sum();
        let mut r = self.rng.next_f64() * total;
        for &(id, x) in dist {
            r -= x;
            if r < 0.0 {
                return id;
            }
        }
        dist.iter().rev().find(|d| d.1 > 0.0).or(dist.last()).map_or(0, |d| d.0)
    }

    /// Uniform in [0, 1) from the sampler's stream (speculative acceptance tests).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }
}

/// Softmax at the temperature over the ordered candidates into `probs`, then the min-p and
/// top-p cuts: how many candidates stay.
fn kept(cand: &[(u32, f32)], probs: &mut Vec<f64>, p: &SamplingParams) -> usize {
    let m = cand[0].1;
    probs.clear();
    probs.extend(cand.iter().map(|c| (((c.1 - m) / p.temperature) as f64).exp()));
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    let mut keep = probs.len();
    if p.min_p > 0.0 {
        let thr = probs[0] * p.min_p as f64;
        keep = probs.iter().take_while(|&&x| x >= thr).count().max(1);
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, &x) in probs[..keep].iter().enumerate() {
            acc += x;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    keep
}

/// Softmax at the temperature over the ordered candidates, min-p and top-p cuts, then one draw.
fn draw(cand: &[(u32, f32)], probs: &mut Vec<f64>, p: &SamplingParams, rng: &mut Rng) -> u32 {
    let keep = kept(cand, probs, p);
    let total: f64 = probs[..keep].iter().sum();
    let mut r = rng.next_f64() * total;
    for (i, &x) in probs[..keep].iter().enumerate() {
        r -= x;
        if r < 0.0 {
            return cand[i].0;
        }
    }
    cand[keep - 1].0
}

/// The first index of the largest value (NaN never wins; a NaN first value gives 0), as
/// [`argmax_ref`]: the maximum found eight lanes at a time, then its first position (the one
/// serial loop would take ~30 µs over a 49k-entry vocabulary, a few tenths of a percent of a token).
pub fn argmax(x: &[f32]) -> u32 {
    let Some(&first) = x.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut m = lanes.iter().fold(first, |a, &b| if b > a { b } else { a });
    for &v in chunks.remainder() {
        m = if v > m { v } else { m };
    }
    x.iter().position(|&v| v == m).unwrap_or(0) as u32
}

/// The one-pass definition [`argmax`] must equal.
pub fn argmax_ref(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_equals_the_one_pass_definition() {
        let mut r = Rng::new(5);
        let nan = f32::NAN;
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![nan, 5.0, 6.0],
            vec![1.0, nan, 3.0, 3.0, nan],
            vec![-0.0, 0.0, -0.0],
            vec![f32::NEG_INFINITY; 11],
            (0..49152).map(|i| (i % 977) as f32).collect(), // ties: the first one wins
            (0..1003).map(|_| r.next_f64() as f32 - 0.5).collect(),
            (0..64).map(|i| if i % 9 == 0 { nan } else { i as f32 }).collect(),
        ];
        for x in &cases {
            assert_eq!(argmax(x), if x.is_empty() { 0 } else { argmax_ref(x) }, "{:?}", &x[..x.len().min(12)]);
        }
    }

    #[test]
    fn greedy_and_seeded_reproducibility() {
        let logits = [0.1f32, 2.0, -1.0, 1.9];
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
        assert_eq!(s.sample(&logits), 1);
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 42 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn frequencies_follow_softmax() {
        // Chi-square style check: empirical frequencies within 4 sigma of softmax probabilities.
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let n = 40000;
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7 });
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        for i in 0..4 {
            let p = (logits[i] as f64).exp() / z;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!((counts[i] as f64 - n as f64 * p).abs() < 4.0 * sd, "token {i}: {} vs {}", counts[i], n as f64 * p);
        }
    }

    /// The candidates as first chosen (full sort of the vocabulary, then truncate), then the
    /// same draw: the oracle for the partitioned top-k.
    fn sample_by_full_sort(p: &SamplingParams, rng: &mut Rng, logits: &[f32]) -> u32 {
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        draw(&cand, &mut Vec::new(), p, rng)
    }

    #[test]
    fn partitioned_top_k_draws_what_a_full_sort_draws() {
        // Logits on a coarse grid, so that many tie and the id tie-break matters.
        let mut rng = Rng::new(3);
        let logits: Vec<f32> = (0..2000).map(|_| (rng.next_f64() * 40.0).floor() as f32 * 0.25).collect();
        for (top_k, top_p, min_p) in [(1, 1.0, 0.0), (2, 1.0, 0.0), (40, 0.95, 0.0), (300, 0.9, 0.05), (0, 0.8, 0.0)] {
            let p = SamplingParams { temperature: 0.8, top_k, top_p, min_p, seed: 11 };
            let mut s = Sampler::new(p.clone());
            let mut r = Rng::new(p.seed);
            for i in 0..300 {
                let want = if top_k == 1 { argmax(&logits) } else { sample_by_full_sort(&p, &mut r, &logits) };
                assert_eq!(s.sample(&logits), want, "top_k {top_k} draw {i}");
            }
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_support() {
        let logits = [5.0f32, 4.0, 0.0, -3.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 2, top_p: 1.0, min_p: 0.0, seed: 1 });
        assert!((0..500).all(|_| s.sample(&logits) < 2));
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.5, min_p: 0.0, seed: 1 });
        assert!((0..500).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn dist_is_the_distribution_sample_draws_from() {
        let logits = [0.0f32, 2.0, 1.0, -1.0, 1.0];
        let p = |top_k, top_p, min_p| SamplingParams { temperature: 1.0, top_k, top_p, min_p, seed: 3 };
        let mut d = Dist::new();
        // Top 3 of 5 (ties by id: 2 before 4), softmax over them.
        Sampler::new(p(3, 1.0, 0.0)).dist_into(&logits, &mut d);
        let z = 2f64.exp() + 2.0 * 1f64.exp();
        let want = [(1, 2f64.exp() / z), (2, 1f64.exp() / z), (4, 1f64.exp() / z)];
        assert_eq!(d.len(), 3);
        for (g, w) in d.iter().zip(want) {
            assert_eq!(g.0, w.0);
            assert!((g.1 - w.1).abs() < 1e-12, "{g:?} vs {w:?}");
        }
        // top-p 0.6 keeps the first two (0.576 < 0.6 ≤ 0.788), renormalized; min-p 0.5 keeps
        // those at least half the best (e¹/e² < 0.5: the best alone).
        Sampler::new(p(3, 0.6, 0.0)).dist_into(&logits, &mut d);
        assert_eq!(d.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2]);
        assert!((d.iter().map(|e| e.1).sum::<f64>() - 1.0).abs() < 1e-12);
        Sampler::new(p(0, 1.0, 0.5)).dist_into(&logits, &mut d);
        assert_eq!(d, [(1, 1.0)]);
        // Greedy: one-hot at the argmax.
        Sampler::new(SamplingParams { temperature: 0.0, ..p(3, 1.0, 0.0) }).dist_into(&logits, &mut d);
        assert_eq!(d, [(1, 1.0)]);
        // Draws from it follow it: 20,000 draws, each frequency within 4.5 standard deviations
        // (false-alarm rate under 1e-5 per id).
        let mut s = Sampler::new(p(3, 1.0, 0.0));
        s.dist_into(&logits, &mut d);
        let n = 20_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.draw(&d) as usize] += 1;
        }
        for &(id, q) in &d {
            let sd = (n as f64 * q * (1.0 - q)).sqrt();
            assert!(
                (counts[id as usize] as f64 - n as f64 * q).abs() < 4.5 * sd,
                "id {id}: {} of {n}",
                counts[id as usize]
            );
        }
        assert_eq!(counts[0] + counts[3], 0);
    }
}
