//! The gated delta rule of Gated DeltaNet, for one value head, in two forms that agree to
//! rounding: the recurrent form (decode, one token at a time) and the chunked form (prefill),
//! following the math of transformers' `torch_recurrent_gated_delta_rule` and
//! `torch_chunk_gated_delta_rule`.
//!
//! State `S` is `dk × dv` (row-major: `S[i*dv + j]`). Inputs are per token: `q`, `k` already
//! L2-normalized (and `q` scaled by `dk^-1/2`), `v`, the log-decay `g ≤ 0` and `beta`.

use crate::simd::axpy;

/// One token: `S ← e^g S; S ← S + k ⊗ β(v − Sᵀk); out = Sᵀq`, in two passes over the state
/// (decay with `Sᵀk`, then the update with `Sᵀq`) where one step a pass would take four; the same
/// roundings in the same order as [`recurrent_step_ref`].
pub fn recurrent_step(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, out: &mut [f32]) {
    let dv = v.len();
    let decay = g.exp();
    with_delta(dv, |delta| {
        for (i, &ki) in k.iter().enumerate() {
            let row = &mut state[i * dv..(i + 1) * dv];
            // The first pass reads the state from memory (the 27B's 150 MiB); the heads of a
            // worker lie end to end, so asking 16 KiB ahead reaches into the next one. It makes
            // the 27B's steps for one token (48 layers × 48 heads of 128×128) about 1.25× as
            // fast (`examples/state_probe.rs` times them).
            crate::simd::prefetch_l2(row.as_ptr() as *const u8, 4 * dv, 16384);
            crate::simd::scale_axpy(decay, row, ki, delta);
        }
        for (d, &vj) in delta.iter_mut().zip(v) {
            *d = (vj - *d) * beta;
        }
        out.iter_mut().for_each(|o| *o = 0.0);
        for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
            crate::simd::axpy2(ki, delta, &mut state[i * dv..(i + 1) * dv], qi, out);
        }
    })
}

/// [`recurrent_step`] one step per pass: the reference it is tested against.
#[cfg(test)]
fn recurrent_step_ref(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, out: &mut [f32]) {
    let dv = v.len();
    let decay = g.exp();
    state.iter_mut().for_each(|s| *s *= decay);
    with_delta(dv, |delta| {
        for (i, &ki) in k.iter().enumerate() {
            axpy(ki, &state[i * dv..(i + 1) * dv], delta);
        }
        for (d, &vj) in delta.iter_mut().zip(v) {
            *d = (vj - *d) * beta;
        }
        for (i, &ki) in k.iter().enumerate() {
            axpy(ki, delta, &mut state[i * dv..(i + 1) * dv]);
        }
        out.iter_mut().for_each(|o| *o = 0.0);
        for (i, &qi) in q.iter().enumerate() {
            axpy(qi, &state[i * dv..(i + 1) * dv], out);
        }
    })
}

/// `f(delta)` with `dv` zeros on the stack for the usual head sizes (this runs on pool workers,
/// which should not need scratch of their own).
fn with_delta(dv: usize, f: impl FnOnce(&mut [f32])) {
    let mut stack = [0f32; 256];
    if dv <= stack.len() {
        f(&mut stack[..dv])
    } else {
        f(&mut crate::scratch::Buf::zeros(dv))
    }
}

