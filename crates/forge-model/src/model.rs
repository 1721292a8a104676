//! The model graph: embedding → layers (token mixer + SwiGLU MLP, pre-norm residual) → norm →
//! head. One code path serves T = 1 (decode), small T (verify) and large T (prefill).

use crate::linear::Linear;

/// Multiply-adds below which a section runs on the calling thread rather than forking. Low on
/// purpose: keeping the other workers busy between matrix kernels keeps them from falling asleep
/// (at 2¹⁸ instead, SmolLM2's decode on 2 threads runs 10–15 % slower).
const PAR_MIN_MACS: usize = 1 << 12;

/// Whether a section of `macs` multiply-adds should fork.
fn fork(macs: usize) -> bool {
    macs >= PAR_MIN_MACS && rayon::current_num_threads() > 1
}

/// Rows at or above which the per-row work between matrix calls (norms, residual adds, SwiGLU)
/// is split over the workers: at prefill sizes it would otherwise run on one core while the
/// others wait (SmolLM2, 64 tokens, 2 threads: about 5 % of prefill).
const PAR_MIN_ROWS: usize = 16;

/// Rows per task for `t` rows: two tasks per worker.
fn rows_per_task(t: usize) -> Option<usize> {
    let threads = rayon::current_num_threads();
    (t >= PAR_MIN_ROWS && threads > 1).then(|| t.div_ceil(2 * threads))
}

/// `f(first_row, rows)` over `data` cut into whole rows of `width`, in parallel at prefill sizes.
fn by_rows(data: &mut [f32], width: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    match rows_per_task(data.len() / width.max(1)) {
        Some(per) => par_chunks_mut(data, per * width, &|i, c| f(i * per, c)),
        None => f(0, data),
    }
}

use crate::session::{DeltaState, KvCache, KvDtype, KvRows, LayerState, Session};
use anyhow::{bail, Context, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::config::{Arch, DeltaNetConfig, LayerKind, ModelConfig};
use forge_core::tensor::HostTensor;
use forge_kernels::act::{sigmoid, silu, softplus, swiglu};
use forge_kernels::attention::{
    attend_group, attend_rows, attend_tokens, merge_parts, n_parts, part_len, part_rows, KvElem, PagedHistory,
};
use forge_kernels::deltanet;
use forge_kernels::norm::{l2norm_inplace, rmsnorm, rmsnorm_gated, rmsnorm_inplace};
use forge_kernels::rope::Rope;
use forge_kernels::scratch::Buf;
use forge_kernels::team::{par_chunks2_mut, par_chunks_mut, with_team};

/// Gated DeltaNet chunk length for prefill (as transformers and FLA).
pub const DELTANET_CHUNK: usize = 64;

/// Rows up to which a forward pass gives each row the same bits as decoding it alone (one row
/// per call): the dense products stay on their few-row path and DeltaNet layers step their
/// recurrence row by row. Speculative verification feeds at most this many rows.
pub const VERIFY_MAX_ROWS: usize = 8;

/// Most tokens in one of prefill's attention tiles (`attend_tokens`).
const PREFILL_TILE: usize = 16;

pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

pub struct DeltaNet {
    pub in_qkv: Linear,
    pub in_z: Linear,
    pub in_b: Linear,
    pub in_a: Linear,
    pub out: Linear,
    /// Depthwise conv weights, `conv_dim × kernel`.
    pub conv_w: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    pub norm_w: Vec<f32>,
}

#[allow(clippy::large_enum_variant)] // one per layer: boxing buys nothing
pub enum Mixer {
    Attention(Attention),
    DeltaNet(DeltaNet),
}

pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub mlp: Mlp,
}

/// Where token embeddings come from.
#[derive(Clone)]
pub enum Embedding {
    /// `[vocab, hidden]` table, looked up row by row.
    Table(HostTensor),
    /// Tied to the head, which is quantized: rows decoded from the head (the matrix is stored once).
    TiedHead,
    /// A GGUF file's block-quantized table in the file's mapping, one row decoded per token.
    Blocks(std::sync::Arc<forge_core::gguf::BlockMatrix>),
}

/// Supplies a replacement (e.g. quantized) linear layer by canonical name, `None` to read the
/// dense weight from the checkpoint.
pub type LinearProvider<'a> = dyn Fn(&str, usize, usize) -> Result<Option<Linear>> + 'a;

pub struct Model {
    pub cfg: ModelConfig,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    pub head: Linear,
    pub rope: Rope,
    /// The KV cache type of the sessions [`Model::new_session`] makes (f32 unless set).
    kv_dtype: KvDtype,
    /// Positions per KV cache page of this model's sessions.
    kv_page_rows: usize,
    /// Tokens of a long input run through the layers at a time (0: chosen from the shape).
    prefill_chunk: usize,
    /// Positions a session may hold (`None`: no limit).
    ctx_size: Option<usize>,
}

/// Which logits `forward` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

/// One sequence's share of a batched forward pass ([`Model::forward_batch`]).
pub struct Step<'a> {
    pub session: &'a mut Session,
    pub tokens: &'a [u32],
    pub want: Logits,
}

/// One sequence's rows within a layer of a batched pass.
struct Segment<'a> {
    state: &'a mut LayerState,
    t: usize,
    pos0: usize,
}

fn small(ck: &Checkpoint, name: &str, n: usize) -> Result<Vec<f32>> {
    ck.require_numel(name, &[n])?.to_f32_vec()
}

fn linear(
    ck: &Checkpoint,
    provider: &LinearProvider,
    name: &str,
    out_f: usize,
    in_f: usize,
    bias: bool,
) -> Result<Linear> {
    if let Some(mut l) = provider(name, out_f, in_f)? {
        if bias && l.bias.is_none() {
            l.bias = ck.get(&format!("{name}.bias"))?.map(|b| b.to_f32_vec()).transpose()?;
        }
        return Ok(l);
    }
    let w = ck.require(&format!("{name}.weight"), &[out_f, in_f])?;
    let b = if bias {
        match ck.get(&format!("{name}.bias"))? {
            Some(b) if b.numel() == out_f => Some(b.to_f32_vec()?),
            Some(b) => bail!(
                "{}: tensor '{}' has shape {:?}, expected [{out_f}]",
                ck.path().display(),
                ck.stored_name(&format!("{name}.bias")),
                b.shape
            ),
            None => None,
        }
    } else {
        None
    };
    Ok(Linear::dense(name, w, b))
}

