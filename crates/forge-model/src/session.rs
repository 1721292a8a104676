//! Per-sequence state: KV caches of attention layers, conv and recurrent states of DeltaNet
//! layers. Cloning a session is an exact snapshot (used for rollback and prompt caching).

use forge_core::config::{LayerKind, ModelConfig};
use forge_kernels::attention::KvElem;
use half::f16;
use std::sync::atomic::{AtomicU8, Ordering};

/// How a KV cache stores its keys and values. f16 halves the bytes attention reads per token
/// (and the cache's memory); every product and sum stays f32, the stored values are rounded to
/// f16 once (as llama.cpp's default cache, and ANEMLL Forge's FP16 history buffers). `v8` is
/// ANEMLL Forge's V8 cache: f16 keys, and values as 8-bit codes with one scale per position and head
/// (`absmax / 127`, kept in f32), 3/8 of the f32 cache's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    V8,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::V8 => "v8",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<KvDtype> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "v8" => Ok(KvDtype::V8),
            _ => anyhow::bail!("unknown KV cache type `{s}` (f32, f16 or v8)"),
        }
    }
}

/// 0: f32, 1: f16, 2: v8 (see [`set_kv_dtype`]).
static KV_DTYPE: AtomicU8 = AtomicU8::new(0);

/// The cache type of sessions made from now on in this process (f32 unless set: the library's
/// tests and the measuring commands compare against f32 oracles).
pub fn set_kv_dtype(d: KvDtype) {
    KV_DTYPE.store(d as u8, Ordering::Relaxed)
}

pub fn kv_dtype() -> KvDtype {
    match KV_DTYPE.load(Ordering::Relaxed) {
        1 => KvDtype::F16,
        2 => KvDtype::V8,
        _ => KvDtype::F32,
    }
}

/// One key/value head's cached rows, in the cache's element type.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// Codes; the row scales come from [`KvCache::value_scales`].
    I8(&'a [i8]),
}

/// A cache element type; integer codes carry one scale per stored row of a head.
trait Stored: KvElem {
    const SCALED: bool;
}
impl Stored for f32 {
    const SCALED: bool = false;
}
impl Stored for f16 {
    const SCALED: bool = false;
}
impl Stored for i8 {
    const SCALED: bool = true;
}

fn touch_spare<T: KvElem>(c: &mut Vec<T>, n: usize) {
    c.reserve(n);
    c.spare_capacity_mut().iter_mut().for_each(|v| {
        v.write(T::from_f32(0.0));
    });
}

/// Per key/value head, one contiguous run of `head_dim` elements per position (and, for
/// integer values, one scale per position in `s`).
#[derive(Clone, Debug)]
struct Store<K, V> {
    k: Vec<Vec<K>>,
    v: Vec<Vec<V>>,
    s: Vec<Vec<f32>>,
}

impl<K: Stored, V: Stored> Store<K, V> {
    fn new(heads: usize) -> Self {
        Store { k: vec![Vec::new(); heads], v: vec![Vec::new(); heads], s: vec![Vec::new(); heads] }
    }

    fn push(&mut self, k: &[f32], v: &[f32], h: usize, d: usize) {
        for (rk, rv) in k.chunks_exact(h * d).zip(v.chunks_exact(h * d)) {
            for (head, (ck, cv)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
                let (xk, xv) = (&rk[head * d..(head + 1) * d], &rv[head * d..(head + 1) * d]);
                ck.extend(xk.iter().map(|&x| K::from_f32(x)));
                if V::SCALED {
                    // Symmetric, absmax / 127 (an all-zero or non-finite row gets scale 0 and
                    // zero codes rather than NaNs spread over every later output).
                    let amax = xv.iter().fold(0f32, |m, &x| m.max(x.abs()));
                    let sc = if amax.is_finite() && amax > 0.0 { amax / 127.0 } else { 0.0 };
                    let inv = if sc > 0.0 { 1.0 / sc } else { 0.0 };
                    cv.extend(xv.iter().map(|&x| V::from_f32(x * inv)));
                    self.s[head].push(sc);
                } else {
                    cv.extend(xv.iter().map(|&x| V::from_f32(x)));
                }
            }
        }
    }

    fn reserve(&mut self, positions: usize, d: usize) {
        for c in &mut self.k {
            touch_spare(c, positions * d);
        }
        for c in &mut self.v {
            touch_spare(c, positions * d);
        }
        if V::SCALED {
            self.s.iter_mut().for_each(|c| touch_spare(c, positions));
        }
    }

    fn truncate(&mut self, positions: usize, d: usize) {
        self.k.iter_mut().for_each(|c| c.truncate(positions * d));
        self.v.iter_mut().for_each(|c| c.truncate(positions * d));
        self.s.iter_mut().for_each(|c| c.truncate(positions));
    }

