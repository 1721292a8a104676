use super::*;
use crate::testutil::data;

fn hist<'a>(keys: &'a [f32], values: &'a [f32], n: usize, stride: usize, offset: usize) -> History<'a> {
    History { keys, values, key_scales: RowScales::None, value_scales: RowScales::None, n, stride, offset }
}

#[test]
fn single_key_returns_its_value_and_uniform_scores_average() {
    let q = [1.0f32, 0.0];
    let keys = [0.5f32, 0.5, 9.0, 9.0];
    let values = [1.0f32, 2.0, 7.0, 7.0];
    let mut s = [0f32; 2];
    let mut out = [0f32; 2];
    attend_group(&q, 2, hist(&keys, &values, 1, 4, 0), 1.0, &mut s, &mut out);
    assert_eq!(out, [1.0, 2.0]);
    let keys2 = [0.0f32, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0];
    let values2 = [2.0f32, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0];
    attend_group(&q, 2, hist(&keys2, &values2, 2, 4, 0), 1.0, &mut s, &mut out);
    assert!((out[0] - 3.0).abs() < 1e-6); // q·k = 0 for both: mean of values
}

#[test]
fn grouped_heads_match_one_head_at_a_time() {
    for (d, g) in [(8usize, 2usize), (64, 3), (128, 8), (256, 2)] {
        let kvh = 2;
        let stride = d * kvh;
        for n in [1usize, 5, 8, 33, 70] {
            let keys = data(n * stride, (d + g + n) as u32);
            let values = data(n * stride, (7 * d + n) as u32);
            let q = data(g * d, (g + n) as u32);
            let mut s = vec![0f32; g * n];
            let mut got = vec![0f32; g * d];
            attend_group(&q, d, hist(&keys, &values, n, stride, d), 0.3, &mut s, &mut got);
            for h in 0..g {
                let mut want = vec![0f32; d];
                attend_ref(&q[h * d..(h + 1) * d], hist(&keys, &values, n, stride, d), 0.3, &mut want);
                for (a, b) in got[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d={d} g={g} n={n} head {h}: {a} vs {b}");
                }
                // One head on its own gives the same bits as inside the group.
                let mut alone = vec![0f32; d];
                let mut s1 = vec![0f32; n];
                attend_group(&q[h * d..(h + 1) * d], d, hist(&keys, &values, n, stride, d), 0.3, &mut s1, &mut alone);
                assert_eq!(alone, got[h * d..(h + 1) * d], "d={d} g={g} n={n} head {h} alone");
            }
        }
    }
}

#[test]
fn parts_cover_the_history_once() {
    for n in (0..600).chain([1000, 4095, 4096, 4097, 100_000]) {
        let (len, parts) = (part_len(n), n_parts(n));
        assert!(len % 8 == 0 && (MIN_PART..=MAX_PART).contains(&len), "n={n}: {parts} parts of {len}");
        assert!(parts >= 1 && (parts <= MAX_PARTS || len == MAX_PART), "n={n}: {parts} parts of {len}");
        let (keys, values) = (vec![0f32; n.max(1)], vec![0f32; n.max(1)]);
        let kv = hist(&keys, &values, n, 1, 0);
        let rows: Vec<usize> = (0..parts).map(|p| kv.part(p).n).collect();
        assert_eq!(rows.iter().sum::<usize>(), n, "n={n}: {rows:?}");
        assert!(rows.iter().all(|&r| r > 0 || n == 0), "n={n}: an empty part {rows:?}");
    }
}

