//! The straightforward forward pass the paged one is checked against: one
//! sequence, one token at a time, a contiguous growing K/V cache per layer,
//! scalar kernels and plain loops. Slow on purpose; used by tests only.

use crate::model::Model;
use crate::quant::{dot_q4_1_scalar, dot_q8_0_scalar, quantize_row, ActBlock, QType, QK};
use crate::weights::QMatrix;

pub struct ReferenceRun<'m> {
    model: &'m Model,
    /// `[layer] → positions × kv_dim`
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl<'m> ReferenceRun<'m> {
    pub fn new(model: &'m Model) -> Self {
        let l = model.w.cfg.n_layers;
        ReferenceRun {
            model,
            k: vec![Vec::new(); l],
            v: vec![Vec::new(); l],
        }
    }

    fn matvec(&self, m: &QMatrix, x: &[f32]) -> Vec<f32> {
        let mut a = vec![ActBlock::default(); x.len() / QK];
        quantize_row(x, &mut a);
        (0..m.rows)
            .map(|r| {
                let row = self.model.w.row(m, r);
                match m.qt {
                    QType::Q4_1 => dot_q4_1_scalar(row, &a),
                    QType::Q8_0 => dot_q8_0_scalar(row, &a),
                }
            })
            .collect()
    }

    fn norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let mut ms = 0.0;
        for v in x {
            ms += v * v;
        }
        let s = 1.0 / (ms / x.len() as f32 + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * s * w).collect()
    }

    /// Feeds the next token; returns the logits after it.
    pub fn push(&mut self, token: u32) -> Vec<f32> {
        let c = self.model.w.cfg.clone();
        let pos = self.k[0].len() / c.kv_dim();
        let hd = c.head_dim;
        let mut x = vec![0f32; c.dim];
        self.model.embed(token, &mut x);
        for (l, lw) in self.model.w.layers.iter().enumerate() {
            let xn = Self::norm(&x, &lw.attn_norm, c.norm_eps);
            let mut q = self.matvec(&lw.wq, &xn);
            let mut k = self.matvec(&lw.wk, &xn);
            let v = self.matvec(&lw.wv, &xn);
            for vec in [&mut q, &mut k] {
                for h in vec.chunks_exact_mut(hd) {
                    for j in 0..hd / 2 {
                        let theta = pos as f32 * c.rope_base.powf(-((2 * j) as f32) / hd as f32);
                        let (s, co) = theta.sin_cos();
                        let (a, b) = (h[2 * j], h[2 * j + 1]);
                        h[2 * j] = a * co - b * s;
                        h[2 * j + 1] = a * s + b * co;
                    }
                }
            }
            self.k[l].extend_from_slice(&k);
            self.v[l].extend_from_slice(&v);
            let mut att = vec![0f32; c.dim];
            let group = c.n_heads / c.n_kv_heads;
            for h in 0..c.n_heads {
                let kvh = h / group;
                let qh = &q[h * hd..(h + 1) * hd];
                let mut w: Vec<f32> = (0..=pos)
                    .map(|p| {
                        let kp = &self.k[l][p * c.kv_dim() + kvh * hd..][..hd];
                        qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let max = w.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = w
                    .iter_mut()
                    .map(|s| {
                        *s = (*s - max).exp();
                        *s
                    })
                    .sum();
                for (p, wp) in w.iter().enumerate() {
                    let vp = &self.v[l][p * c.kv_dim() + kvh * hd..][..hd];
                    for d in 0..hd {
                        att[h * hd + d] += wp / sum * vp[d];
                    }
                }
            }
            let o = self.matvec(&lw.wo, &att);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let xn = Self::norm(&x, &lw.ffn_norm, c.norm_eps);
            let g = self.matvec(&lw.w_gate, &xn);
            let u = self.matvec(&lw.w_up, &xn);
            let hmid: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = self.matvec(&lw.w_down, &hmid);
            for (a, b) in x.iter_mut().zip(&d) {
                *a += b;
            }
        }
        let xn = Self::norm(&x, &self.model.w.out_norm, c.norm_eps);
        self.matvec(&self.model.w.output, &xn)
    }
}