    fn rows_f32(&self, h: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        let scale = |j: usize| if V::SCALED { self.s[h][j / d.max(1)] } else { 1.0 };
        (
            self.k[h].iter().map(|x| x.to_f32()).collect(),
            self.v[h].iter().enumerate().map(|(j, x)| scale(j) * x.to_f32()).collect(),
        )
    }

    fn capacity_bytes(&self) -> usize {
        let k: usize = self.k.iter().map(|c| c.capacity() * std::mem::size_of::<K>()).sum();
        let v: usize = self.v.iter().map(|c| c.capacity() * std::mem::size_of::<V>()).sum();
        k + v + self.s.iter().map(|c| c.capacity() * 4).sum::<usize>()
    }
}

#[derive(Clone, Debug)]
enum Heads {
    F32(Store<f32, f32>),
    F16(Store<f16, f16>),
    V8(Store<f16, i8>),
}

/// Post-RoPE keys and values of one attention layer: per key/value head, one contiguous run of
/// `head_dim` values per position (transformers' `(heads, positions, head_dim)` order). Decode
/// reads each head's history as one sequential stream; with the heads interleaved per position
/// (a row of `heads × head_dim`) every row would be a short strided piece, which the hardware
/// prefetchers follow worse.
#[derive(Clone, Debug)]
pub struct KvCache {
    heads: Heads,
    n_heads: usize,
    head_dim: usize,
}

/// `$body` with `$st` bound to the cache's store, whatever its element type.
macro_rules! with_store {
    ($self:expr, $st:ident => $body:expr) => {
        match $self {
            Heads::F32($st) => $body,
            Heads::F16($st) => $body,
            Heads::V8($st) => $body,
        }
    };
}

impl KvCache {
    /// An f32 cache.
    pub fn new(heads: usize, head_dim: usize) -> KvCache {
        KvCache::with_dtype(heads, head_dim, KvDtype::F32)
    }

    pub fn with_dtype(heads: usize, head_dim: usize, dtype: KvDtype) -> KvCache {
        let heads_of = |n| match dtype {
            KvDtype::F32 => Heads::F32(Store::new(n)),
            KvDtype::F16 => Heads::F16(Store::new(n)),
            KvDtype::V8 => Heads::V8(Store::new(n)),
        };
        KvCache { heads: heads_of(heads), n_heads: heads, head_dim }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.heads {
            Heads::F32(_) => KvDtype::F32,
            Heads::F16(_) => KvDtype::F16,
            Heads::V8(_) => KvDtype::V8,
        }
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        with_store!(&self.heads, st => st.k.first().map_or(0, |k| k.len() / self.head_dim.max(1)))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn heads(&self) -> usize {
        self.n_heads
    }

    /// Appends positions given as rows of `heads × head_dim` keys and values (the projections'
    /// output order), rounded to the cache's type.
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        let (h, d) = (self.n_heads, self.head_dim);
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(h * d),
            "{} keys, {} values for rows of {h}×{d}",
            k.len(),
            v.len()
        );
        with_store!(&mut self.heads, st => st.push(k, v, h, d))
    }

    /// Keys of head `h`, `head_dim` values per position.
    pub fn keys(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.k[h]),
            Heads::F16(st) => KvRows::F16(&st.k[h]),
            Heads::V8(st) => KvRows::F16(&st.k[h]),
        }
    }

    pub fn values(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.v[h]),
            Heads::F16(st) => KvRows::F16(&st.v[h]),
            Heads::V8(st) => KvRows::I8(&st.v[h]),
        }
    }

    /// One scale per position of head `h`'s values when they are codes ([`KvRows::I8`]), else
    /// empty.
    pub fn value_scales(&self, h: usize) -> &[f32] {
        match &self.heads {
            Heads::V8(st) => &st.s[h],
            _ => &[],
        }
    }

    /// Keys and values of head `h` as f32 (tests and inspection).
    pub fn rows_f32(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        with_store!(&self.heads, st => st.rows_f32(h, self.head_dim))
    }

    /// Keeps the first `n` positions.
    pub fn truncate(&mut self, n: usize) {
        let d = self.head_dim;
        with_store!(&mut self.heads, st => st.truncate(n, d))
    }

    /// Room for `more` positions past the current ones, touched now (as llama.cpp maps its
    /// context when it is made) rather than on the first page faults of a prefill or decode.
    pub fn reserve(&mut self, more: usize) {
        let d = self.head_dim;
        with_store!(&mut self.heads, st => st.reserve(more, d))
    }

    /// Bytes held, reserved room included.
    pub fn capacity_bytes(&self) -> usize {
        with_store!(&self.heads, st => st.capacity_bytes())
    }
}

