//! The llama forward pass over a batch of rows from any number of
//! sequences, reading and writing K/V through the paged [`KvCache`].
//!
//! Invariants:
//! - every row is computed independently of which other rows share the
//!   batch: each output element is one dot product computed by one thread,
//!   so batching, chunking and prefix-cache hits never change a result;
//! - a row at position `p` attends to positions `0..=p` of its sequence;
//!   the K/V of every row in the batch is written before any attention
//!   runs, so rows of one sequence in one batch see each other causally;
//! - logits are computed only for the rows listed in `logits_for`.

use crate::kv::KvCache;
use crate::pool::{split, SharedMut, ThreadPool};
use crate::quant::{
    dequant_q4_1, dequant_q8_0, dot_many, f32ops, quantize_row, ActBlock, QType, QK,
};
use crate::weights::{QMatrix, Weights};
use dynamo_batcher::BlockIdx;

/// One token to run: its id, position and sequence (index into `tables`).
#[derive(Clone, Copy, Debug)]
pub struct BatchRow {
    pub token: u32,
    pub pos: usize,
    pub seq: usize,
}

/// A step's work.
pub struct Batch<'a> {
    pub rows: Vec<BatchRow>,
    /// Block table of every sequence in the batch.
    pub tables: Vec<&'a [BlockIdx]>,
    /// Rows (indices into `rows`) whose logits are wanted, in output order.
    pub logits_for: Vec<usize>,
}

pub struct Model {
    pub w: Weights,
    inv_freq: Vec<f32>,
}

impl Model {
    pub fn new(w: Weights) -> Self {
        let hd = w.cfg.head_dim;
        let inv_freq = (0..hd / 2)
            .map(|j| w.cfg.rope_base.powf(-((2 * j) as f32) / hd as f32))
            .collect();
        Model { w, inv_freq }
    }

    /// Embedding of `token` (dequantized).
    pub fn embed(&self, token: u32, out: &mut [f32]) {
        let row = self.w.row(&self.w.embed, token as usize);
        match self.w.embed.qt {
            QType::Q8_0 => dequant_q8_0(row, out),
            QType::Q4_1 => dequant_q4_1(row, out),
        }
    }

    /// `out_m = W_m · x` for every pair, for `n` activation rows, with the
    /// rows of all matrices shared out between the threads.
    fn matmul(
        &self,
        pool: &ThreadPool,
        mats: &mut [(&QMatrix, &mut [f32])],
        acts: &[ActBlock],
        n: usize,
    ) {
        let outs: Vec<(QMatrix, SharedMut<f32>)> = mats
            .iter_mut()
            .map(|(m, o)| {
                assert!(o.len() >= n * m.rows, "matmul output too small");
                assert_eq!(acts.len(), n * m.blocks_per_row(), "matmul input shape");
                (**m, SharedMut::new(o))
            })
            .collect();
        let total: usize = outs.iter().map(|(m, _)| m.rows).sum();
        let threads = pool.threads();
        pool.run(&|t| {
            let (lo, hi) = split(total, t, threads);
            let mut base = 0;
            for (m, out) in &outs {
                let (a, b) = (lo.max(base), hi.min(base + m.rows));
                for r in a..b {
                    let lr = r - base;
                    // SAFETY: row `lr` of every output row `i` (index i*rows+lr)
                    // is written by this thread only; sizes checked above.
                    unsafe {
                        dot_many(
                            m.qt,
                            self.w.row(m, lr),
                            acts,
                            m.blocks_per_row(),
                            out.ptr().add(lr),
                            m.rows,
                        )
                    };
                }
                base += m.rows;
            }
        });
    }

    fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let s = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in out.iter_mut().zip(x).zip(w) {
            *o = v * s * w;
        }
    }

    fn quantize(x: &[f32], cols: usize, acts: &mut Vec<ActBlock>) {
        let n = x.len() / cols;
        acts.clear();
        acts.resize(n * cols / QK, ActBlock::default());
        for (xr, ar) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(cols / QK)) {
            quantize_row(xr, ar);
        }
    }

    /// Rotates adjacent pairs of every head of `x` (one row) by position.
    fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        for h in x.chunks_exact_mut(head_dim) {
            for j in 0..head_dim / 2 {
                let (a, b) = (h[2 * j], h[2 * j + 1]);
                h[2 * j] = a * cos[j] - b * sin[j];
                h[2 * j + 1] = a * sin[j] + b * cos[j];
            }
        }
    }

    /// Runs the batch; returns `logits_for.len() × vocab` logits.
    pub fn forward(&self, pool: &ThreadPool, kv: &mut KvCache, batch: &Batch) -> Vec<f32> {
        let c = &self.w.cfg;
        let n = batch.rows.len();
        let (dim, kvd, hd, ffn) = (c.dim, c.kv_dim(), c.head_dim, c.ffn_dim);
        let bs = kv.block_size();
        let slots: Vec<usize> = batch
            .rows
            .iter()
            .map(|r| batch.tables[r.seq][r.pos / bs].0 as usize * bs + r.pos % bs)
            .collect();
        let half = hd / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for (i, r) in batch.rows.iter().enumerate() {
            for j in 0..half {
                let (s, co) = (r.pos as f32 * self.inv_freq[j]).sin_cos();
                sin[i * half + j] = s;
                cos[i * half + j] = co;
            }
        }
        let mut x = vec![0f32; n * dim];
        for (i, r) in batch.rows.iter().enumerate() {
            self.embed(r.token, &mut x[i * dim..(i + 1) * dim]);
        }
        let mut xn = vec![0f32; n * dim];
        let mut acts = Vec::new();
        let mut q = vec![0f32; n * dim];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut att = vec![0f32; n * dim];
        let mut tmp = vec![0f32; n * dim];
        let mut g = vec![0f32; n * ffn];
        let mut u = vec![0f32; n * ffn];

        for (l, lw) in self.w.layers.iter().enumerate() {
            for i in 0..n {
                let r = i * dim..(i + 1) * dim;
                Self::rms_norm(&x[r.clone()], &lw.attn_norm, c.norm_eps, &mut xn[r]);
            }
            Self::quantize(&xn, dim, &mut acts);
            self.matmul(
                pool,
                &mut [(&lw.wq, &mut q), (&lw.wk, &mut k), (&lw.wv, &mut v)],
                &acts,
                n,
            );
            for i in 0..n {
                let (co, si) = (
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                Self::rope(&mut q[i * dim..(i + 1) * dim], hd, co, si);
                Self::rope(&mut k[i * kvd..(i + 1) * kvd], hd, co, si);
                kv.write(
                    l,
                    slots[i],
                    &k[i * kvd..(i + 1) * kvd],
                    &v[i * kvd..(i + 1) * kvd],
                );
            }
            self.attention(pool, kv, l, batch, &q, &mut att);
            Self::quantize(&att, dim, &mut acts);
            self.matmul(pool, &mut [(&lw.wo, &mut tmp)], &acts, n);
            for (a, b) in x.iter_mut().zip(&tmp) {
                *a += b;
            }
            for i in 0..n {
                let r = i * dim..(i + 1) * dim;
                Self::rms_norm(&x[r.clone()], &lw.ffn_norm, c.norm_eps, &mut xn[r]);
            }
            Self::quantize(&xn, dim, &mut acts);
            self.matmul(
                pool,
                &mut [(&lw.w_gate, &mut g), (&lw.w_up, &mut u)],
                &acts,
                n,
            );
            f32ops::silu_mul(&mut g, &u);
            Self::quantize(&g, ffn, &mut acts);
            self.matmul(pool, &mut [(&lw.w_down, &mut tmp)], &acts, n);
            for (a, b) in x.iter_mut().zip(&tmp) {
                *a += b;
            }
        }

        let m = batch.logits_for.len();
        let mut hn = vec![0f32; m * dim];
        for (o, &i) in batch.logits_for.iter().enumerate() {
            Self::rms_norm(
                &x[i * dim..(i + 1) * dim],
                &self.w.out_norm,
                c.norm_eps,
                &mut hn[o * dim..(o + 1) * dim],
            );
        }
        Self::quantize(&hn, dim, &mut acts);
        let mut logits = vec![0f32; m * c.vocab];
        if m > 0 {
            self.matmul(pool, &mut [(&self.w.output, &mut logits)], &acts, m);
        }
        logits
    }

    /// Causal attention of every row and head over its sequence's cache.
    fn attention(
        &self,
        pool: &ThreadPool,
        kv: &KvCache,
        l: usize,
        batch: &Batch,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.w.cfg;
        let (hd, nh, group) = (c.head_dim, c.n_heads, c.n_heads / c.n_kv_heads);
        let scale = 1.0 / (hd as f32).sqrt();
        let items = batch.rows.len() * nh;
        let threads = pool.threads();
        let outp = SharedMut::new(out);
        pool.run(&|t| {
            let (lo, hi) = split(items, t, threads);
            let mut scores: Vec<f32> = Vec::new();
            for item in lo..hi {
                let (i, h) = (item / nh, item % nh);
                let row = batch.rows[i];
                let head = Head {
                    kv,
                    layer: l,
                    kv_off: (h / group) * hd,
                    table: batch.tables[row.seq],
                    pos: row.pos,
                    scale,
                };
                let qh = &q[(i * nh + h) * hd..(i * nh + h + 1) * hd];
                // SAFETY: head `h` of row `i` is written by this thread only.
                let o = unsafe { outp.slice((i * nh + h) * hd, hd) };
                head.attend(qh, &mut scores, o);
            }
        });
    }
}