#[test]
fn merged_parts_match_the_definition_in_any_order_of_work() {
    // A long history in many parts; the parts computed last to first give the same bits,
    // and an empty part (as verify's earlier tokens leave) changes nothing: prefill's items
    // (`attend_group`) and decode's or verify's (parts, then `merge_parts`, asking for rows
    // ahead) agree. Heads alone in their rows, and at an offset in rows of two heads.
    let (d, g, n) = (64usize, 3usize, 517usize);
    assert!(n_parts(n) > 4);
    for (stride, offset) in [(d, 0), (2 * d, d)] {
        let keys = data(n * stride, 11);
        let values = data(n * stride, 12);
        let q = data(g * d, 13);
        let mut scores = vec![0f32; g * n];
        let mut got = vec![0f32; g * d];
        attend_group(&q, d, hist(&keys, &values, n, stride, offset), 0.125, &mut scores, &mut got);
        let slot = g * d + 2 * g;
        let parts = n_parts(n);
        let mut slots = vec![0f32; (parts + 1) * slot];
        for p in (0..parts).rev() {
            let (o, st) = slots[p * slot..(p + 1) * slot].split_at_mut(g * d);
            attend_part(&q, d, hist(&keys, &values, n, stride, offset).part(p), 0.125, &mut scores, o, st, true);
        }
        let (o, st) = slots[parts * slot..].split_at_mut(g * d);
        attend_part(&q, d, hist(&keys, &values, 0, stride, offset), 0.125, &mut scores, o, st, true);
        assert_eq!(st, [f32::NEG_INFINITY, 0.0].repeat(g));
        let mut again = vec![0f32; g * d];
        merge_parts(g, &slots, &mut again);
        assert_eq!(again, got);
        for h in 0..g {
            let mut want = vec![0f32; d];
            attend_ref(&q[h * d..(h + 1) * d], hist(&keys, &values, n, stride, offset), 0.125, &mut want);
            for (a, b) in got[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "stride {stride} head {h}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn an_f16_history_gives_the_attention_of_its_values_in_f32() {
    // Converting f16 to f32 is exact, so an f16 cache attends exactly as an f32 cache
    // holding the same (rounded) values: the same bits where the AVX2 path runs it.
    for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9)] {
        let k16: Vec<f16> = data(n * d, 21).iter().map(|&v| f16::from_f32(v)).collect();
        let v16: Vec<f16> = data(n * d, 22).iter().map(|&v| f16::from_f32(v)).collect();
        let (k32, v32): (Vec<f32>, Vec<f32>) =
            (k16.iter().map(|v| v.to_f32()).collect(), v16.iter().map(|v| v.to_f32()).collect());
        let q = data(g * d, 23);
        let kv16 = History {
            keys: &k16[..],
            values: &v16[..],
            key_scales: RowScales::None,
            value_scales: RowScales::None,
            n,
            stride: d,
            offset: 0,
        };
        let mut s = vec![0f32; g * n];
        let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
        attend_group(&q, d, kv16, 0.1, &mut s, &mut a);
        attend_group(&q, d, hist(&k32, &v32, n, d, 0), 0.1, &mut s, &mut b);
        if crate::simd::has_f16c() {
            assert_eq!(a, b, "d={d} g={g} n={n}");
        }
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n}: {x} vs {y}");
        }
        for h in 0..g {
            let mut want = vec![0f32; d];
            attend_ref(&q[h * d..(h + 1) * d], kv16, 0.1, &mut want);
            for (x, y) in a[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n} head {h}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn int8_values_with_row_scales_attend_as_their_dequantized_values() {
    // f16 keys, int8 value codes with one scale per row (the V8 cache): the attention of
    // the f32 history holding `scale_j · code_j`, on the SIMD and the scalar path, over
    // one part and several (the scales must follow each part's rows).
    for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9), (8, 1, 700)] {
        let k16: Vec<f16> = data(n * d, 31).iter().map(|&v| f16::from_f32(v)).collect();
        let raw = data(n * d, 32);
        let scales: Vec<f32> = (0..n).map(|j| 0.002 + 0.01 * (j % 7) as f32).collect();
        let codes: Vec<i8> = raw.iter().enumerate().map(|(i, &v)| i8::from_f32(v / scales[i / d] * 40.0)).collect();
        let deq: Vec<f32> = codes.iter().enumerate().map(|(i, &c)| scales[i / d] * c as f32).collect();
        let k32: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
        let q = data(g * d, 33);
        let mut s = vec![0f32; g * n];
        let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
        let v8 = History {
            keys: &k16[..],
            values: &codes[..],
            key_scales: RowScales::None,
            value_scales: RowScales::F32(&scales),
            n,
            stride: d,
            offset: 0,
        };
        attend_group(&q, d, v8, 0.1, &mut s, &mut a);
        attend_group(&q, d, hist(&k32, &deq, n, d, 0), 0.1, &mut s, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n}: {x} vs {y}");
        }
        for h in 0..g {
            let mut want = vec![0f32; d];
            attend_ref(&q[h * d..(h + 1) * d], v8, 0.1, &mut want);
            for (x, y) in a[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n} head {h}: {x} vs {y}");
            }
        }
    }
    // A wrong scale (one row's scale dropped) is seen.
    let (d, n) = (64, 40);
    let k: Vec<f32> = data(n * d, 34);
    let codes: Vec<i8> = data(n * d, 35).iter().map(|&v| i8::from_f32(v * 100.0)).collect();
    let mut scales = vec![0.01f32; n];
    let q: Vec<f32> = vec![0.0; d];
    let (mut s, mut a, mut b) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
    let run = |scales: &[f32], s: &mut [f32], out: &mut [f32]| {
        let kv = History {
            keys: &k[..],
            values: &codes[..],
            key_scales: RowScales::None,
            value_scales: RowScales::F32(scales),
            n,
            stride: d,
            offset: 0,
        };
        attend_group(&q, d, kv, 1.0, s, out)
    };
    run(&scales, &mut s, &mut a);
    scales[n / 2] = 0.0;
    run(&scales, &mut s, &mut b);
    assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-4));
}