/// `n` zeros written into their pages now. `vec![0.0; n]` takes zeroed pages from the kernel
/// lazily: the first prefill reads them (mapping the shared zero page) and then writes them,
/// a second fault per page that also flushes the other cores' TLBs. On the 27B shape (150 MiB of
/// recurrent state) those faults would cost about 4 % of a short run, in the prefill's state
/// updates.
fn written_zeros(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, 0.0);
    v
}

#[derive(Clone, Debug)]
pub struct DeltaState {
    /// The last `kernel − 1` conv inputs, oldest first, `conv_dim` floats each.
    pub conv: Vec<f32>,
    /// `num_v_heads × k_head_dim × v_head_dim` recurrent state.
    pub rec: Vec<f32>,
    /// What a speculative pass needs to roll this layer back (see [`Session::begin_speculation`]).
    pub journal: DeltaJournal,
}

/// A DeltaNet layer's record of a speculative pass: its state when the pass began and the rows
/// of its input projections since, from which the state after any prefix of those rows is
/// rebuilt exactly (the rows are replayed through the same row-by-row recurrence). Emptied, not
/// freed, when the pass ends: its buffers serve the next pass, and a cloned session copies no
/// stale rows.
#[derive(Clone, Debug, Default)]
pub struct DeltaJournal {
    pub active: bool,
    pub conv0: Vec<f32>,
    pub rec0: Vec<f32>,
    pub mixed: Vec<f32>,
    pub z: Vec<f32>,
    pub b: Vec<f32>,
    pub a: Vec<f32>,
    pub rows: usize,
}

impl DeltaJournal {
    /// Appends `t` rows of the input projections while a pass is open.
    pub fn record(&mut self, t: usize, mixed: &[f32], z: &[f32], b: &[f32], a: &[f32]) {
        if self.active {
            self.mixed.extend_from_slice(mixed);
            self.z.extend_from_slice(z);
            self.b.extend_from_slice(b);
            self.a.extend_from_slice(a);
            self.rows += t;
        }
    }

    fn open(&mut self, conv: &[f32], rec: &[f32]) {
        self.clear();
        self.active = true;
        self.conv0.extend_from_slice(conv);
        self.rec0.extend_from_slice(rec);
    }

    pub fn clear(&mut self) {
        self.active = false;
        self.rows = 0;
        for v in [&mut self.conv0, &mut self.rec0, &mut self.mixed, &mut self.z, &mut self.b, &mut self.a] {
            v.clear();
        }
    }
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Attn(KvCache),
    Delta(DeltaState),
}

#[derive(Clone, Debug)]
pub struct Session {
    /// Number of tokens already processed.
    pub pos: usize,
    pub layers: Vec<LayerState>,
    /// Where the open speculative pass began (`None`: none is open).
    pub spec_start: Option<usize>,
}