/// Many tokens with the chunked (UT-transform) form; `q`, `k` are `t × dk`, `v`/`out` `t × dv`.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    chunk: usize,
    out: &mut [f32],
) {
    let t = g.len();
    let mut start = 0;
    // Scratch reused across chunks.
    use crate::scratch::Buf;
    let mut cum = Buf::zeros(chunk);
    let mut nmat = Buf::zeros(chunk * chunk);
    let mut vnew = Buf::zeros(chunk * dv);
    let mut kcd = Buf::zeros(chunk * dk);
    let mut tmp = Buf::zeros(dv);
    while start < t {
        let l = chunk.min(t - start);
        let (qc, kc, vc) = (&q[start * dk..], &k[start * dk..], &v[start * dv..]);
        let mut acc = 0f32;
        for i in 0..l {
            acc += g[start + i];
            cum[i] = acc;
        }
        // N[i][j] = β_i (k_i·k_j) e^{c_i − c_j}, j < i: strictly lower part of the UT system.
        for i in 0..l {
            let ki = &kc[i * dk..(i + 1) * dk];
            for j in 0..i {
                let kj = &kc[j * dk..(j + 1) * dk];
                nmat[i * chunk + j] = beta[start + i] * crate::simd::dot(ki, kj) * (cum[i] - cum[j]).exp();
            }
        }
        // Forward substitution: (I + N) X = [β v | β k e^c].
        for i in 0..l {
            let b = beta[start + i];
            let vi = &mut vnew[i * dv..(i + 1) * dv];
            for (o, &x) in vi.iter_mut().zip(&vc[i * dv..(i + 1) * dv]) {
                *o = b * x;
            }
            let ec = cum[i].exp();
            let ki = &mut kcd[i * dk..(i + 1) * dk];
            for (o, &x) in ki.iter_mut().zip(&kc[i * dk..(i + 1) * dk]) {
                *o = b * x * ec;
            }
            for j in 0..i {
                let n = nmat[i * chunk + j];
                if n != 0.0 {
                    let (prev_v, cur_v) = vnew.split_at_mut(i * dv);
                    axpy(-n, &prev_v[j * dv..(j + 1) * dv], &mut cur_v[..dv]);
                    let (prev_k, cur_k) = kcd.split_at_mut(i * dk);
                    axpy(-n, &prev_k[j * dk..(j + 1) * dk], &mut cur_k[..dk]);
                }
            }
        }
        // v_new_i = X_i − kcd_i S
        for i in 0..l {
            let vi = &mut vnew[i * dv..(i + 1) * dv];
            for (r, &c) in kcd[i * dk..(i + 1) * dk].iter().enumerate() {
                axpy(-c, &state[r * dv..(r + 1) * dv], vi);
            }
        }
        // out_i = (q_i e^{c_i}) S + Σ_{j≤i} (q_i·k_j) e^{c_i − c_j} v_new_j
        for i in 0..l {
            let qi = &qc[i * dk..(i + 1) * dk];
            let oi = &mut out[(start + i) * dv..(start + i + 1) * dv];
            oi.iter_mut().for_each(|o| *o = 0.0);
            let ec = cum[i].exp();
            for (r, &x) in qi.iter().enumerate() {
                axpy(x * ec, &state[r * dv..(r + 1) * dv], oi);
            }
            for j in 0..=i {
                let a = crate::simd::dot(qi, &kc[j * dk..(j + 1) * dk]) * (cum[i] - cum[j]).exp();
                axpy(a, &vnew[j * dv..(j + 1) * dv], oi);
            }
        }
        // S ← e^{c_last} S + Σ_i (k_i e^{c_last − c_i}) ⊗ v_new_i
        let last = cum[l - 1];
        let el = last.exp();
        state.iter_mut().for_each(|s| *s *= el);
        for i in 0..l {
            let w = (last - cum[i]).exp();
            tmp.copy_from_slice(&vnew[i * dv..(i + 1) * dv]);
            for (r, &kr) in kc[i * dk..(i + 1) * dk].iter().enumerate() {
                axpy(kr * w, &tmp, &mut state[r * dv..(r + 1) * dv]);
            }
        }
        start += l;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn normalize(x: &mut [f32], d: usize, scale: f32) {
        for row in x.chunks_mut(d) {
            crate::norm::l2norm_inplace(row, 1e-6);
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }

    #[test]
    fn chunked_equals_recurrent() {
        let (dk, dv, t) = (8, 5, 150);
        let mut s = 7u64;
        let mut q = rnd(t * dk, &mut s);
        let mut k = rnd(t * dk, &mut s);
        normalize(&mut q, dk, (dk as f32).powf(-0.5));
        normalize(&mut k, dk, 1.0);
        let v = rnd(t * dv, &mut s);
        let g: Vec<f32> = rnd(t, &mut s).iter().map(|x| -0.5 * (x + 1.0)).collect();
        let beta: Vec<f32> = rnd(t, &mut s).iter().map(|x| 0.5 * (x + 1.0)).collect();
        let init = rnd(dk * dv, &mut s);
        let mut s_rec = init.clone();
        let mut o_rec = vec![0f32; t * dv];
        for i in 0..t {
            let (qi, ki, vi) = (&q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk], &v[i * dv..(i + 1) * dv]);
            recurrent_step(&mut s_rec, qi, ki, vi, g[i], beta[i], &mut o_rec[i * dv..(i + 1) * dv]);
        }
        for chunk in [64, 16, 7] {
            let mut s_ch = init.clone();
            let mut o_ch = vec![0f32; t * dv];
            chunked(&mut s_ch, &q, &k, &v, &g, &beta, dk, dv, chunk, &mut o_ch);
            let e_o = o_ch.iter().zip(&o_rec).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let e_s = s_ch.iter().zip(&s_rec).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(e_o < 1e-4 && e_s < 1e-4, "chunk {chunk}: out err {e_o}, state err {e_s}");
        }
    }

    #[test]
    fn two_pass_step_equals_the_one_step_per_pass_reference_bit_for_bit() {
        // 128 × 128 (the 27B's heads), ragged widths, and one past the stack buffer.
        for &(dk, dv) in &[(128usize, 128usize), (8, 5), (16, 37), (4, 300)] {
            let mut s = (dk * 1000 + dv) as u64;
            let init = rnd(dk * dv, &mut s);
            let (mut s_new, mut s_ref) = (init.clone(), init);
            for step in 0..4 {
                let mut q = rnd(dk, &mut s);
                let mut k = rnd(dk, &mut s);
                normalize(&mut q, dk, (dk as f32).powf(-0.5));
                normalize(&mut k, dk, 1.0);
                let v = rnd(dv, &mut s);
                let (g, beta) = (-0.1 - 0.2 * step as f32, 0.3 + 0.1 * step as f32);
                let (mut o_new, mut o_ref) = (vec![f32::NAN; dv], vec![f32::NAN; dv]);
                recurrent_step(&mut s_new, &q, &k, &v, g, beta, &mut o_new);
                recurrent_step_ref(&mut s_ref, &q, &k, &v, g, beta, &mut o_ref);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&o_new), bits(&o_ref), "{dk}×{dv}, step {step}: output");
                assert_eq!(bits(&s_new), bits(&s_ref), "{dk}×{dv}, step {step}: state");
            }
        }
    }

    #[test]
    fn delta_rule_writes_value_when_beta_is_one() {
        // With no decay, β = 1 and a unit key, reading with the same key returns the value.
        let (dk, dv) = (4, 3);
        let mut st = vec![0.3f32; dk * dv];
        let k = [0.0f32, 1.0, 0.0, 0.0];
        let v = [1.0f32, -2.0, 0.5];
        let mut out = [0f32; 3];
        recurrent_step(&mut st, &k, &k, &v, 0.0, 1.0, &mut out);
        for j in 0..dv {
            assert!((out[j] - v[j]).abs() < 1e-6);
        }
    }
}