/// How far the rounding of the scores may move each output channel: to first order,
/// d out_c / d s_j = p_j (v_jc − out_c), with each score off by up to 2ε·scale·Σ_i |q_i k_ji|
/// between two summation orders (the kernels' lanes against the reference's; the measured
/// difference stays under half that), plus, where the keys are int8 codes scored against the
/// query as 16-bit codes (`int_keys`), `scale · Σ_i |k_ji| · q_step / 2` for the query's
/// rounding (`q_step = max|q| / 32767`). Large keys (KV8 rows with big scales) make sharp
/// softmaxes whose outputs differ between summation orders by more than a fixed tolerance.
#[allow(clippy::too_many_arguments)]
fn score_rounding_sensitivity(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    q_step: f32,
) -> Vec<f32> {
    let d = q.len();
    let at = |j: usize| j * stride + offset..j * stride + offset + d;
    let eps = 2.0 * f32::EPSILON as f64;
    let (mut s, mut err) = (vec![0f64; n], vec![0f64; n]);
    for j in 0..n {
        for (a, b) in q.iter().zip(&keys[at(j)]) {
            s[j] += (*a as f64) * (*b as f64) * scale as f64;
            err[j] += ((*a as f64) * (*b as f64)).abs() * scale as f64 * eps
                + (*b as f64).abs() * scale as f64 * q_step as f64 / 2.0;
        }
    }
    let top = s.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - top).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..d)
        .map(|c| {
            let out: f64 = (0..n).map(|j| e[j] / z * values[at(j)][c] as f64).sum();
            let t: f64 = (0..n).map(|j| e[j] / z * (values[at(j)][c] as f64 - out).abs() * err[j]).sum();
            t as f32
        })
        .collect()
}

