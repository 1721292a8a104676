//! Per-sequence state: KV caches of attention layers, conv and recurrent states of DeltaNet
//! layers. Cloning a session is an exact snapshot (used for rollback and prompt caching).

use forge_core::config::{LayerKind, ModelConfig};
use forge_kernels::attention::{KvElem, PagedScales};
use half::f16;

/// How a KV cache stores its keys and values. f16 halves the bytes attention reads per token
/// (and the cache's memory); every product and sum stays f32, the stored values are rounded to
/// f16 once (as llama.cpp's default cache, and ANEMLL Forge's FP16 history buffers). `v8` is
/// ANEMLL Forge's V8 cache: f16 keys, and values as 8-bit codes with one scale per position and head
/// (`absmax / 127`, kept in f32), 3/8 of the f32 cache's bytes. `kv8` is ANEMLL Forge's KV8
/// cache: keys and values both as 8-bit codes, each with one f16 scale per position and head
/// (`absmax / 127`): `2 × head_dim + 4` bytes a position and head, a little over 1/4 of f32's.
/// Attention reads the codes as they are stored (widened to f32 as they are loaded, the scales
/// put onto the scores and the weights), never a dequantized copy of the history. KV8 keys are
/// quantized after a fixed orthonormal rotation, undone on the query side
/// ([`KvCache::rotate_queries`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    V8,
    Kv8,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::V8 => "v8",
            KvDtype::Kv8 => "kv8",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<KvDtype> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "v8" => Ok(KvDtype::V8),
            "kv8" => Ok(KvDtype::Kv8),
            _ => anyhow::bail!("unknown KV cache type `{s}` (f32, f16, v8 or kv8)"),
        }
    }

    /// Bytes one position takes in one key/value head of `head_dim` values.
    pub fn bytes_per_position(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 8 * head_dim,
            KvDtype::F16 => 4 * head_dim,
            KvDtype::V8 => 3 * head_dim + 4,
            KvDtype::Kv8 => 2 * head_dim + 4,
        }
    }
}

/// One key/value head's cached rows, in the cache's element type, in pages of
/// [`KvCache::page_rows`] positions (`head_dim` values each; the last page partly used).
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [Box<[f32]>]),
    F16(&'a [Box<[f16]>]),
    /// Codes; the row scales come from [`KvCache::key_scales`] and [`KvCache::value_scales`].
    I8(&'a [Box<[i8]>]),
}

/// Positions a cache page holds unless the session says otherwise: 256 positions of SmolLM2's
/// 64-value heads are 16 KiB of f16 keys, of the 27B shape's 256-value KV8 heads 64 KiB.
pub const DEFAULT_PAGE_ROWS: usize = 256;

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

/// Elements in pages of `per_page` each, a page allocated (its zeros written, so that no later
/// step takes its page faults) when the first element that needs it arrives. Rows never
/// straddle two pages (`per_page` is a whole number of rows), so a row is written in place and
/// nothing already stored is ever copied as the cache grows. Truncation returns the pages past
/// the last row kept, except those [`Pages::reserve`] set aside.
#[derive(Debug)]
struct Pages<T> {
    pages: Vec<Box<[T]>>,
    len: usize,
    per_page: usize,
    /// Elements of room promised by the last `reserve`.
    kept: usize,
}

impl<T: KvElem> Pages<T> {
    fn new(per_page: usize) -> Self {
        Pages { pages: Vec::new(), len: 0, per_page, kept: 0 }
    }

    fn fresh(&self) -> Box<[T]> {
        vec![T::from_f32(0.0); self.per_page].into_boxed_slice()
    }

    /// The slot for the next row of `w` elements.
    fn next_row(&mut self, w: usize) -> &mut [T] {
        let (p, i) = (self.len / self.per_page, self.len % self.per_page);
        debug_assert!(i + w <= self.per_page, "a row of {w} across a page of {}", self.per_page);
        if p == self.pages.len() {
            let page = self.fresh();
            self.pages.push(page);
        }
        self.len += w;
        &mut self.pages[p][i..i + w]
    }

    fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
        let keep = self.len.max(self.kept).div_ceil(self.per_page);
        self.pages.truncate(keep);
    }

    fn reserve(&mut self, more: usize) {
        self.kept = self.len + more;
        while self.pages.len() * self.per_page < self.kept {
            let page = self.fresh();
            self.pages.push(page);
        }
    }

    fn capacity_bytes(&self) -> usize {
        self.pages.len() * self.per_page * std::mem::size_of::<T>()
    }

    fn used_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The stored elements in one piece (tests and inspection).
    fn to_vec(&self) -> Vec<T> {
        self.pages.iter().flat_map(|p| p.iter().copied()).take(self.len).collect()
    }
}