impl Session {
    /// A session whose KV caches are of the process-wide type ([`set_kv_dtype`]).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_kv_dtype(cfg, kv_dtype())
    }

    pub fn with_kv_dtype(cfg: &ModelConfig, dtype: KvDtype) -> Self {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attn(KvCache::with_dtype(cfg.num_kv_heads, cfg.head_dim, dtype)),
                LayerKind::DeltaNet => {
                    let d = cfg.deltanet.as_ref().expect("DeltaNet layer without deltanet config");
                    LayerState::Delta(DeltaState {
                        conv: written_zeros((d.conv_kernel - 1) * d.conv_dim()),
                        rec: written_zeros(d.num_v_heads * d.k_head_dim * d.v_head_dim),
                        journal: DeltaJournal::default(),
                    })
                }
            })
            .collect();
        Session { pos: 0, layers, spec_start: None }
    }

    /// Set aside KV cache room for `more` positions past the current ones, so that decoding up
    /// to there never grows (reallocates) a cache.
    pub fn reserve(&mut self, more: usize) {
        for l in &mut self.layers {
            if let LayerState::Attn(c) = l {
                c.reserve(more);
            }
        }
    }

    /// Opens a speculative pass: the tokens fed from here on can be taken back, all or some,
    /// by [`crate::Model::commit`]. Attention layers need nothing (their rows are dropped);
    /// each DeltaNet layer keeps its state as of now and journals its input rows. An open pass
    /// is committed whole first.
    pub fn begin_speculation(&mut self) {
        self.spec_start = Some(self.pos);
        for l in &mut self.layers {
            if let LayerState::Delta(d) = l {
                d.journal.open(&d.conv, &d.rec);
            }
        }
    }

    /// Bytes held by caches and states.
    pub fn state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(c) => c.capacity_bytes(),
                LayerState::Delta(d) => {
                    let j = &d.journal;
                    let journal =
                        [&j.conv0, &j.rec0, &j.mixed, &j.z, &j.b, &j.a].iter().map(|v| v.capacity()).sum::<usize>();
                    (d.conv.len() + d.rec.len() + journal) * 4
                }
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_keeps_each_head_as_one_stream_in_position_order() {
        let (heads, d) = (3, 2);
        let mut c = KvCache::new(heads, d);
        // Two positions of heads × d projections, then one more: value = 100·pos + 10·head + i.
        let row = |p: usize| -> Vec<f32> { (0..heads * d).map(|j| (100 * p + 10 * (j / d) + j % d) as f32).collect() };
        let (r0, r1, r2) = (row(0), row(1), row(2));
        c.push(&[r0.clone(), r1.clone()].concat(), &[r0, r1].concat().iter().map(|x| -x).collect::<Vec<_>>());
        c.push(&r2, &r2.iter().map(|x| -x).collect::<Vec<_>>());
        assert_eq!(c.len(), 3);
        for h in 0..heads {
            let want: Vec<f32> = (0..3).flat_map(|p| (0..d).map(move |i| (100 * p + 10 * h + i) as f32)).collect();
            let (k, v) = c.rows_f32(h);
            assert_eq!(k, want);
            assert_eq!(v, want.iter().map(|x| -x).collect::<Vec<_>>());
        }
        c.reserve(10);
        assert!(c.capacity_bytes() >= 2 * heads * 13 * d * 4);
        c.truncate(1);
        assert_eq!((c.len(), c.rows_f32(2).0), (1, vec![20.0, 21.0]));
        // An f16 cache: values rounded once, half the bytes.
        let mut h = KvCache::with_dtype(1, 2, KvDtype::F16);
        h.push(&[1.0, 1.0 + 1.0 / 4096.0], &[65504.0, -3.0e-8]);
        h.reserve(7);
        assert_eq!(h.rows_f32(0), (vec![1.0, 1.0], vec![65504.0, f16::from_f32(-3.0e-8).to_f32()]));
        assert!(matches!(h.keys(0), KvRows::F16(_)));
        assert!(h.capacity_bytes() >= 2 * 8 * 2);
    }

    #[test]
    fn v8_cache_keeps_f16_keys_and_values_within_half_a_step_of_their_row_scale() {
        let (heads, d) = (2, 64);
        let mut c = KvCache::with_dtype(heads, d, KvDtype::V8);
        let row = |p: usize| -> Vec<f32> {
            (0..heads * d).map(|j| ((p * 131 + j * 17) % 97) as f32 / 9.7 - 5.0 + (j / d) as f32 * 30.0).collect()
        };
        let (k, v): (Vec<f32>, Vec<f32>) = ((0..5).flat_map(row).collect(), (0..5).flat_map(|p| row(p + 7)).collect());
        c.push(&k[..3 * heads * d], &v[..3 * heads * d]);
        c.push(&k[3 * heads * d..], &v[3 * heads * d..]);
        // A zero row: scale 0, codes 0, no NaN.
        c.push(&vec![0.0; heads * d], &vec![0.0; heads * d]);
        assert_eq!(c.len(), 6);
        for h in 0..heads {
            let (gk, gv) = c.rows_f32(h);
            let sc = c.value_scales(h);
            assert_eq!(sc.len(), 6);
            assert_eq!(sc[5], 0.0);
            for p in 0..5 {
                let want: Vec<f32> = row(p + 7)[h * d..(h + 1) * d].to_vec();
                let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert_eq!(sc[p], amax / 127.0, "head {h} position {p}");
                for (i, (&g, &w)) in gv[p * d..(p + 1) * d].iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 0.5 * sc[p] * 1.0001, "head {h} position {p} value {i}: {g} vs {w}");
                }
                let wk: Vec<f32> = row(p)[h * d..(h + 1) * d].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                assert_eq!(&gk[p * d..(p + 1) * d], &wk[..]);
            }
            assert!(gv[5 * d..].iter().all(|&x| x == 0.0));
            assert!(matches!((c.keys(h), c.values(h)), (KvRows::F16(_), KvRows::I8(_))));
        }
        // Truncation keeps codes and scales together; reserved room is counted.
        c.truncate(2);
        assert_eq!((c.len(), c.value_scales(1).len()), (2, 2));
        c.reserve(100);
        assert!(c.capacity_bytes() >= heads * 102 * (2 * d + d + 4));
        assert!(c.capacity_bytes() < heads * 102 * 4 * d);
        assert_eq!(KvDtype::parse("v8").unwrap(), KvDtype::V8);
        assert!(KvDtype::parse("q8").unwrap_err().to_string().contains("f32, f16 or v8"));
    }
}