#[test]
fn kv8_history_attends_as_its_dequantized_keys_and_values() {
    // int8 keys and values with one f16 scale per row each (the KV8 cache), read as codes:
    // the attention of the f32 history holding `scale_j · code_j` (dequantize, then attend)
    // within float rounding, on the SIMD and the scalar path (d = 36), over one part and
    // several, a head alone in its rows and at an offset in rows of two heads; decode's
    // parts (rows asked for ahead) merged give the same bits as one call.
    for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9), (8, 1, 700), (36, 2, 50)] {
        for (stride, offset) in [(d, 0), (2 * d, d)] {
            let codes =
                |seed: u32| -> Vec<i8> { data(n * stride, seed).iter().map(|&v| i8::from_f32(v * 127.0)).collect() };
            let (kc, vc) = (codes(41), codes(42));
            // Scales over two orders of magnitude, and an all-zero row (scale 0).
            let scales = |a: f32| -> Vec<f16> {
                (0..n)
                    .map(|j| f16::from_f32(if j == n / 2 && n > 1 { 0.0 } else { a * (1.0 + (j % 11) as f32 * 9.0) }))
                    .collect()
            };
            let (ks, vs) = (scales(0.004), scales(0.003));
            let deq = |c: &[i8], s: &[f16]| -> Vec<f32> {
                c.iter().enumerate().map(|(i, &x)| s[i / stride].to_f32() * x as f32).collect()
            };
            let (kf, vf) = (deq(&kc, &ks), deq(&vc, &vs));
            let q = data(g * d, 43);
            let scale = 1.0 / (d as f32).sqrt();
            let kv8 = History {
                keys: &kc[..],
                values: &vc[..],
                key_scales: RowScales::F16(&ks),
                value_scales: RowScales::F16(&vs),
                n,
                stride,
                offset,
            };
            let mut s = vec![0f32; g * n];
            let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
            attend_group(&q, d, kv8, scale, &mut s, &mut a);
            attend_group(&q, d, hist(&kf, &vf, n, stride, offset), scale, &mut s, &mut b);
            for h in 0..g {
                let qh = &q[h * d..(h + 1) * d];
                let mut want = vec![0f32; d];
                attend_ref(qh, hist(&kf, &vf, n, stride, offset), scale, &mut want);
                let mut want8 = vec![0f32; d];
                attend_ref(qh, kv8, scale, &mut want8);
                let q_step = qh.iter().fold(0f32, |m, v| m.max(v.abs())) / 32767.0;
                let sensitivity = score_rounding_sensitivity(qh, &kf, &vf, n, stride, offset, scale, q_step);
                for c in 0..d {
                    let (x, y, z, w) = (a[h * d + c], b[h * d + c], want[c], want8[c]);
                    let tol = 2e-5 * (1.0 + y.abs()) + sensitivity[c];
                    for (other, what) in [(y, "f32 history"), (z, "definition"), (w, "definition on codes")] {
                        assert!(
                            (x - other).abs() <= tol,
                            "d={d} g={g} n={n} stride {stride} head {h} [{c}]: {x} vs {other} ({what})"
                        );
                    }
                }
            }
            let parts = n_parts(n);
            let slot = g * d + 2 * g;
            let mut slots = vec![0f32; parts * slot];
            for p in (0..parts).rev() {
                let (o, st) = slots[p * slot..(p + 1) * slot].split_at_mut(g * d);
                attend_part(&q, d, kv8.part(p), scale, &mut s, o, st, true);
            }
            let mut merged = vec![0f32; g * d];
            merge_parts(g, &slots, &mut merged);
            assert_eq!(merged, a, "d={d} g={g} n={n} stride {stride}: parts");
        }
    }
    // A key's scale is applied: one row's scale changed moves the output.
    let (d, n) = (64, 40);
    let kc: Vec<i8> = data(n * d, 44).iter().map(|&v| i8::from_f32(v * 127.0)).collect();
    let vc: Vec<i8> = data(n * d, 45).iter().map(|&v| i8::from_f32(v * 127.0)).collect();
    let vs = vec![f16::from_f32(0.01); n];
    let mut ks = vec![f16::from_f32(0.01); n];
    let q = data(d, 46);
    let (mut s, mut a, mut b) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
    let run = |ks: &[f16], s: &mut [f32], out: &mut [f32]| {
        let kv = History {
            keys: &kc[..],
            values: &vc[..],
            key_scales: ks.into(),
            value_scales: RowScales::F16(&vs),
            n,
            stride: d,
            offset: 0,
        };
        attend_group(&q, d, kv, 1.0, s, out)
    };
    run(&ks, &mut s, &mut a);
    ks[n / 2] = f16::from_f32(0.5);
    run(&ks, &mut s, &mut b);
    assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-4));
}