/// A snapshot: the pages in use, none of the room set aside.
impl<T: KvElem> Clone for Pages<T> {
    fn clone(&self) -> Self {
        let used = self.len.div_ceil(self.per_page);
        Pages { pages: self.pages[..used].to_vec(), len: self.len, per_page: self.per_page, kept: 0 }
    }
}

/// Writes one head's row `x` into the next slot of `codes` in the element type `T`; for
/// integer codes also its scale into `scales`, in the scale type `S`: symmetric, `absmax / 127`
/// rounded to `S`, the codes taken against the rounded scale so that `scale · code` is what
/// attention reads. An all-zero or non-finite row gets scale 0 and zero codes rather than NaNs
/// spread over every later output; a scale past f16's range is held at its largest value (the
/// codes then saturate at ±127).
fn put<T: Stored, S: KvElem>(x: &[f32], codes: &mut Pages<T>, scales: &mut Pages<S>) {
    let row = codes.next_row(x.len());
    if !T::SCALED {
        row.iter_mut().zip(x).for_each(|(c, &v)| *c = T::from_f32(v));
        return;
    }
    let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
    let mut sc = S::from_f32(if amax.is_finite() && amax > 0.0 { amax / 127.0 } else { 0.0 });
    if !sc.to_f32().is_finite() {
        sc = S::from_f32(f16::MAX.to_f32());
    }
    let inv = if sc.to_f32() > 0.0 { 1.0 / sc.to_f32() } else { 0.0 };
    row.iter_mut().zip(x).for_each(|(c, &v)| *c = T::from_f32(v * inv));
    scales.next_row(1)[0] = if inv > 0.0 { sc } else { S::from_f32(0.0) };
}

/// Per key/value head, pages of `head_dim` elements per position (and, for integer keys or
/// values, pages of one scale per position in `ks` / `vs`, of type `S`).
#[derive(Clone, Debug)]
struct Store<K: KvElem, V: KvElem, S: KvElem = f32> {
    k: Vec<Pages<K>>,
    v: Vec<Pages<V>>,
    ks: Vec<Pages<S>>,
    vs: Vec<Pages<S>>,
}

impl<K: Stored, V: Stored, S: KvElem> Store<K, V, S> {
    fn new(heads: usize, d: usize, page_rows: usize) -> Self {
        Store {
            k: (0..heads).map(|_| Pages::new(page_rows * d)).collect(),
            v: (0..heads).map(|_| Pages::new(page_rows * d)).collect(),
            ks: (0..heads).map(|_| Pages::new(page_rows)).collect(),
            vs: (0..heads).map(|_| Pages::new(page_rows)).collect(),
        }
    }

    fn push(&mut self, k: &[f32], v: &[f32], h: usize, d: usize) {
        for (rk, rv) in k.chunks_exact(h * d).zip(v.chunks_exact(h * d)) {
            for head in 0..h {
                let (xk, xv) = (&rk[head * d..(head + 1) * d], &rv[head * d..(head + 1) * d]);
                put(xk, &mut self.k[head], &mut self.ks[head]);
                put(xv, &mut self.v[head], &mut self.vs[head]);
            }
        }
    }

    fn reserve(&mut self, positions: usize, d: usize) {
        self.k.iter_mut().for_each(|c| c.reserve(positions * d));
        self.v.iter_mut().for_each(|c| c.reserve(positions * d));
        if K::SCALED {
            self.ks.iter_mut().for_each(|c| c.reserve(positions));
        }
        if V::SCALED {
            self.vs.iter_mut().for_each(|c| c.reserve(positions));
        }
    }