/// One query head's view of its sequence's cache.
struct Head<'a> {
    kv: &'a KvCache,
    layer: usize,
    /// Offset of the K/V head inside a slot's row.
    kv_off: usize,
    table: &'a [BlockIdx],
    pos: usize,
    scale: f32,
}

impl Head<'_> {
    /// `out = softmax(q·K[0..=pos] · scale) · V[0..=pos]`.
    fn attend(&self, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::simd_available() {
            // SAFETY: avx2 and fma are present.
            return unsafe { self.attend_avx2(q, scores, out) };
        }
        self.attend_impl(q, scores, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn attend_avx2(&self, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        self.attend_impl(q, scores, out)
    }

    #[inline(always)]
    fn attend_impl(&self, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        let hd = q.len();
        let (l, off) = (self.layer, self.kv_off);
        let (bs, kvd) = (self.kv.block_size(), self.kv.kv_dim());
        let n = self.pos + 1;
        scores.clear();
        scores.resize(n, 0.0);
        let mut max = f32::NEG_INFINITY;
        // Position p is row p % bs of block table[p / bs]; a block's K rows
        // (then its V rows) are contiguous, so walk block by block.
        for (chunk, b) in scores.chunks_mut(bs).zip(self.table) {
            let rows = self.kv.block_rows(l, b.0 as usize);
            for (r, s) in chunk.iter_mut().enumerate() {
                let k = &rows[r * kvd + off..r * kvd + off + hd];
                let v = f32ops::dot_generic(q, k) * self.scale;
                max = max.max(v);
                *s = v;
            }
        }
        let inv = 1.0 / f32ops::softmax_exp_generic(scores, max);
        out.fill(0.0);
        for (chunk, b) in scores.chunks(bs).zip(self.table) {
            let rows = &self.kv.block_rows(l, b.0 as usize)[bs * kvd..];
            for (r, s) in chunk.iter().enumerate() {
                f32ops::axpy_generic(s * inv, &rows[r * kvd + off..r * kvd + off + hd], out);
            }
        }
    }
}