/// Inputs at the edges of f32 within the domain `attend_part` states: finite outputs within
/// rounding of the f64 definition, on the AVX2 path (head size a multiple of 8) and the
/// portable one (not), in one part and in several merged.
#[test]
fn attention_is_finite_at_the_edges_of_f32() {
    for d in [64usize, 36] {
        for n in [20usize, 100] {
            let (bq, bk, bv) = (data(d, 3), data(n * d, 1), data(n * d, 2));
            let times = |v: &[f32], s: f32| v.iter().map(|x| x * s).collect::<Vec<f32>>();
            let mixed: Vec<f32> = bv.iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 77) as i32 - 38)).collect();
            // (name, q, keys, values)
            let cases: Vec<(&str, [Vec<f32>; 3])> = vec![
                ("subnormal values", [bq.clone(), bk.clone(), times(&bv, 1e-40)]),
                ("tiny scores and values", [times(&bq, 1e-20), times(&bk, 1e-20), times(&bv, 1e-38)]),
                ("huge scores", [times(&bq, 1e15), times(&bk, 1e15), bv.clone()]),
                ("huge values", [bq.clone(), bk.clone(), times(&bv, f32::MAX / (4 * n) as f32)]),
                ("mixed values", [bq.clone(), bk.clone(), mixed]),
            ];
            for (name, [q, k, v]) in &cases {
                let scale = 0.125f32;
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        let dot: f64 = q.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a as f64 * b as f64).sum();
                        dot * scale as f64
                    })
                    .collect();
                let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let p: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                let mut sc = vec![0f32; n];
                let mut got = vec![f32::NAN; d];
                attend_group(q, d, hist(k, v, n, d, 0), scale, &mut sc, &mut got);
                for (c, &g) in got.iter().enumerate() {
                    let want: f64 = (0..n).map(|j| p[j] / l * v[j * d + c] as f64).sum();
                    let mag: f64 = (0..n).map(|j| p[j] / l * (v[j * d + c] as f64).abs()).sum();
                    // f32 rounding of the weights and sums, and of subnormal products.
                    let tol = 1e-5 * mag + n as f64 * f32::from_bits(1) as f64;
                    assert!(g.is_finite() && (g as f64 - want).abs() <= tol, "{name} d={d} n={n} [{c}]: {g} vs {want}");
                }
            }
        }
    }
}

#[test]
fn simd_path_matches_the_definition() {
    // Head sizes of SmolLM2 (64), Qwen3 (128) and qwen3_5 (256), ragged history lengths,
    // heads at an offset inside wider rows (GQA layout).
    for (d, heads) in [(8usize, 1usize), (64, 3), (128, 2), (256, 2)] {
        let stride = d * heads;
        for n in [1usize, 7, 8, 9, 17, 100] {
            let keys = data(n * stride, (d + n) as u32);
            let values = data(n * stride, (3 * d + n) as u32);
            let q = data(d, n as u32);
            for h in 0..heads {
                let (mut s, mut got, mut want) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
                attend_group(&q, d, hist(&keys, &values, n, stride, h * d), 0.125, &mut s, &mut got);
                attend_ref(&q, hist(&keys, &values, n, stride, h * d), 0.125, &mut want);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d={d} n={n} head {h}: {a} vs {b}");
                }
            }
        }
    }
}

/// `x` (rows of `w` values) cut into pages of `page` rows, the last filled out with `fill`.
fn pages<T: Copy>(x: &[T], w: usize, page: usize, fill: T) -> Vec<Box<[T]>> {
    x.chunks(page * w)
        .map(|c| {
            let mut p = c.to_vec();
            p.resize(page * w, fill);
            p.into_boxed_slice()
        })
        .collect()
}