impl Model {
    /// Build the graph from a checkpoint, checking every tensor's shape against the config.
    pub fn load(ck: &Checkpoint, cfg: ModelConfig) -> Result<Model> {
        Self::load_with(ck, cfg, &|_, _, _| Ok(None))
    }

    /// Like `load`, with linear layers supplied by `provider` where it has them.
    pub fn load_with(ck: &Checkpoint, cfg: ModelConfig, provider: &LinearProvider) -> Result<Model> {
        Self::load_with_embedding(ck, cfg, provider, None)
    }

    /// Like `load_with`, with the embedding given (`None`: read from the checkpoint). A tied
    /// embedding whose head `provider` supplies is read through the head either way.
    pub fn load_with_embedding(
        ck: &Checkpoint,
        cfg: ModelConfig,
        provider: &LinearProvider,
        embedding: Option<Embedding>,
    ) -> Result<Model> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let head_override = provider("lm_head", v, h)?;
        let embed = if cfg.tie_embeddings && head_override.is_some() {
            Embedding::TiedHead
        } else if let Some(e) = embedding {
            e
        } else {
            let e = ck.require("embed_tokens.weight", &[v, h])?;
            e.floats().with_context(|| format!("{}: embed_tokens.weight", ck.path().display()))?;
            ck.advise_random("embed_tokens.weight");
            Embedding::Table(e)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, kind) in cfg.layer_kinds.iter().enumerate() {
            let p = format!("layers.{i}");
            let mixer = match kind {
                LayerKind::Attention => {
                    let (nh, kvh, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
                    let a = format!("{p}.self_attn");
                    Mixer::Attention(Attention {
                        q: linear(ck, provider, &format!("{a}.q_proj"), cfg.q_proj_dim(), h, true)?,
                        k: linear(ck, provider, &format!("{a}.k_proj"), kvh * hd, h, true)?,
                        v: linear(ck, provider, &format!("{a}.v_proj"), kvh * hd, h, true)?,
                        o: linear(ck, provider, &format!("{a}.o_proj"), h, nh * hd, true)?,
                        q_norm: if cfg.qk_norm { Some(small(ck, &format!("{a}.q_norm.weight"), hd)?) } else { None },
                        k_norm: if cfg.qk_norm { Some(small(ck, &format!("{a}.k_norm.weight"), hd)?) } else { None },
                    })
                }
                LayerKind::DeltaNet => {
                    let d = cfg.deltanet.as_ref().unwrap();
                    let a = format!("{p}.linear_attn");
                    Mixer::DeltaNet(DeltaNet {
                        in_qkv: linear(ck, provider, &format!("{a}.in_proj_qkv"), d.conv_dim(), h, false)?,
                        in_z: linear(ck, provider, &format!("{a}.in_proj_z"), d.value_dim(), h, false)?,
                        in_b: linear(ck, provider, &format!("{a}.in_proj_b"), d.num_v_heads, h, false)?,
                        in_a: linear(ck, provider, &format!("{a}.in_proj_a"), d.num_v_heads, h, false)?,
                        out: linear(ck, provider, &format!("{a}.out_proj"), h, d.value_dim(), false)?,
                        conv_w: ck
                            .require_numel(&format!("{a}.conv1d.weight"), &[d.conv_dim(), d.conv_kernel])?
                            .to_f32_vec()?,
                        dt_bias: small(ck, &format!("{a}.dt_bias"), d.num_v_heads)?,
                        a_log: small(ck, &format!("{a}.A_log"), d.num_v_heads)?,
                        norm_w: small(ck, &format!("{a}.norm.weight"), d.v_head_dim)?,
                    })
                }
            };
            let m = format!("{p}.mlp");
            let f = cfg.intermediate_size;
            layers.push(Layer {
                input_norm: small(ck, &format!("{p}.input_layernorm.weight"), h)?,
                post_norm: small(ck, &format!("{p}.post_attention_layernorm.weight"), h)?,
                mixer,
                mlp: Mlp {
                    gate: linear(ck, provider, &format!("{m}.gate_proj"), f, h, false)?,
                    up: linear(ck, provider, &format!("{m}.up_proj"), f, h, false)?,
                    down: linear(ck, provider, &format!("{m}.down_proj"), h, f, false)?,
                },
            });
        }
        let head = match (head_override, &embed) {
            (Some(l), _) => l,
            (None, Embedding::Table(e)) if cfg.tie_embeddings => Linear::dense("lm_head", e.clone(), None),
            (None, Embedding::Blocks(m)) if cfg.tie_embeddings => {
                Linear::with_weight("lm_head", v, h, crate::linear::Weight::Gguf(m.clone()))
            }
            (None, _) => linear(ck, provider, "lm_head", v, h, false)?,
        };
        let rope = Rope::new(cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling.as_ref());
        let (kv_dtype, kv_page_rows) = (KvDtype::F32, crate::session::DEFAULT_PAGE_ROWS);
        let final_norm = small(ck, "norm.weight", h)?;
        let (prefill_chunk, ctx_size) = (0, None);
        Ok(Model { final_norm, embed, layers, head, rope, cfg, kv_dtype, kv_page_rows, prefill_chunk, ctx_size })
    }

    /// A session with KV caches of this model's type ([`Model::set_kv_dtype`]; f32 unless set).
    pub fn new_session(&self) -> Session {
        Session::with_kv(&self.cfg, self.kv_dtype, self.kv_page_rows)
    }

    /// A session with KV caches of type `dtype`, whatever this model's own.
    pub fn new_session_with_kv(&self, dtype: KvDtype) -> Session {
        Session::with_kv(&self.cfg, dtype, self.kv_page_rows)
    }

    /// This model with sessions whose KV caches grow in pages of `rows` positions (a multiple
    /// of eight; [`crate::session::DEFAULT_PAGE_ROWS`] unless set). The page size changes
    /// memory's granularity, never a result's bits.
    pub fn with_kv_pages(mut self, rows: usize) -> Self {
        assert!(rows > 0 && rows.is_multiple_of(8), "KV pages of {rows} positions (a multiple of 8)");
        self.kv_page_rows = rows;
        self
    }

