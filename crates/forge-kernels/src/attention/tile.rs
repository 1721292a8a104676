//! Prefill's attention: the query groups of consecutive tokens over one history, taken
//! together. Token `i` of a tile attends the first `n0 + i` rows; the tile scores every key
//! row of a part once for all its tokens' heads (a key block widened once for the tile, not
//! once a token) and sums every value row once for them, each token stopping at its own last
//! row. Every token gets the bits [`super::attend_group`] gives it alone — the same parts, the
//! same products in the same order, the same statistics and merge — so a prompt's logits do
//! not depend on how it is cut into chunks or tiles, and prefill gives decode's bits.

use super::{attend_group, exp_shifted, int_keys, merge_parts, n_parts, part_len, History, KvElem, Part, Runs};
use crate::scratch::Buf;

/// The first `n` rows of a history.
#[derive(Clone, Copy)]
struct Prefix<R> {
    inner: R,
    n: usize,
}

impl<'a, K: KvElem, V: KvElem, R: Runs<'a, K, V>> Runs<'a, K, V> for Prefix<R> {
    fn rows(&self) -> usize {
        self.n
    }

    fn run(&self, j0: usize, j1: usize) -> History<'a, K, V> {
        self.inner.run(j0, j1.min(self.n))
    }
}

/// `out_ih = softmax(q_ih·Kᵀ·scale) V` over the first `n0 + i` rows of the history, for the `t`
/// tokens of `q` (token-major: `g` heads of `d` values a token, the query heads that share the
/// history's key/value head), `out` holding `g` heads of `dv` values a token. Each token's
/// output has the bits [`attend_group`] gives it alone.
///
/// # Panics
/// If `q` and `out` are not whole tokens, `n0` is 0 or the history has fewer than `n0 + t − 1`
/// rows.
#[allow(clippy::too_many_arguments)]
pub fn attend_tokens<'a, K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    g: usize,
    n0: usize,
    kv: impl Runs<'a, K, V>,
    scale: f32,
    out: &mut [f32],
) {
    assert!(
        d > 0 && g > 0 && q.len().is_multiple_of(g * d),
        "{} query values are not whole tokens of {g}×{d}",
        q.len()
    );
    let t = q.len() / (g * d);
    if t == 0 {
        return;
    }
    assert!(out.len().is_multiple_of(t * g), "output of {} values for {t} tokens of {g} heads", out.len());
    assert!(n0 > 0 && n0 + t - 1 <= kv.rows(), "tokens at rows {n0}..{} of a history of {}", n0 + t, kv.rows());
    let dv = out.len() / (t * g);
    // Runs of tokens whose histories are cut into parts of one length.
    let mut i = 0;
    while i < t {
        let len = part_len(n0 + i);
        let e = (i + 1..t).find(|&e| part_len(n0 + e) != len).unwrap_or(t);
        tile(&q[i * g * d..e * g * d], d, g, n0 + i, kv, scale, &mut out[i * g * dv..e * g * dv]);
        i = e;
    }
}

/// [`attend_tokens`] for tokens whose histories have one part length.
fn tile<'a, K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    g: usize,
    n0: usize,
    kv: impl Runs<'a, K, V>,
    scale: f32,
    out: &mut [f32],
) {
    let t = q.len() / (g * d);
    let dv = out.len() / (t * g);
    let one = |i: usize, out: &mut [f32]| {
        let mut scores = Buf::for_overwrite(g * part_len(n0 + i));
        let kv = Prefix { inner: kv, n: n0 + i };
        attend_group(&q[i * g * d..(i + 1) * g * d], d, kv, scale, &mut scores, out);
    };
    if t == 1 {
        return one(0, out);
    }
    let done = if K::codes(&[]).is_some() {
        // Query heads that cannot be coded (see `int_keys`) take the float path, for the whole
        // group of a token alone: token by token then, as decode would.
        int_keys::with_query_codes(q, d, scale, |qc| qc.map(|qc| together(q, Some(qc), d, g, n0, kv, scale, out)))
            .is_some()
    } else {
        together(q, None, d, g, n0, kv, scale, out);
        true
    };
    if !done {
        for (i, o) in out.chunks_mut(g * dv).enumerate() {
            one(i, o);
        }
    }
}

/// The tile's tokens part by part: every row of the part scored for every token's heads, each
/// token's statistics and value sums over its own rows of it, then each token's parts merged.
#[allow(clippy::too_many_arguments)]
fn together<'a, K: KvElem, V: KvElem>(
    q: &[f32],
    qc: Option<&int_keys::QueryCodes>,
    d: usize,
    g: usize,
    n0: usize,
    kv: impl Runs<'a, K, V>,
    scale: f32,
    out: &mut [f32],
) {
    let t = q.len() / (g * d);
    let (rows, dv) = (t * g, out.len() / (t * g));
    let last = n0 + t - 1;
    let (len, parts) = (part_len(n0), n_parts(last));
    // Token i's parts at i · parts · slot, each its outputs then its statistics, as
    // `attend_group` lays them out for `merge_parts`.
    let slot = g * dv + 2 * g;
    let mut slots = Buf::for_overwrite(t * parts * slot);
    let mut scores = Buf::for_overwrite(rows * len);
    let mut sums = Buf::for_overwrite(rows * dv);
    let mut lim = vec![0usize; rows];
    for p in 0..parts {
        let j0 = p * len;
        let part = Part { d, dv, j0, j1: (j0 + len).min(last), s_stride: len };
        // Tokens before `a` end before this part.
        let a = (j0 + 1).saturating_sub(n0);
        for (i, l) in lim.chunks_mut(g).enumerate() {
            l.fill(if i < a { 0 } else { (j0 + len).min(n0 + i) - j0 });
        }
        part.scores(q, qc, kv, scale, &mut scores, false);
        for i in a..t {
            let st = &mut slots[(i * parts + p) * slot + g * dv..(i * parts + p + 1) * slot];
            for h in 0..g {
                let r = i * g + h;
                (st[2 * h], st[2 * h + 1]) = exp_shifted(&mut scores[r * len..r * len + lim[r]]);
            }
        }
        sums.fill(0.0);
        part.values(kv, &mut scores, &mut sums, Some(&lim));
        for i in a..t {
            slots[(i * parts + p) * slot..(i * parts + p) * slot + g * dv]
                .copy_from_slice(&sums[i * g * dv..(i + 1) * g * dv]);
        }
    }
    for (i, o) in out.chunks_mut(g * dv).enumerate() {
        let own = n_parts(n0 + i);
        merge_parts(g, &slots[i * parts * slot..(i * parts + own) * slot], o);
    }
}