#[test]
fn a_paged_history_attends_with_the_bits_of_one_slice() {
    // Every cache type's element and scale types; page sizes from one block of eight keys to
    // more than the history; lengths around page and part boundaries; whole histories
    // (prefill) and parts one by one (decode, asking ahead).
    let (d, g) = (64usize, 3usize);
    for n in [1usize, 7, 8, 9, 63, 64, 65, 200, 517, 1030] {
        let kf = data(n * d, 61 + n as u32);
        let vf = data(n * d, 62 + n as u32);
        let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
        let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
        let kc: Vec<i8> = kf.iter().map(|&x| i8::from_f32(x * 127.0)).collect();
        let vc: Vec<i8> = vf.iter().map(|&x| i8::from_f32(x * 127.0)).collect();
        let s16: Vec<f16> = (0..n).map(|j| f16::from_f32(0.01 + 0.001 * (j % 13) as f32)).collect();
        let s32: Vec<f32> = (0..n).map(|j| 0.02 + 0.001 * (j % 7) as f32).collect();
        let q = data(g * d, 64);
        for page in [8usize, 16, 24, 64, 256, 2048] {
            macro_rules! check {
                ($k:expr, $v:expr, $ks:expr, $vs:expr, $pks:expr, $pvs:expr, $what:expr) => {{
                    let (kp, vp) = (pages($k, d, page, $k[0]), pages($v, d, page, $v[0]));
                    let flat =
                        History { keys: $k, values: $v, key_scales: $ks, value_scales: $vs, n, stride: d, offset: 0 };
                    let paged =
                        PagedHistory { keys: &kp, values: &vp, key_scales: $pks, value_scales: $pvs, n, d, page };
                    let mut s = vec![0f32; g * n];
                    let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
                    attend_group(&q, d, flat, 0.125, &mut s, &mut a);
                    attend_group(&q, d, paged, 0.125, &mut s, &mut b);
                    assert_eq!(a, b, "{} n={n} page={page}: whole", $what);
                    let slot = g * d + 2 * g;
                    for p in 0..n_parts(n) {
                        let mut x = vec![0f32; slot];
                        let mut y = vec![0f32; slot];
                        let (o, st) = x.split_at_mut(g * d);
                        attend_rows(&q, d, flat, part_rows(n, p), 0.125, &mut s, o, st, true);
                        let (o, st) = y.split_at_mut(g * d);
                        attend_rows(&q, d, paged, part_rows(n, p), 0.125, &mut s, o, st, true);
                        assert_eq!(x, y, "{} n={n} page={page}: part {p}", $what);
                    }
                }};
            }
            let (ps16, ps32) = (pages(&s16, 1, page, s16[0]), pages(&s32, 1, page, s32[0]));
            check!(&kf[..], &vf[..], RowScales::None, RowScales::None, PagedScales::None, PagedScales::None, "f32");
            check!(&kh[..], &vh[..], RowScales::None, RowScales::None, PagedScales::None, PagedScales::None, "f16");
            check!(
                &kh[..],
                &vc[..],
                RowScales::None,
                RowScales::F32(&s32),
                PagedScales::None,
                PagedScales::F32(&ps32),
                "v8"
            );
            check!(
                &kc[..],
                &vc[..],
                RowScales::F16(&s16),
                RowScales::F16(&s16),
                PagedScales::F16(&ps16),
                PagedScales::F16(&ps16),
                "kv8"
            );
        }
    }
}

#[test]
#[should_panic(expected = "a multiple of 8")]
fn pages_that_would_split_a_block_of_keys_are_refused() {
    let (k, v) = (vec![vec![0f32; 12 * 4].into_boxed_slice()], vec![vec![0f32; 12 * 4].into_boxed_slice()]);
    let kv = PagedHistory {
        keys: &k,
        values: &v,
        key_scales: PagedScales::None,
        value_scales: PagedScales::None,
        n: 10,
        d: 4,
        page: 12,
    };
    let (mut s, mut o) = (vec![0f32; 10], vec![0f32; 4]);
    attend_group(&[1.0; 4], 4, kv, 1.0, &mut s, &mut o);
}