    /// The KV cache type of the sessions [`Model::new_session`] makes from now on: a value of
    /// this model, so that two models in one process (a target and its drafter) may differ.
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        self.kv_dtype = dtype;
    }

    /// This model with sessions of KV cache type `dtype` ([`Model::set_kv_dtype`]).
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Self {
        self.kv_dtype = dtype;
        self
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Positions per KV cache page of this model's sessions.
    pub fn kv_page_rows(&self) -> usize {
        self.kv_page_rows
    }

    /// This model running inputs longer than `tokens` in chunks of that many (0: chosen from
    /// its shape, [`Model::prefill_chunk`]), so that a prompt's scratch memory stops growing
    /// past one chunk. DeltaNet layers carry their state from chunk to chunk and attention
    /// reads the chunks before from the cache, so the result is the one-pass result up to the
    /// rounding of the matrix products' row blocking.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    /// [`Model::with_prefill_chunk`] on a model in place.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens;
    }

    /// Tokens a forward pass takes at a time: as set, or as many as keep a chunk's activations
    /// near 64 MiB (each token's hidden states, projections and MLP activations in f32),
    /// between 256 and 2048, a multiple of 256.
    pub fn prefill_chunk(&self) -> usize {
        if self.prefill_chunk > 0 {
            return self.prefill_chunk;
        }
        let c = &self.cfg;
        let mixer = (c.q_proj_dim() + 2 * c.num_kv_heads * c.head_dim)
            .max(c.deltanet.as_ref().map_or(0, |d| 2 * d.conv_dim() + d.num_v_heads * d.v_head_dim));
        let row_bytes = 4 * (6 * c.hidden_size + 3 * c.intermediate_size + mixer);
        ((64 << 20) / row_bytes.max(1) / 256 * 256).clamp(256, 2048)
    }

    /// This model's sessions limited to `positions` (a forward pass that would take one past
    /// them is refused before it changes anything).
    pub fn with_ctx_size(mut self, positions: usize) -> Self {
        self.ctx_size = Some(positions);
        self
    }

    pub fn ctx_size(&self) -> Option<usize> {
        self.ctx_size
    }

    /// Run `tokens` through the model, advancing `s`. Returns logits per `want`
    /// (`All`: `T × vocab`, `Last`: `vocab`).
    pub fn forward(&self, s: &mut Session, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.forward_into(s, tokens, want, &mut out)?;
        Ok(out)
    }

    /// [`Model::forward`] into `out` (resized; its capacity is reused). A decode loop that keeps
    /// `out` allocates nothing per token once warm (see `forge_kernels::scratch`), except when a
    /// KV cache grows past what [`Session::reserve`] set aside.
    pub fn forward_into(&self, s: &mut Session, tokens: &[u32], want: Logits, out: &mut Vec<f32>) -> Result<()> {
        let chunk = self.prefill_chunk();
        if tokens.len() > chunk {
            return self.forward_chunks(s, tokens, chunk, want, out);
        }
        // Run on a rayon worker: the kernels' parallel sections then fork from inside the pool
        // instead of each waking the pool from outside (one hand-off per call instead of ~100
        // per token, which on 2 cores would cost a third of SmolLM2's decode time).
        if rayon::current_thread_index().is_none() && rayon::current_num_threads() > 1 {
            return rayon::scope(|_| self.forward_here(s, tokens, want, out));
        }
        self.forward_here(s, tokens, want, out)
    }

    fn forward_here(&self, s: &mut Session, tokens: &[u32], want: Logits, out: &mut Vec<f32>) -> Result<()> {
        // Every forward pass makes many parallel calls, a few µs (decode) to a few hundred
        // (prefill) each: the other workers spin between them (`forge_kernels::team`) instead of
        // falling asleep in rayon and being woken for each.
        with_team(|| self.forward_steps(&mut [Step { session: s, tokens, want }], std::slice::from_mut(out)))
    }

    /// A long input `chunk` tokens at a time; checked whole first (ids, context size), so that
    /// an input refused leaves the session as it was.
    fn forward_chunks(
        &self,
        s: &mut Session,
        tokens: &[u32],
        chunk: usize,
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.check_input(s, tokens)?;
        out.clear();
        let mut part = Vec::new();
        let n = tokens.len().div_ceil(chunk);
        for (i, c) in tokens.chunks(chunk).enumerate() {
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if i + 1 == n => Logits::Last,
                _ => Logits::None,
            };
            self.forward_into(s, c, w, &mut part)?;
            out.extend_from_slice(&part);
        }
        Ok(())
    }

    /// An input the session can take: ids within the vocabulary, positions within the context
    /// size.
    fn check_input(&self, s: &Session, tokens: &[u32]) -> Result<()> {
        let vocab = self.cfg.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is out of range for vocabulary size {vocab}");
        }
        if let Some(ctx) = self.ctx_size {
            let end = s.pos + tokens.len();
            anyhow::ensure!(
                end <= ctx,
                "{} tokens after {} would take the session to {end} positions, past its context size of {ctx} (--ctx-size)",
                tokens.len(),
                s.pos
            );
        }
        Ok(())
    }

    /// Several sequences advanced in one pass (continuous batching): every step's rows go
    /// through each matrix together, so the weights are read once for all of them, while
    /// attention and DeltaNet run per sequence on its own cache and state. `outs[i]` receives
    /// step `i`'s logits as [`Model::forward`] would return them. Up to [`VERIFY_MAX_ROWS`] rows
    /// in all, every sequence gets the bits it would get alone.
    pub fn forward_batch(&self, steps: &mut [Step], outs: &mut [Vec<f32>]) -> Result<()> {
        if rayon::current_thread_index().is_none() && rayon::current_num_threads() > 1 {
            return rayon::scope(|_| with_team(|| self.forward_steps(steps, outs)));
        }
        with_team(|| self.forward_steps(steps, outs))
    }

    fn forward_steps(&self, steps: &mut [Step], outs: &mut [Vec<f32>]) -> Result<()> {
        anyhow::ensure!(steps.len() == outs.len(), "{} steps for {} outputs", steps.len(), outs.len());
        if steps.iter().any(|s| s.tokens.is_empty()) || steps.is_empty() {
            bail!("forward called with no tokens");
        }
        for s in steps.iter() {
            self.check_input(s.session, s.tokens)?;
        }
        let t: usize = steps.iter().map(|s| s.tokens.len()).sum();
        let h = self.cfg.hidden_size;
        let mut timer = crate::profile::start();
        let mut x = Buf::for_overwrite(t * h);
        let mut r0 = 0;
        for s in steps.iter() {
            self.embed_into(s.tokens, &mut x[r0 * h..(r0 + s.tokens.len()) * h])?;
            r0 += s.tokens.len();
        }
        timer.stop(crate::profile::Part::Embed);
        for li in 0..self.layers.len() {
            // One sequence (decode, verify, prefill) needs no list: a warm decode step allocates
            // nothing.
            if let [s] = &mut *steps {
                let mut seg = Segment { t: s.tokens.len(), pos0: s.session.pos, state: &mut s.session.layers[li] };
                self.forward_segments(li, std::slice::from_mut(&mut seg), &mut x)?;
                continue;
            }
            let mut segs: Vec<Segment> = steps
                .iter_mut()
                .map(|s| Segment { t: s.tokens.len(), pos0: s.session.pos, state: &mut s.session.layers[li] })
                .collect();
            self.forward_segments(li, &mut segs, &mut x)?;
        }
        steps.iter_mut().for_each(|s| s.session.pos += s.tokens.len());
        let mut timer = crate::profile::start();
        let r = if let [s] = &*steps {
            match s.want {
                Logits::None => {
                    outs[0].clear();
                    Ok(())
                }
                Logits::All => self.logits_into(&x, t, &mut outs[0]),
                Logits::Last => self.logits_into(&x[(t - 1) * h..], 1, &mut outs[0]),
            }
        } else {
            // The rows whose logits are wanted, in step order, through the head at once.
            let mut rows: Vec<usize> = Vec::new();
            let mut r0 = 0;
            for s in steps.iter() {
                let n = s.tokens.len();
                match s.want {
                    Logits::None => {}
                    Logits::All => rows.extend(r0..r0 + n),
                    Logits::Last => rows.push(r0 + n - 1),
                }
                r0 += n;
            }
            let mut picked = Buf::for_overwrite(rows.len() * h);
            for (dst, &r) in picked.chunks_mut(h).zip(&rows) {
                dst.copy_from_slice(&x[r * h..(r + 1) * h]);
            }
            let mut all = Vec::new();
            let r = if rows.is_empty() { Ok(()) } else { self.logits_into(&picked, rows.len(), &mut all) };
            let v = self.head.out_f;
            let mut k = 0;
            for (s, out) in steps.iter().zip(outs.iter_mut()) {
                let n = match s.want {
                    Logits::None => 0,
                    Logits::All => s.tokens.len(),
                    Logits::Last => 1,
                };
                out.clear();
                if r.is_ok() {
                    out.extend_from_slice(&all[k * v..(k + n) * v]);
                }
                k += n;
            }
            r
        };
        timer.stop(crate::profile::Part::Head);
        r
    }

    /// Embeddings of `tokens` (`T × hidden`).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = vec![0f32; tokens.len() * self.cfg.hidden_size];
        self.embed_into(tokens, &mut x)?;
        Ok(x)
    }

    /// [`Model::embed`] into `x` (`T × hidden` values).
    pub fn embed_into(&self, tokens: &[u32], x: &mut [f32]) -> Result<()> {
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        anyhow::ensure!(x.len() == tokens.len() * h, "{} values for {} embeddings of {h}", x.len(), tokens.len());
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= vocab {
                bail!("token id {tok} is out of range for vocabulary size {vocab}");
            }
            self.embed_row(tok, &mut x[i * h..(i + 1) * h])?;
        }
        Ok(())
    }

    /// Ends the speculative pass opened by [`Session::begin_speculation`], keeping its first
    /// `keep` tokens: attention layers drop the later rows, DeltaNet layers go back to their
    /// state at the start of the pass and replay the kept rows from the journal (through the
    /// same row-by-row recurrence, so the state equals that of a session that only ever saw
    /// the kept tokens).
    pub fn commit(&self, s: &mut Session, keep: usize) -> Result<()> {
        let Some(start) = s.spec_start.take() else { bail!("commit without an open speculative pass") };
        let fed = s.pos - start;
        anyhow::ensure!(keep <= fed, "cannot keep {keep} of the {fed} tokens fed in this pass");
        for (layer, st) in self.layers.iter().zip(&mut s.layers) {
            match (&layer.mixer, st) {
                (_, LayerState::Attn(cache)) => cache.truncate(start + keep),
                (Mixer::DeltaNet(d), LayerState::Delta(st)) => {
                    let mut j = std::mem::take(&mut st.journal);
                    if keep < j.rows {
                        st.conv.copy_from_slice(&j.conv0);
                        st.rec.copy_from_slice(&j.rec0);
                        if keep > 0 {
                            let c = self.cfg.deltanet.as_ref().expect("DeltaNet layer without deltanet config");
                            let (cd, nv, vd) = (c.conv_dim(), c.num_v_heads, c.value_dim());
                            // Replayed in passes of at most VERIFY_MAX_ROWS, the rows a pass steps
                            // one by one.
                            for r0 in (0..keep).step_by(VERIFY_MAX_ROWS) {
                                let n = (keep - r0).min(VERIFY_MAX_ROWS);
                                self.deltanet_core(
                                    d,
                                    st,
                                    &j.mixed[r0 * cd..(r0 + n) * cd],
                                    &j.z[r0 * vd..(r0 + n) * vd],
                                    &j.b[r0 * nv..(r0 + n) * nv],
                                    &j.a[r0 * nv..(r0 + n) * nv],
                                    n,
                                );
                            }
                        }
                    }
                    j.clear();
                    st.journal = j;
                }
                _ => bail!("session does not match the model"),
            }
        }
        s.pos = start + keep;
        Ok(())
    }

    /// Final norm and head over `n` hidden rows.
    pub fn logits(&self, rows: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.logits_into(rows, n, &mut out)?;
        Ok(out)
    }

    /// [`Model::logits`] into `out` (resized to `n × vocab`).
    pub fn logits_into(&self, rows: &[f32], n: usize, out: &mut Vec<f32>) -> Result<()> {
        let h = self.cfg.hidden_size;
        let mut normed = Buf::for_overwrite(n * h);
        for (xi, hi) in rows.chunks(h).zip(normed.chunks_mut(h)) {
            rmsnorm(xi, &self.final_norm, self.cfg.rms_eps, self.cfg.norm_zero_centered, hi);
        }
        // Every logit is written: only a change of size needs the resize.
        out.resize(n * self.head.out_f, 0.0);
        self.head.forward_into(&normed, n, out)
    }

    /// One decoder layer over `t` rows of `x` (in place), starting at position `pos0`.
    pub fn forward_layer(&self, li: usize, st: &mut LayerState, x: &mut [f32], t: usize, pos0: usize) -> Result<()> {
        anyhow::ensure!(x.len() == t * self.cfg.hidden_size, "{} values for {t} rows", x.len());
        self.forward_segments(li, &mut [Segment { state: st, t, pos0 }], x)
    }

    /// The first half of layer `li` over `x` (in place): `x += mixer(input_norm(x))`. With
    /// [`Model::forward_mlp`] after it, the same numbers as [`Model::forward_layer`].
    pub fn forward_mixer(&self, li: usize, st: &mut LayerState, x: &mut [f32], t: usize, pos0: usize) -> Result<()> {
        anyhow::ensure!(x.len() == t * self.cfg.hidden_size, "{} values for {t} rows", x.len());
        self.mixer_segments(li, &mut [Segment { state: st, t, pos0 }], x)
    }

    /// The second half of layer `li` over the `x.len() / hidden` rows of `x` (in place):
    /// `x += mlp(post_norm(x))`. Rows are independent here.
    pub fn forward_mlp(&self, li: usize, x: &mut [f32]) -> Result<()> {
        let h = self.cfg.hidden_size;
        anyhow::ensure!(x.len().is_multiple_of(h), "{} values are not rows of {h}", x.len());
        let t = x.len() / h;
        let layer = &self.layers[li];
        let mut timer = crate::profile::start();
        let hbuf = self.norm_rows(x, &layer.post_norm);
        let f = self.cfg.intermediate_size;
        let (mut g, mut u) = (Buf::for_overwrite(t * f), Buf::for_overwrite(t * f));
        Linear::forward_shared_into(&[&layer.mlp.gate, &layer.mlp.up], &hbuf, t, &mut [&mut g, &mut u])?;
        by_rows(&mut g, f, &|r0, gs| swiglu(gs, &u[r0 * f..r0 * f + gs.len()]));
        let d = layer.mlp.down.forward_buf(&g, t)?;
        by_rows(x, h, &|r0, xs| xs.iter_mut().zip(&d[r0 * h..]).for_each(|(a, b)| *a += b));
        timer.stop(crate::profile::Part::Mlp);
        Ok(())
    }

    /// The RMS norm of each row of `x` with weight `norm`.
    fn norm_rows(&self, x: &[f32], norm: &[f32]) -> Buf {
        let h = self.cfg.hidden_size;
        let (zc, eps) = (self.cfg.norm_zero_centered, self.cfg.rms_eps);
        let mut hbuf = Buf::for_overwrite(x.len());
        by_rows(&mut hbuf, h, &|r0, hb| {
            for (xi, hi) in x[r0 * h..].chunks(h).zip(hb.chunks_mut(h)) {
                rmsnorm(xi, norm, eps, zc, hi);
            }
        });
        hbuf
    }

    /// One decoder layer over the rows of `x` (in place), cut into the segments of several
    /// sequences: the matrices see every row at once, the token mixer each segment alone.
    fn forward_segments(&self, li: usize, segs: &mut [Segment], x: &mut [f32]) -> Result<()> {
        self.mixer_segments(li, segs, x)?;
        self.forward_mlp(li, x)
    }

    /// `x += mixer(input_norm(x))` over the segments' rows.
    fn mixer_segments(&self, li: usize, segs: &mut [Segment], x: &mut [f32]) -> Result<()> {
        let h = self.cfg.hidden_size;
        let t = x.len() / h;
        let layer = &self.layers[li];
        let mut timer = crate::profile::start();
        let hbuf = self.norm_rows(x, &layer.input_norm);
        let (m, part) = match &layer.mixer {
            Mixer::Attention(a) => (self.attention(li, a, segs, &hbuf, t)?, crate::profile::Part::Attention),
            Mixer::DeltaNet(d) => (self.deltanet(li, d, segs, &hbuf, t)?, crate::profile::Part::DeltaNet),
        };
        by_rows(x, h, &|r0, xs| xs.iter_mut().zip(&m[r0 * h..]).for_each(|(a, b)| *a += b));
        timer.stop(part);
        Ok(())
    }

    /// The embedding of `tok` in the model's original basis.
    pub fn embed_row(&self, tok: u32, out: &mut [f32]) -> Result<()> {
        match &self.embed {
            Embedding::Table(e) => e.floats()?.read_into(tok as usize * self.cfg.hidden_size, out),
            Embedding::Blocks(m) => m.decode_rows(tok as usize, 1, out)?,
            Embedding::TiedHead => {
                self.head.decode_rows(tok as usize, 1, out)?;
                if let Some(r) = &self.head.rotation {
                    r.unrotate_weight(out, 1);
                }
            }
        }
        Ok(())
    }

    fn attention(&self, li: usize, a: &Attention, segs: &mut [Segment], hbuf: &[f32], t: usize) -> Result<Buf> {
        let (mut qf, mut k, mut v) =
            (Buf::for_overwrite(t * a.q.out_f), Buf::for_overwrite(t * a.k.out_f), Buf::for_overwrite(t * a.v.out_f));
        Linear::forward_shared_into(&[&a.q, &a.k, &a.v], hbuf, t, &mut [&mut qf, &mut k, &mut v])?;
        let mut out = Buf::for_overwrite(t * self.cfg.num_heads * self.cfg.head_dim);
        let (mut r0, od) = (0, self.cfg.num_heads * self.cfg.head_dim);
        for seg in segs.iter_mut() {
            let LayerState::Attn(cache) = &mut *seg.state else {
                bail!("session does not match the model at layer {li}")
            };
            let n = seg.t;
            self.attention_core(
                a,
                cache,
                &qf[r0 * a.q.out_f..(r0 + n) * a.q.out_f],
                &mut k[r0 * a.k.out_f..(r0 + n) * a.k.out_f],
                &v[r0 * a.v.out_f..(r0 + n) * a.v.out_f],
                n,
                seg.pos0,
                &mut out[r0 * od..(r0 + n) * od],
            );
            r0 += n;
        }
        a.o.forward_buf(&out, t)
    }

    /// One sequence's attention after the projections (`qf`, `k`, `v`: its `t` rows): norms,
    /// RoPE from `pos0`, the cache append, attention over the history and the output gate, into
    /// `out` (the input of `o_proj`).
    #[allow(clippy::too_many_arguments)]
    fn attention_core(
        &self,
        a: &Attention,
        cache: &mut KvCache,
        qf: &[f32],
        k: &mut [f32],
        v: &[f32],
        t: usize,
        pos0: usize,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let (nh, kvh, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let mut timer = crate::profile::start();
        let qstride = cfg.q_proj_dim() / nh; // hd, or 2·hd with the output gate
        let mut q = Buf::for_overwrite(t * nh * hd);
        let mut gate = Buf::zeros(if cfg.attn_output_gate { t * nh * hd } else { 0 });
        let nf = self.rope.n_freq();
        let (mut cos, mut sin) = (Buf::for_overwrite(nf), Buf::for_overwrite(nf));
        let zc = cfg.norm_zero_centered;
        for i in 0..t {
            self.rope.cos_sin(pos0 + i, &mut cos, &mut sin);
            for head in 0..nh {
                let src = &qf[i * nh * qstride + head * qstride..];
                let dst = &mut q[(i * nh + head) * hd..(i * nh + head + 1) * hd];
                dst.copy_from_slice(&src[..hd]);
                if cfg.attn_output_gate {
                    gate[(i * nh + head) * hd..(i * nh + head + 1) * hd].copy_from_slice(&src[hd..2 * hd]);
                }
                if let Some(w) = &a.q_norm {
                    rmsnorm_inplace(dst, w, cfg.rms_eps, zc);
                }
                self.rope.apply(dst, &cos, &sin);
            }
            for head in 0..kvh {
                let dst = &mut k[(i * kvh + head) * hd..(i * kvh + head + 1) * hd];
                if let Some(w) = &a.k_norm {
                    rmsnorm_inplace(dst, w, cfg.rms_eps, zc);
                }
                self.rope.apply(dst, &cos, &sin);
            }
        }
        cache.rotate_queries(&mut q);
        cache.push(k, v);
        let group = nh / kvh;
        let scale = 1.0 / (hd as f32).sqrt();
        let cache = &*cache;
        let gsize = group * hd;
        // `body` with `kv` the first `n` rows of key/value head `g`'s history, typed as cached.
        macro_rules! over_history {
            ($g:expr, $n:expr, $kv:ident => $body:expr) => {{
                let (key_scales, value_scales, page) =
                    (cache.key_scales($g), cache.value_scales($g), cache.page_rows());
                match (cache.keys($g), cache.values($g)) {
                    (KvRows::F32(keys), KvRows::F32(values)) => {
                        let $kv = PagedHistory { keys, values, key_scales, value_scales, n: $n, d: hd, page };
                        $body
                    }
                    (KvRows::F16(keys), KvRows::F16(values)) => {
                        let $kv = PagedHistory { keys, values, key_scales, value_scales, n: $n, d: hd, page };
                        $body
                    }
                    // V8: f16 keys, value codes.
                    (KvRows::F16(keys), KvRows::I8(values)) => {
                        let $kv = PagedHistory { keys, values, key_scales, value_scales, n: $n, d: hd, page };
                        $body
                    }
                    // KV8: key and value codes, each with f16 scales.
                    (KvRows::I8(keys), KvRows::I8(values)) => {
                        let $kv = PagedHistory { keys, values, key_scales, value_scales, n: $n, d: hd, page };
                        $body
                    }
                    _ => unreachable!("keys and values of one cache share a type"),
                }
            }};
        }
        // Token `i`'s query group `g` over its history: one part of it into `o` and its
        // statistics, or (`None`) every part, merged into `o`. The query heads of a group go
        // together, so each cached key and value row is read once for all of them. The parts
        // (`part_len`, a function of the history's length alone) and their merge are the same
        // either way, so a token gets the same bits however it is computed (decode, verify,
        // prefill).
        let one = |i: usize, g: usize, part: Option<(usize, &mut [f32])>, scores: &mut [f32], o: &mut [f32]| {
            let n = pos0 + i + 1;
            let qg = &q[(i * nh + g * group) * hd..(i * nh + (g + 1) * group) * hd];
            over_history!(g, n, kv => attend_item(qg, hd, kv, part, scale, scores, o))
        };
        let threads = rayon::current_num_threads();
        if t >= PAR_MIN_ROWS {
            // Prefill: tiles of consecutive tokens (`attend_tokens`), each key and value row
            // read and widened once for a tile's tokens rather than once a token, each token
            // with the bits it gets alone. An item is a tile with every key/value head, so its
            // output is one piece of `out`; eight items a worker, claimed in order, keep the
            // later tiles' longer histories from leaving one worker alone at the end.
            let tile = t.div_ceil(8 * threads).clamp(1, PREFILL_TILE);
            par_chunks_mut(out, tile * nh * hd, &|k, o| {
                let (i0, tt) = (k * tile, o.len() / (nh * hd));
                let (mut qt, mut ot) = (Buf::for_overwrite(tt * gsize), Buf::for_overwrite(tt * gsize));
                for g in 0..kvh {
                    for (i, qi) in qt.chunks_mut(gsize).enumerate() {
                        let r = ((i0 + i) * nh + g * group) * hd;
                        qi.copy_from_slice(&q[r..r + gsize]);
                    }
                    let (n0, n) = (pos0 + i0 + 1, pos0 + i0 + tt);
                    over_history!(g, n, kv => attend_tokens(&qt, hd, group, n0, kv, scale, &mut ot));
                    for (i, oi) in ot.chunks(gsize).enumerate() {
                        let r = (i * nh + g * group) * hd;
                        o[r..r + gsize].copy_from_slice(oi);
                    }
                }
            });
        } else {
            // Decode and verify: items (token, key/value head, part of that token's history),
            // parts fastest, so that decode's few heads still give every worker work.
            let parts = (pos0 + 1..=pos0 + t).map(n_parts).max().unwrap_or(1);
            let slot = gsize + 2 * group;
            let items = t * kvh * parts;
            let item = |scores: &mut [f32], k: usize, sl: &mut [f32]| {
                let (o, st) = sl.split_at_mut(gsize);
                one(k / (kvh * parts), k / parts % kvh, Some((k % parts, st)), scores, o);
            };
            // Every item writes its whole slot (an empty part zeros and `(−∞, 0)`), and every
            // score before it is read.
            let mut slots = Buf::for_overwrite(items * slot);
            let ssize = group * part_len(pos0 + t);
            // Fork only when there is enough work to pay for it (not for decode at short context).
            if fork((pos0 + t) * t * nh * hd) {
                // One item per task at decode sizes, else about four tasks per worker; each task's
                // score buffer is taken here, on the calling thread, so that the workers need no
                // scratch of their own.
                let per = if items <= 8 * threads { 1 } else { items.div_ceil(4 * threads) };
                let tasks = items.div_ceil(per);
                let mut scores = Buf::for_overwrite(tasks * ssize);
                par_chunks2_mut(&mut slots, per * slot, &mut scores, ssize, &|k, sl, sc| {
                    sl.chunks_mut(slot).enumerate().for_each(|(j, s)| item(sc, k * per + j, s));
                });
            } else {
                let mut scores = Buf::for_overwrite(ssize);
                slots.chunks_mut(slot).enumerate().for_each(|(k, s)| item(&mut scores, k, s));
            }
            for (o, sl) in out.chunks_mut(gsize).zip(slots.chunks(parts * slot)) {
                merge_parts(group, sl, o);
            }
        }
        if cfg.attn_output_gate {
            out.iter_mut().zip(gate.iter()).for_each(|(o, &g)| *o *= sigmoid(g));
        }
        timer.stop(crate::profile::Part::AttentionCore);
    }

    fn deltanet(&self, li: usize, d: &DeltaNet, segs: &mut [Segment], hbuf: &[f32], t: usize) -> Result<Buf> {
        let c: &DeltaNetConfig = self.cfg.deltanet.as_ref().context("DeltaNet layer without deltanet config")?;
        let (cd, nv, vd) = (c.conv_dim(), c.num_v_heads, c.value_dim());
        let (mut mixed, mut z, mut b, mut a) = (
            Buf::for_overwrite(t * cd),
            Buf::for_overwrite(t * vd),
            Buf::for_overwrite(t * nv),
            Buf::for_overwrite(t * nv),
        );
        Linear::forward_shared_into(
            &[&d.in_qkv, &d.in_z, &d.in_b, &d.in_a],
            hbuf,
            t,
            &mut [&mut mixed, &mut z, &mut b, &mut a],
        )?;
        let one = segs.len() == 1;
        let mut core = if one { None } else { Some(Buf::for_overwrite(t * vd)) };
        let mut r0 = 0;
        for seg in segs.iter_mut() {
            let LayerState::Delta(st) = &mut *seg.state else {
                bail!("session does not match the model at layer {li}")
            };
            let n = seg.t;
            let (m, zz, bb, aa) = (
                &mixed[r0 * cd..(r0 + n) * cd],
                &z[r0 * vd..(r0 + n) * vd],
                &b[r0 * nv..(r0 + n) * nv],
                &a[r0 * nv..(r0 + n) * nv],
            );
            st.journal.record(n, m, zz, bb, aa);
            let o = self.deltanet_core(d, st, m, zz, bb, aa, n);
            match &mut core {
                None => return d.out.forward_buf(&o, t),
                Some(c) => c[r0 * vd..(r0 + n) * vd].copy_from_slice(&o),
            }
            r0 += n;
        }
        d.out.forward_buf(&core.expect("several segments"), t)
    }

    /// A DeltaNet's token mixing after its input projections: conv, delta rule, gated norm, for
    /// `t` rows of the projections (`mixed`, `z`, `b`, `a`), advancing `st`. Its output is the
    /// input of `out_proj`.
    #[allow(clippy::too_many_arguments)]
    fn deltanet_core(
        &self,
        d: &DeltaNet,
        st: &mut DeltaState,
        mixed: &[f32],
        z: &[f32],
        b: &[f32],
        a: &[f32],
        t: usize,
    ) -> Buf {
        let c: &DeltaNetConfig = self.cfg.deltanet.as_ref().unwrap();
        let (cd, kern) = (c.conv_dim(), c.conv_kernel);
        let (nk, nv, dk, dv) = (c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim);
        let (kd, vd) = (c.key_dim(), c.value_dim());
        let mut timer = crate::profile::start();
        // Causal depthwise conv over [state (kernel−1 rows) | new rows], then SiLU.
        let hist = kern - 1;
        let mut full = Buf::for_overwrite((hist + t) * cd);
        full[..hist * cd].copy_from_slice(&st.conv);
        full[hist * cd..].copy_from_slice(mixed);
        let mut conv = Buf::for_overwrite(t * cd);
        // Flat index `f` of `conv` is row `f / cd`, channel `f % cd`. Decode has one row, so the
        // work is split over channels, not rows: a row of the 27B shape is 10240 channels, each
        // four taps and a SiLU: on one core, while the others wait, that takes nearly twice as
        // long as split.
        let conv_span = |start: usize, out: &mut [f32]| {
            let (mut f, mut rest) = (start, out);
            while !rest.is_empty() {
                let (i, c0) = (f / cd, f % cd);
                let (seg, tail) = rest.split_at_mut((cd - c0).min(rest.len()));
                for (ch, o) in (c0..).zip(seg.iter_mut()) {
                    let w = &d.conv_w[ch * kern..(ch + 1) * kern];
                    let mut acc = 0f32;
                    for (j, &wj) in w.iter().enumerate() {
                        acc += wj * full[(i + j) * cd + ch];
                    }
                    *o = silu(acc);
                }
                f += seg.len();
                rest = tail;
            }
        };
        if fork(t * cd * kern) {
            let piece = (t * cd).div_ceil(2 * rayon::current_num_threads()).next_multiple_of(16);
            par_chunks_mut(&mut conv, piece, &|k, o| conv_span(k * piece, o));
        } else {
            conv_span(0, &mut conv);
        }
        st.conv.copy_from_slice(&full[t * cd..]);
        let ratio = nv / nk;
        let qscale = 1.0 / (dk as f32).sqrt();
        // Per value head: gather, normalize, run the delta rule, then the gated norm. Each head's
        // work area, taken here on the calling thread (the workers need no scratch of their own),
        // holds its output `o` (`t × dv`) then `q`, `k` (`t × dk`), `v` (`t × dv`), `g` and `β`.
        let area = t * (2 * dv + 2 * dk + 2);
        let head = |hv: usize, state: &mut [f32], work: &mut [f32]| {
            let hk = hv / ratio;
            let (o, rest) = work.split_at_mut(t * dv);
            let (q, rest) = rest.split_at_mut(t * dk);
            let (k, rest) = rest.split_at_mut(t * dk);
            let (v, rest) = rest.split_at_mut(t * dv);
            let (g, beta) = rest.split_at_mut(t);
            for i in 0..t {
                let row = &conv[i * cd..(i + 1) * cd];
                let qi = &mut q[i * dk..(i + 1) * dk];
                qi.copy_from_slice(&row[hk * dk..(hk + 1) * dk]);
                l2norm_inplace(qi, 1e-6);
                qi.iter_mut().for_each(|x| *x *= qscale);
                let ki = &mut k[i * dk..(i + 1) * dk];
                ki.copy_from_slice(&row[kd + hk * dk..kd + (hk + 1) * dk]);
                l2norm_inplace(ki, 1e-6);
                v[i * dv..(i + 1) * dv].copy_from_slice(&row[2 * kd + hv * dv..2 * kd + (hv + 1) * dv]);
                beta[i] = sigmoid(b[i * nv + hv]);
                g[i] = -d.a_log[hv].exp() * softplus(a[i * nv + hv] + d.dt_bias[hv]);
            }
            if t <= VERIFY_MAX_ROWS {
                // Row by row, as decode runs them: a verify pass then gives every row the bits
                // decoding would (exact greedy speculation), and a journal replay the same state.
                for i in 0..t {
                    let (qi, ki) = (&q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk]);
                    let (vi, oi) = (&v[i * dv..(i + 1) * dv], &mut o[i * dv..(i + 1) * dv]);
                    deltanet::recurrent_step(state, qi, ki, vi, g[i], beta[i], oi);
                }
            } else {
                deltanet::chunked(state, q, k, v, g, beta, dk, dv, DELTANET_CHUNK, o);
            }
            for (i, oi) in o.chunks_mut(dv).enumerate() {
                rmsnorm_gated(oi, &z[i * vd + hv * dv..i * vd + (hv + 1) * dv], &d.norm_w, self.cfg.rms_eps);
            }
        };
        let mut work = Buf::zeros(nv * area);
        if fork(nv * dk * dv * t) {
            // One run of neighbouring heads per worker: their states lie end to end, so each
            // worker streams one stretch of memory (on the 27B shape about 1.45× as fast as one
            // head per task, whose neighbours go to different workers).
            let hpt = nv.div_ceil(rayon::current_num_threads());
            par_chunks2_mut(&mut st.rec, hpt * dk * dv, &mut work, hpt * area, &|k, states, works| {
                for (j, (state, w)) in states.chunks_mut(dk * dv).zip(works.chunks_mut(area)).enumerate() {
                    head(k * hpt + j, state, w);
                }
            });
        } else {
            for (hv, (state, w)) in st.rec.chunks_mut(dk * dv).zip(work.chunks_mut(area)).enumerate() {
                head(hv, state, w);
            }
        }
        let mut core = Buf::for_overwrite(t * vd);
        for (hv, w) in work.chunks(area).enumerate() {
            let o = &w[..t * dv];
            for i in 0..t {
                core[i * vd + hv * dv..i * vd + (hv + 1) * dv].copy_from_slice(&o[i * dv..(i + 1) * dv]);
            }
        }
        timer.stop(crate::profile::Part::DeltaNetCore);
        core
    }

    /// Mutable access to every linear layer of layer `l` (mixer first, execution order).
    pub fn layer_linears_mut(&mut self, l: usize) -> Vec<&mut Linear> {
        let layer = &mut self.layers[l];
        let mut v: Vec<&mut Linear> = match &mut layer.mixer {
            Mixer::Attention(a) => vec![&mut a.q, &mut a.k, &mut a.v, &mut a.o],
            Mixer::DeltaNet(d) => vec![&mut d.in_qkv, &mut d.in_z, &mut d.in_b, &mut d.in_a, &mut d.out],
        };
        v.extend([&mut layer.mlp.gate, &mut layer.mlp.up, &mut layer.mlp.down]);
        v
    }

    /// Every linear layer, in execution order (head last).
    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = Vec::new();
        for l in &self.layers {
            match &l.mixer {
                Mixer::Attention(a) => v.extend([&a.q, &a.k, &a.v, &a.o]),
                Mixer::DeltaNet(d) => v.extend([&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out]),
            }
            v.extend([&l.mlp.gate, &l.mlp.up, &l.mlp.down]);
        }
        v.push(&self.head);
        v
    }

    pub fn is_hybrid(&self) -> bool {
        self.cfg.arch == Arch::Qwen35
    }
}
/// The attention of one token's query group over its `kv.n` history rows: part `p` of it into
/// `out` and `stats` (a part past this token's own count, as verify's earlier tokens leave,
/// stays empty), or (`None`) every part, merged into `out`.
fn attend_item<K: KvElem, V: KvElem>(
    qg: &[f32],
    hd: usize,
    kv: PagedHistory<K, V>,
    part: Option<(usize, &mut [f32])>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    match part {
        Some((p, stats)) => {
            attend_rows(qg, hd, kv, part_rows(kv.n, p), scale, scores, out, stats, true);
        }
        None => attend_group(qg, hd, kv, scale, scores, out),
    }
}