    fn truncate(&mut self, positions: usize, d: usize) {
        self.k.iter_mut().for_each(|c| c.truncate(positions * d));
        self.v.iter_mut().for_each(|c| c.truncate(positions * d));
        self.ks.iter_mut().for_each(|c| c.truncate(positions));
        self.vs.iter_mut().for_each(|c| c.truncate(positions));
    }

    fn rows_f32(&self, h: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        let (ks, vs) = (self.ks[h].to_vec(), self.vs[h].to_vec());
        let scale = |s: &[S], scaled: bool, j: usize| if scaled { s[j / d.max(1)].to_f32() } else { 1.0 };
        (
            self.k[h].to_vec().iter().enumerate().map(|(j, x)| scale(&ks, K::SCALED, j) * x.to_f32()).collect(),
            self.v[h].to_vec().iter().enumerate().map(|(j, x)| scale(&vs, V::SCALED, j) * x.to_f32()).collect(),
        )
    }

    /// Bytes of every page held, and of the elements stored.
    fn bytes(&self) -> (usize, usize) {
        let (mut held, mut used) = (0, 0);
        let mut add = |c: usize, u: usize| (held, used) = (held + c, used + u);
        self.k.iter().for_each(|p| add(p.capacity_bytes(), p.used_bytes()));
        self.v.iter().for_each(|p| add(p.capacity_bytes(), p.used_bytes()));
        self.ks.iter().chain(&self.vs).for_each(|p| add(p.capacity_bytes(), p.used_bytes()));
        (held, used)
    }
}

#[derive(Clone, Debug)]
enum Heads {
    F32(Store<f32, f32>),
    F16(Store<f16, f16>),
    V8(Store<f16, i8, f32>),
    Kv8(Store<i8, i8, f16>),
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
    /// KV8 with a power-of-two head size: the signs `D` of the keys' rotation `H·D/√d` (see
    /// [`KvCache::rotate_queries`]); empty when keys are stored as they come.
    key_signs: Vec<f32>,
    /// One position's rotated keys, kept for the next push.
    scratch: Vec<f32>,
}

/// Fixed ±1 signs for the KV8 keys' rotation (a seeded SplitMix64 stream; any fixed choice keeps
/// `q · k`, random signs keep a structured key, a constant one say, from landing in one channel).
fn rotation_signs(d: usize) -> Vec<f32> {
    let mut z = 0x4B56_3800_u64;
    (0..d)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            if (x ^ (x >> 31)) & 1 == 0 {
                1.0
            } else {
                -1.0
            }
        })
        .collect()
}

/// `x ← H·D·x / √d` on each head row of `d = signs.len()` values.
fn rotate(signs: &[f32], x: &mut [f32]) {
    for r in x.chunks_exact_mut(signs.len()) {
        r.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
        forge_kernels::fwht::fwht_normalized(r);
    }
}

/// The inverse of [`rotate`]: `x ← D·H·x / √d`.
fn unrotate(signs: &[f32], x: &mut [f32]) {
    for r in x.chunks_exact_mut(signs.len()) {
        forge_kernels::fwht::fwht_normalized(r);
        r.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
    }
}

/// `$body` with `$st` bound to the cache's store, whatever its element type.
macro_rules! with_store {
    ($self:expr, $st:ident => $body:expr) => {
        match $self {
            Heads::F32($st) => $body,
            Heads::F16($st) => $body,
            Heads::V8($st) => $body,
            Heads::Kv8($st) => $body,
        }
    };
}

impl KvCache {
    /// An f32 cache.
    pub fn new(heads: usize, head_dim: usize) -> KvCache {
        KvCache::with_dtype(heads, head_dim, KvDtype::F32)
    }

    /// A cache of `dtype` in pages of [`DEFAULT_PAGE_ROWS`] positions.
    pub fn with_dtype(heads: usize, head_dim: usize, dtype: KvDtype) -> KvCache {
        KvCache::paged(heads, head_dim, dtype, DEFAULT_PAGE_ROWS)
    }