#[test]
fn tokens_taken_together_give_each_the_bits_it_gets_alone() {
    // Prefill's tiles against one token at a time: every cache type, whole and paged, tiles
    // from the first token on, across a change of part length (at 513 rows) and deep in a
    // history of many parts, ending inside and at the end of a block of eight keys; a tile with
    // a head too small to code as integers (KV8 then goes token by token, as decode would).
    for (d, g) in [(64usize, 3usize), (128, 2), (256, 6)] {
        for (n0, t) in [(1usize, 40usize), (3, 2), (497, 30), (2041, 17), (9000, 5)] {
            let n = n0 + t - 1;
            let kf = data(n * d, 71 + n as u32);
            let vf = data(n * d, 72 + n as u32);
            let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
            let kc: Vec<i8> = kf.iter().map(|&x| i8::from_f32(x * 127.0)).collect();
            let vc: Vec<i8> = vf.iter().map(|&x| i8::from_f32(x * 127.0)).collect();
            let s16: Vec<f16> = (0..n).map(|j| f16::from_f32(0.01 + 0.001 * (j % 13) as f32)).collect();
            let s32: Vec<f32> = (0..n).map(|j| 0.02 + 0.001 * (j % 7) as f32).collect();
            let mut q = data(t * g * d, 74 + t as u32);
            q.iter_mut().for_each(|x| *x *= 4.0);
            let mut tiny = q.clone();
            tiny[(t / 2) * g * d..(t / 2) * g * d + d].iter_mut().for_each(|x| *x *= 1e-36);
            let page = 64;
            macro_rules! check {
                ($k:expr, $v:expr, $ks:expr, $vs:expr, $pks:expr, $pvs:expr, $what:expr) => {{
                    let (kp, vp) = (pages($k, d, page, $k[0]), pages($v, d, page, $v[0]));
                    let flat = |n| History {
                        keys: $k,
                        values: $v,
                        key_scales: $ks,
                        value_scales: $vs,
                        n,
                        stride: d,
                        offset: 0,
                    };
                    let paged =
                        |n| PagedHistory { keys: &kp, values: &vp, key_scales: $pks, value_scales: $pvs, n, d, page };
                    for (q, which) in [(&q, "q"), (&tiny, "tiny head")] {
                        let mut alone = vec![0f32; t * g * d];
                        let mut s = vec![0f32; g * part_len(n)];
                        for (i, o) in alone.chunks_mut(g * d).enumerate() {
                            attend_group(&q[i * g * d..(i + 1) * g * d], d, flat(n0 + i), 0.125, &mut s, o);
                        }
                        let (mut a, mut b) = (vec![0f32; t * g * d], vec![0f32; t * g * d]);
                        attend_tokens(q, d, g, n0, flat(n), 0.125, &mut a);
                        attend_tokens(q, d, g, n0, paged(n + 3), 0.125, &mut b);
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert!(alone.iter().all(|v| v.is_finite()), "{} d={d} n0={n0} t={t} {which}", $what);
                        assert_eq!(bits(&a), bits(&alone), "{} d={d} g={g} n0={n0} t={t} {which}: whole", $what);
                        assert_eq!(bits(&b), bits(&alone), "{} d={d} g={g} n0={n0} t={t} {which}: paged", $what);
                    }
                }};
            }
            // Room past the last token for the paged history's extra rows (never attended).
            let pad = |x: &[f32]| [x, &vec![9.0; 3 * d]].concat();
            let (kf, vf) = (pad(&kf), pad(&vf));
            let kh: Vec<f16> = [&kh[..], &vec![f16::from_f32(9.0); 3 * d]].concat();
            let vh: Vec<f16> = [&vh[..], &vec![f16::from_f32(9.0); 3 * d]].concat();
            let kc: Vec<i8> = [&kc[..], &vec![127i8; 3 * d]].concat();
            let vc: Vec<i8> = [&vc[..], &vec![127i8; 3 * d]].concat();
            let s16: Vec<f16> = [&s16[..], &[f16::from_f32(1.0); 3]].concat();
            let s32: Vec<f32> = [&s32[..], &[1.0; 3]].concat();
            let (ps16, ps32) = (pages(&s16, 1, page, s16[0]), pages(&s32, 1, page, s32[0]));
            check!(&kf[..], &vf[..], RowScales::None, RowScales::None, PagedScales::None, PagedScales::None, "f32");
            check!(&kh[..], &vh[..], RowScales::None, RowScales::None, PagedScales::None, PagedScales::None, "f16");
            check!(
                &kh[..],
                &vc[..],
                RowScales::None,
                RowScales::F32(&s32),
                PagedScales::None,
                PagedScales::F32(&ps32),
                "v8"
            );
            check!(
                &kc[..],
                &vc[..],
                RowScales::F16(&s16),
                RowScales::F16(&s16),
                PagedScales::F16(&ps16),
                PagedScales::F16(&ps16),
                "kv8"
            );
        }
    }
}