    /// A cache of `dtype` in pages of `page_rows` positions, a multiple of eight (attention
    /// scores keys eight at a time; pages so cut give the bits of one contiguous history).
    pub fn paged(heads: usize, head_dim: usize, dtype: KvDtype, page_rows: usize) -> KvCache {
        assert!(page_rows > 0 && page_rows.is_multiple_of(8), "KV pages of {page_rows} positions (a multiple of 8)");
        let p = page_rows;
        let heads_of = |n| match dtype {
            KvDtype::F32 => Heads::F32(Store::new(n, head_dim, p)),
            KvDtype::F16 => Heads::F16(Store::new(n, head_dim, p)),
            KvDtype::V8 => Heads::V8(Store::new(n, head_dim, p)),
            KvDtype::Kv8 => Heads::Kv8(Store::new(n, head_dim, p)),
        };
        // KV8 keys are quantized in a rotated basis: a few channels of a key head can be many
        // times the rest (SmolLM2's are), and one scale per row would leave the rest a few
        // codes; rotated, every channel carries a share of each.
        let key_signs =
            if dtype == KvDtype::Kv8 && head_dim.is_power_of_two() { rotation_signs(head_dim) } else { Vec::new() };
        KvCache { heads: heads_of(heads), n_heads: heads, head_dim, key_signs, scratch: Vec::new() }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.heads {
            Heads::F32(_) => KvDtype::F32,
            Heads::F16(_) => KvDtype::F16,
            Heads::V8(_) => KvDtype::V8,
            Heads::Kv8(_) => KvDtype::Kv8,
        }
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        with_store!(&self.heads, st => st.k.first().map_or(0, |k| k.len / self.head_dim.max(1)))
    }

    /// Positions a page holds (the scale pages hold one element a position, whatever the type).
    pub fn page_rows(&self) -> usize {
        with_store!(&self.heads, st => st.ks.first().map_or(DEFAULT_PAGE_ROWS, |p| p.per_page))
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
        if self.key_signs.is_empty() {
            return with_store!(&mut self.heads, st => st.push(k, v, h, d));
        }
        // A position at a time, so that the scratch holds one row however long a prefill.
        let mut rk = std::mem::take(&mut self.scratch);
        for (kr, vr) in k.chunks_exact(h * d).zip(v.chunks_exact(h * d)) {
            rk.clear();
            rk.extend_from_slice(kr);
            rotate(&self.key_signs, &mut rk);
            with_store!(&mut self.heads, st => st.push(&rk, vr, h, d));
        }
        self.scratch = rk;
    }

    /// Puts query rows (heads of `head_dim` values) into the basis of this cache's stored keys:
    /// KV8 stores each key rotated by an orthonormal `R = H·D/√d` (a Walsh–Hadamard transform
    /// after fixed signs) before it is quantized, and `(R q) · (R k) = q · k`. Nothing for the
    /// other types.
    pub fn rotate_queries(&self, q: &mut [f32]) {
        if !self.key_signs.is_empty() {
            rotate(&self.key_signs, q);
        }
    }

    /// Keys of head `h`, `head_dim` values per position (KV8: in the rotated basis of
    /// [`KvCache::rotate_queries`]).
    pub fn keys(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.k[h].pages),
            Heads::F16(st) => KvRows::F16(&st.k[h].pages),
            Heads::V8(st) => KvRows::F16(&st.k[h].pages),
            Heads::Kv8(st) => KvRows::I8(&st.k[h].pages),
        }
    }

    pub fn values(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.v[h].pages),
            Heads::F16(st) => KvRows::F16(&st.v[h].pages),
            Heads::V8(st) => KvRows::I8(&st.v[h].pages),
            Heads::Kv8(st) => KvRows::I8(&st.v[h].pages),
        }
    }

    /// One scale per position of head `h`'s keys when they are codes ([`KvRows::I8`]), else
    /// none.
    pub fn key_scales(&self, h: usize) -> PagedScales<'_> {
        match &self.heads {
            Heads::Kv8(st) => PagedScales::F16(&st.ks[h].pages),
            _ => PagedScales::None,
        }
    }

    /// One scale per position of head `h`'s values when they are codes ([`KvRows::I8`]), else
    /// none.
    pub fn value_scales(&self, h: usize) -> PagedScales<'_> {
        match &self.heads {
            Heads::V8(st) => PagedScales::F32(&st.vs[h].pages),
            Heads::Kv8(st) => PagedScales::F16(&st.vs[h].pages),
            _ => PagedScales::None,
        }
    }

    /// Head `h`'s key and value scales, one per position (none for float rows; tests and
    /// inspection).
    pub fn scales_f32(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        fn f<S: KvElem>(p: &Pages<S>) -> Vec<f32> {
            p.to_vec().iter().map(|x| x.to_f32()).collect()
        }
        match &self.heads {
            Heads::V8(st) => (Vec::new(), f(&st.vs[h])),
            Heads::Kv8(st) => (f(&st.ks[h]), f(&st.vs[h])),
            _ => (Vec::new(), Vec::new()),
        }
    }

    /// Keys and values of head `h` as f32 (tests and inspection).
    pub fn rows_f32(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut k, v) = with_store!(&self.heads, st => st.rows_f32(h, self.head_dim));
        if !self.key_signs.is_empty() {
            unrotate(&self.key_signs, &mut k);
        }
        (k, v)
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

    /// Bytes held: every page, reserved room included.
    pub fn capacity_bytes(&self) -> usize {
        with_store!(&self.heads, st => st.bytes().0)
    }

    /// Bytes of the positions stored.
    pub fn used_bytes(&self) -> usize {
        with_store!(&self.heads, st => st.bytes().1)
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
    /// A session with f32 KV caches.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_kv_dtype(cfg, KvDtype::F32)
    }

    pub fn with_kv_dtype(cfg: &ModelConfig, dtype: KvDtype) -> Self {
        Self::with_kv(cfg, dtype, DEFAULT_PAGE_ROWS)
    }

    /// A session whose KV caches are of `dtype`, in pages of `page_rows` positions.
    pub fn with_kv(cfg: &ModelConfig, dtype: KvDtype, page_rows: usize) -> Self {
        let (kvh, hd) = (cfg.num_kv_heads, cfg.head_dim);
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attn(KvCache::paged(kvh, hd, dtype, page_rows)),
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

    /// Bytes a session of `cfg` with caches of `dtype` holds at `positions` positions (caches
    /// and recurrent states; without a speculative pass's journal).
    pub fn bytes_at(cfg: &ModelConfig, dtype: KvDtype, positions: usize) -> usize {
        cfg.layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => cfg.num_kv_heads * dtype.bytes_per_position(cfg.head_dim) * positions,
                LayerKind::DeltaNet => {
                    let d = cfg.deltanet.as_ref().expect("DeltaNet layer without deltanet config");
                    ((d.conv_kernel - 1) * d.conv_dim() + d.num_v_heads * d.k_head_dim * d.v_head_dim) * 4
                }
            })
            .sum()
    }

    /// Bytes one position takes in all of a session's KV caches of `dtype`.
    pub fn kv_bytes_per_position(cfg: &ModelConfig, dtype: KvDtype) -> usize {
        let layers = cfg.layer_kinds.iter().filter(|k| matches!(k, LayerKind::Attention)).count();
        layers * cfg.num_kv_heads * dtype.bytes_per_position(cfg.head_dim)
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
            assert!(matches!(c.value_scales(h), PagedScales::F32(_)), "v8 values have f32 scales");
            let (ks, sc) = c.scales_f32(h);
            assert!(ks.is_empty() && matches!(c.key_scales(h), PagedScales::None));
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
        assert_eq!((c.len(), c.scales_f32(1).1.len()), (2, 2));
        c.reserve(300);
        let pages = 302usize.div_ceil(DEFAULT_PAGE_ROWS);
        assert_eq!(c.capacity_bytes(), heads * pages * DEFAULT_PAGE_ROWS * (2 * d + d + 4));
        assert_eq!(c.used_bytes(), heads * 2 * (2 * d + d + 4));
        assert_eq!(KvDtype::parse("v8").unwrap(), KvDtype::V8);
        assert!(KvDtype::parse("q8").unwrap_err().to_string().contains("f32, f16, v8 or kv8"));
    }

    #[test]
    fn kv8_cache_keeps_keys_and_values_within_half_a_step_of_their_f16_row_scales() {
        let (heads, d) = (2, 64);
        let mut c = KvCache::with_dtype(heads, d, KvDtype::Kv8);
        let row = |p: usize| -> Vec<f32> {
            (0..heads * d).map(|j| ((p * 131 + j * 17) % 97) as f32 / 9.7 - 5.0 + (j / d) as f32 * 30.0).collect()
        };
        let (k, v): (Vec<f32>, Vec<f32>) = ((0..5).flat_map(row).collect(), (0..5).flat_map(|p| row(p + 7)).collect());
        c.push(&k[..2 * heads * d], &v[..2 * heads * d]);
        c.push(&k[2 * heads * d..], &v[2 * heads * d..]);
        // A zero row: scale 0, codes 0, no NaN; a row past f16's range saturates, finite.
        c.push(&vec![0.0; heads * d], &vec![0.0; heads * d]);
        c.push(&vec![1e9; heads * d], &vec![-1e9; heads * d]);
        assert_eq!(c.len(), 7);
        // Half a step of the row's scale, and what the scale's f16 rounding moves the largest
        // value.
        let check = |got: &[f32], want: &[f32], sc: f16, what: &str| {
            let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(sc, f16::from_f32(amax / 127.0), "{what}: scale");
            let sc = sc.to_f32();
            let tol = 0.5 * sc * 1.0001 + (127.0 * sc - amax).abs();
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= tol, "{what} [{i}]: {g} vs {w}");
            }
        };
        for h in 0..heads {
            let (gk, gv) = c.rows_f32(h);
            assert!(matches!((c.key_scales(h), c.value_scales(h)), (PagedScales::F16(_), PagedScales::F16(_))));
            let (ks, vs) = c.scales_f32(h);
            let (ks, vs): (Vec<f16>, Vec<f16>) =
                (ks.iter().map(|&x| f16::from_f32(x)).collect(), vs.iter().map(|&x| f16::from_f32(x)).collect());
            let KvRows::I8(pages) = c.keys(h) else { panic!("kv8 keys are codes") };
            let codes: Vec<i8> = pages.iter().flat_map(|p| p.iter().copied()).collect();
            assert_eq!((ks.len(), vs.len()), (7, 7));
            assert_eq!((ks[5].to_f32(), vs[5].to_f32()), (0.0, 0.0));
            assert_eq!((ks[6], vs[6]), (f16::MAX, f16::MAX));
            for p in 0..5 {
                // Values as they come; keys in the rotated basis, then rotated back.
                check(&gv[p * d..(p + 1) * d], &row(p + 7)[h * d..(h + 1) * d], vs[p], &format!("value {h}/{p}"));
                let want = &row(p)[h * d..(h + 1) * d];
                let mut rot = want.to_vec();
                rotate(&c.key_signs, &mut rot);
                let stored: Vec<f32> = codes[p * d..(p + 1) * d].iter().map(|&x| ks[p].to_f32() * x as f32).collect();
                check(&stored, &rot, ks[p], &format!("key {h}/{p}"));
                let err: f32 =
                    gk[p * d..(p + 1) * d].iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum::<f32>().sqrt();
                let bound = (0.5 * ks[p].to_f32()
                    + (127.0 * ks[p].to_f32() - rot.iter().fold(0f32, |m, x| m.max(x.abs()))).abs())
                    * (d as f32).sqrt();
                assert!(err <= bound * 1.001, "key {h}/{p}: error {err}, bound {bound}");
            }
            for got in [&gk, &gv] {
                assert!(got[5 * d..6 * d].iter().all(|&x| x == 0.0));
                assert!(got[6 * d..].iter().all(|&x| x.is_finite()));
            }
            assert!(gv[6 * d..].iter().all(|&x| x == -127.0 * f16::MAX.to_f32()));
            assert!(matches!((c.keys(h), c.values(h)), (KvRows::I8(_), KvRows::I8(_))));
        }
        // The rotation keeps q · k and is undone exactly enough.
        let (q, kk) = (row(3)[..d].to_vec(), row(4)[..d].to_vec());
        let (mut rq, mut rk) = (q.clone(), kk.clone());
        c.rotate_queries(&mut rq);
        rotate(&c.key_signs, &mut rk);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(&rq, &rk) - dot(&q, &kk)).abs() <= 1e-4 * dot(&q, &q).sqrt() * dot(&kk, &kk).sqrt());
        unrotate(&c.key_signs, &mut rk);
        assert!(rk.iter().zip(&kk).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())));
        // Other types leave queries as they are; so does a head size that is not a power of two.
        let mut same = q.clone();
        KvCache::with_dtype(1, d, KvDtype::V8).rotate_queries(&mut same);
        KvCache::with_dtype(1, 48, KvDtype::Kv8).rotate_queries(&mut same[..48]);
        assert_eq!(same, q);
        // Truncation keeps codes and scales together; reserved room is counted, 2·d + 4 bytes
        // a position and head.
        c.truncate(2);
        let (ks, vs) = c.scales_f32(1);
        assert_eq!((c.len(), ks.len(), vs.len()), (2, 2, 2));
        c.reserve(300);
        let pages = 302usize.div_ceil(DEFAULT_PAGE_ROWS);
        assert_eq!(c.capacity_bytes(), heads * pages * DEFAULT_PAGE_ROWS * KvDtype::Kv8.bytes_per_position(d));
        assert_eq!(c.used_bytes(), heads * 2 * KvDtype::Kv8.bytes_per_position(d));
        assert_eq!(KvDtype::Kv8.bytes_per_position(d), 2 * d + 4);
        assert_eq!(KvDtype::parse("kv8").unwrap(), KvDtype::Kv8);
        assert_eq!(KvDtype::Kv8.name(), "kv8");
    }

    #[test]
    fn pages_grow_with_the_positions_and_are_returned_on_truncation() {
        let (heads, d) = (2, 16);
        let row = |p: usize| -> Vec<f32> { (0..heads * d).map(|j| ((p * 37 + j * 11) % 23) as f32 - 11.0).collect() };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
            let bpp = heads * dtype.bytes_per_position(d);
            let whole = {
                let mut c = KvCache::paged(heads, d, dtype, 1024);
                let rows: Vec<f32> = (0..70).flat_map(row).collect();
                c.push(&rows, &rows);
                c
            };
            for page in [8usize, 16, 24] {
                let mut c = KvCache::paged(heads, d, dtype, page);
                assert_eq!(c.capacity_bytes(), 0);
                // Rows in uneven pushes: the same stored values as one cache page.
                let mut p = 0;
                for n in [1usize, 9, 3, 20, 37] {
                    let rows: Vec<f32> = (p..p + n).flat_map(row).collect();
                    c.push(&rows, &rows);
                    p += n;
                    assert_eq!(c.capacity_bytes(), p.div_ceil(page) * page * bpp, "{dtype:?} page {page} at {p}");
                    assert_eq!(c.used_bytes(), p * bpp);
                }
                for h in 0..heads {
                    assert_eq!(c.rows_f32(h), whole.rows_f32(h), "{dtype:?} page {page} head {h}");
                    assert_eq!(c.scales_f32(h), whole.scales_f32(h));
                }
                // A snapshot holds the pages in use; truncation returns the pages past the
                // last kept row, and rows pushed again land where the old ones were.
                let snap = c.clone();
                c.truncate(page + 3);
                assert_eq!(c.capacity_bytes(), 2 * page * bpp, "{dtype:?} page {page}");
                let rows: Vec<f32> = (page + 3..70).flat_map(row).collect();
                c.push(&rows, &rows);
                for h in 0..heads {
                    assert_eq!(c.rows_f32(h), snap.rows_f32(h), "{dtype:?} page {page} head {h}: pushed again");
                    assert_eq!(c.scales_f32(h), snap.scales_f32(h));
                }
                // Reserved room is kept through truncation, released by the next reserve.
                c.reserve(2 * page);
                let reserved = c.capacity_bytes();
                assert_eq!(reserved, (70 + 2 * page).div_ceil(page) * page * bpp);
                c.truncate(5);
                assert_eq!(c.capacity_bytes(), reserved);
                c.reserve(0);
                c.truncate(5);
                assert_eq!(c.capacity_bytes(), page * bpp);
                c.truncate(0);
                assert_eq!((c.len(), c.capacity_bytes()), (0, page * bpp), "the room of the last reserve");
            }
        }
    }
}
