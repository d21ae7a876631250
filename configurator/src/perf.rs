//! Time of one forward step of a replica, from its operations: the GEMMs
//! of every layer (dense MLP, or routed experts as one grouped GEMM, split
//! by TP or held whole under expert parallelism), attention (prefill
//! FLOPs, decode KV reads), the TP all-reduces (or the experts'
//! all-to-all), the PP hops, elementwise work and per-kernel overhead. Each operation's time is its roofline time over an
//! efficiency from the calibration tables ([`crate::calib`]); what the
//! tables cannot see (kernel count, all-reduce latency, per-step framework
//! cost, whether decode attention shares KV reads across a GQA group) is an
//! [`EngineProfile`].
//!
//! Conventions: times are µs; one step runs `decode` sequences one token
//! each and `prefill` tokens of new prompts together (chunked prefill mixes
//! them); with PP the batch is split into `pp` micro-batches that flow
//! through the stages, so a token's latency is `pp` stage times plus the
//! hops, and the replica finishes a whole batch in that time.

use crate::calib::{prefill_attention_flops, Calibration};
pub use crate::engines::EngineProfile;
use crate::memory::Deployment;
use crate::spec::{Gpu, Model};

/// What one step computes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Step {
    /// Sequences generating one token each.
    pub decode: f64,
    /// Mean tokens of context each decoding sequence attends to.
    pub decode_ctx: f64,
    /// New prompt tokens computed in this step, over `prefill_seqs` prompts.
    pub prefill: f64,
    pub prefill_seqs: f64,
    /// Tokens already cached before each prompt's new tokens.
    pub prefill_past: f64,
}

/// Where the time of one step goes, µs (whole step, all stages).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    pub gemm: f64,
    pub attention: f64,
    pub comm: f64,
    pub other: f64,
}

impl StepTime {
    pub fn total(&self) -> f64 {
        self.gemm + self.attention + self.comm + self.other
    }
    fn add(&mut self, o: StepTime, times: f64) {
        self.gemm += o.gemm * times;
        self.attention += o.attention * times;
        self.comm += o.comm * times;
        self.other += o.other * times;
    }
}

/// A replica of `model` on `gpu` laid out as `deployment`.
pub struct StepModel<'a> {
    pub model: &'a Model,
    pub gpu: &'a Gpu,
    pub deployment: Deployment,
    pub calib: &'a Calibration,
    pub profile: EngineProfile,
}

impl StepModel<'_> {
    /// A GEMM over weights that are not routed experts.
    fn gemm(&self, m: f64, n: f64, k: f64) -> f64 {
        self.gemm_of(m, n, k, self.deployment.weights.dense())
    }

    fn gemm_of(&self, m: f64, n: f64, k: f64, dtype: crate::memory::Dtype) -> f64 {
        if m <= 0.0 {
            return 0.0;
        }
        // The bandwidth-bound regime may scale apart from the compute-bound
        // one (engines' decode-sized kernels stream weights unlike the
        // calibration's): by `gemm_bw_ratio`, blended by how close to each
        // bound the GEMM is.
        let ratio = self.profile.gemm_bw_ratio;
        let scale = if ratio == 1.0 {
            // Both regimes alike (every profile that does not fit it): the
            // search's hot path skips the blend.
            self.profile.gemm_scale
        } else {
            let (flops, bytes) = crate::calib::gemm_work(m, n, k, dtype);
            let compute = crate::calib::roofline_us(self.gpu, flops, 0.0, dtype);
            let stream = crate::calib::roofline_us(self.gpu, 0.0, bytes, dtype);
            self.profile.gemm_scale * ratio.powf(stream / (compute + stream))
        };
        self.calib.gemm_us(self.gpu, m, n, k, dtype) * scale
    }

    /// One collective's synchronisation on top of its transfer time.
    fn collective(&self, transfer_us: f64) -> f64 {
        transfer_us + self.profile.sync_us
    }

    /// An all-reduce of `bytes` across the TP group, µs.
    fn allreduce(&self, bytes: f64) -> f64 {
        let ranks = self.deployment.tp;
        self.collective(self.calib.nccl.allreduce_us(
            self.gpu,
            ranks,
            bytes,
            self.profile.allreduce_us,
        ))
    }

    /// The experts' all-to-all out and back for `tokens` tokens of this
    /// GPU across an expert-parallel group of `ranks` GPUs, µs. Each token
    /// goes to `active` experts spread evenly over the group: copies for
    /// the other GPUs of its 8-GPU node go over NVLink; a token goes once
    /// to each other node holding any of its experts (and is forwarded
    /// there), over the GPU's network link. The dispatch moves the GEMM
    /// input type (FP8 with FP8 weights), the combine BF16. The slower
    /// link bounds each direction.
    fn moe_all_to_all(&self, ranks: u32, tokens: f64, active: f64) -> f64 {
        const NODE: u32 = 8;
        if ranks <= 1 || tokens <= 0.0 {
            return 0.0;
        }
        let r = ranks as f64;
        let per_node = ranks.min(NODE) as f64;
        let nodes = (r / per_node).ceil();
        // Copies per token to other GPUs of this node, and to other nodes.
        let inside = active * (per_node - 1.0) / r;
        let remote_nodes = (nodes - 1.0) * (1.0 - (1.0 - 1.0 / nodes).powf(active));
        let hidden = self.model.hidden as f64;
        let dispatch = self.deployment.weights.compute().bytes().min(2.0);
        let mut t = 0.0;
        for bytes_per in [dispatch, 2.0] {
            let row = tokens * hidden * bytes_per;
            let nv = row * inside / (self.gpu.link_gbps * 1e9);
            let net = row * remote_nodes / (self.gpu.net_gbps * 1e9);
            t += self.collective(self.profile.allreduce_us + nv.max(net) * 1e6);
        }
        t
    }

    /// One transformer layer on one GPU for `s` (a micro-batch).
    fn layer(&self, s: &Step, moe_layer: bool) -> StepTime {
        let m = self.model;
        let d = &self.deployment;
        let tp = d.tp as f64;
        let dpa = d.dp_attention;
        let tokens = s.decode + s.prefill;
        let hidden = m.hidden as f64;
        let hd = m.head_dim as f64;
        // Data-parallel attention: each GPU runs every head for its own
        // 1/tp of the sequences; tensor parallelism: 1/tp of the heads for
        // all of them.
        let (share, q_heads, kv_heads) = if dpa {
            (1.0 / tp, m.heads as f64, m.kv_heads as f64)
        } else {
            (
                1.0,
                m.heads as f64 / tp,
                ((m.kv_heads / d.tp).max(1)) as f64,
            )
        };
        let own = tokens * share;
        let mut t = StepTime::default();

        // Attention projections.
        t.gemm += match &m.mla {
            None => {
                self.gemm(own, (q_heads + 2.0 * kv_heads) * hd, hidden)
                    + self.gemm(own, hidden, q_heads * hd)
            }
            Some(mla) => {
                let (ql, kl, rope, nope, v) = (
                    mla.q_lora as f64,
                    mla.kv_lora as f64,
                    mla.rope_dim as f64,
                    mla.nope_dim as f64,
                    mla.v_dim as f64,
                );
                self.gemm(own, ql + kl + rope, hidden)
                    + self.gemm(own, q_heads * (nope + rope), ql)
                    + self.gemm(own, q_heads * (nope + v), kl)
                    + self.gemm(own, hidden, q_heads * v)
            }
        };

        // Attention itself.
        let kv_elems = m.kv_elements_per_token_layer() as f64
            * match m.mla {
                Some(_) => 1.0,
                None => kv_heads / m.kv_heads as f64,
            };
        let mut attention = 0.0;
        if s.decode > 0.0 {
            let group = if self.profile.gqa_shared_reads || m.mla.is_some() {
                1.0
            } else {
                q_heads / kv_heads
            };
            let bytes = s.decode * share * s.decode_ctx * kv_elems * d.kv.bytes() * group;
            let read = self.calib.decode_attention_us(self.gpu, bytes);
            // The dot products, where the engine's kernel runs them on
            // CUDA cores (QKᵀ and PV: 4 FLOPs per query head, head
            // dimension and context token).
            let arithmetic = if m.mla.is_none() {
                s.decode * share * s.decode_ctx * q_heads * hd * 4.0 / (self.gpu.fp32_tflops * 1e12)
                    * 1e6
                    * self.profile.decode_attention_fp32
            } else {
                0.0
            };
            attention += read.max(arithmetic);
        }
        if s.prefill > 0.0 {
            // Prompts may be fractional (an average step of a long run).
            let seqs = if s.prefill_seqs > 0.0 {
                s.prefill_seqs
            } else {
                1.0
            };
            // MLA's prefill runs each head's QKᵀ over its nope and rope
            // dimensions and PV over its value dimension.
            let dims = match &m.mla {
                Some(mla) => (mla.nope_dim + mla.rope_dim + mla.v_dim) as f64 / 2.0,
                None => hd,
            };
            let flops = prefill_attention_flops(s.prefill / seqs, s.prefill_past, q_heads, dims)
                * seqs
                * share;
            attention += self.calib.prefill_attention_us(self.gpu, flops);
        }
        t.attention += attention * self.profile.attention_scale;

        // MLP: dense, or routed experts plus shared ones. Under TP every GPU
        // holds a 1/tp slice of every expert and sees every assignment;
        // under expert parallelism (and data-parallel attention) it holds
        // 1/tp of the experts whole and sees 1/tp of the assignments (on
        // average).
        let mut comm = 0.0;
        match (&m.moe, moe_layer) {
            (Some(moe), true) => {
                let ep = dpa || (d.expert_parallel && d.tp > 1 && moe.experts.is_multiple_of(d.tp));
                let (local_experts, ef, assigned) = if ep {
                    (
                        moe.experts as f64 / tp,
                        moe.expert_ffn as f64,
                        tokens * moe.active as f64 / tp,
                    )
                } else {
                    (
                        moe.experts as f64,
                        moe.expert_ffn as f64 / tp,
                        tokens * moe.active as f64,
                    )
                };
                let touched = local_experts.min(assigned.ceil()).max(1.0);
                let per_expert = assigned / touched;
                t.gemm += self.gemm(own, moe.experts as f64, hidden);
                // The touched experts run as one grouped GEMM (as MoE kernels
                // do): the weights streamed once per expert, one launch, so
                // the work of a GEMM `touched` times as wide.
                let w = d.weights;
                t.gemm += (self.gemm_of(per_expert, 2.0 * ef * touched, hidden, w)
                    + self.gemm_of(per_expert, hidden * touched, ef, w))
                    * self.profile.moe_scale;
                let shared = moe.shared as f64 * moe.expert_ffn as f64 / if dpa { 1.0 } else { tp };
                if shared > 0.0 {
                    t.gemm += self.gemm(own, 2.0 * shared, hidden) + self.gemm(own, hidden, shared);
                }
                if ep && d.tp > 1 {
                    // Each GPU sends its own tokens' activations to the
                    // experts' GPUs and takes the results back (under TP
                    // attention, each GPU routes its 1/tp share).
                    let routed = if dpa { own } else { tokens / tp };
                    comm += self.moe_all_to_all(d.tp, routed, moe.active as f64);
                    if !dpa {
                        // The attention's all-reduce.
                        comm += self.allreduce(tokens * hidden * 2.0);
                    }
                } else if d.tp > 1 {
                    comm += 2.0 * self.allreduce(tokens * hidden * 2.0);
                }
            }
            _ => {
                let ffn = m.ffn as f64 / if dpa { 1.0 } else { tp };
                t.gemm += self.gemm(own, 2.0 * ffn, hidden) + self.gemm(own, hidden, ffn);
                if d.tp > 1 && !dpa {
                    // After attention and after the MLP.
                    comm += 2.0 * self.allreduce(tokens * hidden * 2.0);
                }
            }
        }
        t.comm += comm;

        // Elementwise passes over the activations (two norms, rotary,
        // residuals, the gated activation) and their launches.
        let ffn_share = m.ffn as f64 / if dpa { 1.0 } else { tp };
        let act_bytes = own * (hidden * 2.0 * 8.0 + ffn_share * 2.0 * 3.0);
        t.other += self.calib.stream_us(self.gpu, act_bytes)
            + self.profile.kernels_per_layer * self.profile.kernel_us;
        t
    }

    /// Time of one step, µs, broken down.
    pub fn step(&self, s: &Step) -> StepTime {
        let m = self.model;
        let d = &self.deployment;
        let pp = d.pp as f64;
        // Each stage sees one micro-batch at a time; a step is `pp` micro-batches
        // through `pp` stages of `layers / pp` layers: pp × (layers / pp) layer-times
        // of a micro-batch, i.e. all layers once for a micro-batch of `s / pp`.
        let micro = Step {
            decode: s.decode / pp,
            prefill: s.prefill / pp,
            prefill_seqs: s.prefill_seqs / pp,
            ..*s
        };
        let mut t = StepTime::default();
        let moe_layers = m.moe.as_ref().map_or(0, |x| m.layers - x.dense_layers);
        let dense_layers = m.layers - moe_layers;
        t.add(self.layer(&micro, false), dense_layers as f64);
        if moe_layers > 0 {
            t.add(self.layer(&micro, true), moe_layers as f64);
        }
        // Stage hand-offs of the micro-batch's activations.
        if d.pp > 1 {
            let bytes = (micro.decode + micro.prefill) * m.hidden as f64 * 2.0;
            t.comm += (pp - 1.0)
                * self.collective(
                    self.profile.allreduce_us + bytes / (self.gpu.link_gbps * 1e9) * 1e6,
                );
        }
        // LM head on the last stage: one row per decoding sequence and per
        // prompt, the vocabulary split across TP (or each data-parallel
        // rank its own rows over the whole vocabulary: the same work).
        let rows = micro.decode + micro.prefill_seqs;
        t.gemm += if d.dp_attention {
            self.gemm(rows / d.tp as f64, m.vocab as f64, m.hidden as f64)
        } else {
            self.gemm(rows, m.vocab as f64 / d.tp as f64, m.hidden as f64)
        };
        t.other += self.profile.step_us + self.profile.seq_us * (s.decode + s.prefill_seqs);
        if d.overlap {
            // Two micro-batches in turn: one's communication runs under
            // the other's compute. The first dispatch and the last combine
            // have nothing to hide under, so at best half of the shorter
            // of the two is hidden.
            let compute = t.gemm + t.attention + t.other;
            t.comm -= compute.min(t.comm) / 2.0;
        }
        if d.tp > 1 {
            // Every collective waits for the slowest rank of the group;
            // waiting is not hidden by overlap.
            let straggle = (2.0 * (d.tp as f64).ln()).sqrt() * self.profile.skew;
            t.comm += straggle * (t.gemm + t.attention);
        }
        t
    }

    /// Prefill of `seqs` prompts of `len` tokens together, µs.
    pub fn prefill_us(&self, seqs: f64, len: f64) -> f64 {
        self.step(&Step {
            prefill: seqs * len,
            prefill_seqs: seqs,
            ..Step::default()
        })
        .total()
    }

    /// One decode step of `batch` sequences at context `ctx`, µs.
    pub fn decode_us(&self, batch: f64, ctx: f64) -> f64 {
        self.step(&Step {
            decode: batch,
            decode_ctx: ctx,
            ..Step::default()
        })
        .total()
    }

    /// Output tokens/s of a static batch: `batch` prompts of `isl` tokens
    /// prefilled together, then `osl` decode steps (how TensorRT-LLM's
    /// session benchmark measures).
    pub fn static_batch_tokens_per_s(&self, batch: f64, isl: f64, osl: f64) -> f64 {
        let mut total = self.prefill_us(batch, isl);
        // Decode cost is affine in the context; 8 midpoints cover the curve.
        const PARTS: usize = 8;
        for j in 0..PARTS {
            let ctx = isl + (j as f64 + 0.5) * osl / PARTS as f64;
            total += self.decode_us(batch, ctx) * osl / PARTS as f64;
        }
        batch * osl / (total * 1e-6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::H200_JSON;
    use crate::memory::Dtype;
    use crate::Catalog;

    fn with_model<R>(
        model: &str,
        gpu: &str,
        tp: u32,
        pp: u32,
        f: impl FnOnce(&StepModel) -> R,
    ) -> R {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let sm = StepModel {
            model: c.model(model).unwrap(),
            gpu: c.gpu(gpu).unwrap(),
            deployment: Deployment {
                tp,
                pp,
                weights: Dtype::Fp8,
                kv: Dtype::Bf16,
                memory: crate::memory::MemoryPolicy::DEFAULT,
                expert_parallel: false,
                dp_attention: false,
                overlap: false,
            },
            profile: EngineProfile::current(&cal),
            calib: &cal,
        };
        f(&sm)
    }

    #[test]
    fn decode_is_bounded_below_by_reading_the_weights() {
        with_model("Llama-3.1-70B", "H200", 4, 1, |sm| {
            let t = sm.decode_us(1.0, 1000.0);
            // 70.6 GB of fp8 weights over 4 GPUs at 4.8 TB/s: 3.7 ms.
            assert!(t > 3_700.0, "{t}");
            assert!(t < 3.0 * 3_700.0, "{t}");
            // More sequences and longer contexts cost more, never less.
            assert!(sm.decode_us(64.0, 1000.0) > t);
            assert!(sm.decode_us(64.0, 8000.0) > sm.decode_us(64.0, 1000.0));
        });
    }

    #[test]
    fn prefill_is_compute_bound_and_scales_with_tokens() {
        with_model("Llama-3.1-8B", "H100", 1, 1, |sm| {
            let t = sm.prefill_us(1.0, 8192.0);
            // 2 × 8B × 8192 tokens of fp8 at 1979 TFLOP/s: 66 ms at peak.
            assert!(t > 66_000.0, "{t}");
            assert!(t < 3.0 * 66_000.0, "{t}");
            let half = sm.prefill_us(1.0, 4096.0);
            assert!(half < 0.6 * t && half > 0.4 * t, "{half} vs {t}");
        });
    }

    #[test]
    fn tensor_parallelism_cuts_latency_but_adds_communication() {
        let one = with_model("Llama-3.1-70B", "H200", 2, 1, |sm| {
            sm.step(&Step {
                decode: 32.0,
                decode_ctx: 2000.0,
                ..Step::default()
            })
        });
        let eight = with_model("Llama-3.1-70B", "H200", 8, 1, |sm| {
            sm.step(&Step {
                decode: 32.0,
                decode_ctx: 2000.0,
                ..Step::default()
            })
        });
        assert!(eight.total() < one.total());
        assert!(eight.comm > one.comm);
        assert!(eight.gemm < one.gemm / 2.0);
    }

    #[test]
    fn pipeline_stages_do_not_cut_latency_as_tensor_parallelism_does() {
        let s = Step {
            decode: 64.0,
            decode_ctx: 1000.0,
            ..Step::default()
        };
        let tp4 = with_model("Llama-3.1-70B", "H200", 4, 1, |sm| sm.step(&s).total());
        let tp4pp2 = with_model("Llama-3.1-70B", "H200", 4, 2, |sm| sm.step(&s).total());
        let tp8 = with_model("Llama-3.1-70B", "H200", 8, 1, |sm| sm.step(&s).total());
        // A token still passes every layer: twice the GPUs through PP leave
        // the step about as long (smaller micro-batches, one hop more),
        // while the same GPUs through TP shorten it.
        assert!(
            tp4pp2 > 0.8 * tp4 && tp4pp2 < 1.1 * tp4,
            "{tp4pp2} vs {tp4}"
        );
        assert!(tp8 < tp4pp2, "{tp8} vs {tp4pp2}");
    }

    #[test]
    fn expert_parallelism_trades_gemm_time_for_an_all_to_all() {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        let tp8 = |model: &str, ep: bool| StepModel {
            model: c.model(model).unwrap(),
            gpu: c.gpu("H200").unwrap(),
            deployment: Deployment {
                tp: 8,
                pp: 1,
                weights: Dtype::Fp8,
                kv: Dtype::Fp8,
                memory: crate::memory::MemoryPolicy::DEFAULT,
                expert_parallel: ep,
                dp_attention: false,
                overlap: false,
            },
            profile: EngineProfile::current(&cal),
            calib: &cal,
        };
        let step = |ep: bool| {
            tp8("DeepSeek-V3", ep).step(&Step {
                decode: 512.0,
                decode_ctx: 2000.0,
                ..Step::default()
            })
        };
        // Whole experts run as GEMMs of a better shape than 1/8 slices of
        // each; the MLP's all-reduce becomes an all-to-all out and back
        // (FP8 out, BF16 back), so the wire time changes.
        let (tp, ep) = (step(false), step(true));
        assert!(ep.gemm < tp.gemm, "{ep:?} vs {tp:?}");
        assert!(ep.comm != tp.comm, "{ep:?} vs {tp:?}");
        // A dense model ignores the flag.
        let dense = |ep: bool| tp8("Llama-3.1-70B", ep).decode_us(64.0, 1000.0);
        assert_eq!(dense(true), dense(false));

        // Data-parallel attention: a group across nodes sends most of its
        // tokens over the network, so its all-to-all costs more per token
        // than one within a node; overlap hides part of it.
        let dep = |g: u32, overlap: bool| {
            StepModel {
                deployment: Deployment {
                    tp: g,
                    dp_attention: true,
                    overlap,
                    ..tp8("DeepSeek-V3", true).deployment
                },
                ..tp8("DeepSeek-V3", true)
            }
            .step(&Step {
                decode: 64.0 * g as f64,
                decode_ctx: 2000.0,
                ..Step::default()
            })
        };
        let (in_node, across) = (dep(8, false), dep(32, false));
        assert!(
            across.comm > 2.0 * in_node.comm,
            "{across:?} vs {in_node:?}"
        );
        let hidden = dep(32, true);
        assert!(hidden.comm < across.comm && hidden.comm > 0.0, "{hidden:?}");
        assert_eq!(hidden.gemm, across.gemm);
    }

    #[test]
    fn moe_reads_only_the_experts_it_touches() {
        with_model("DeepSeek-V3", "H200", 8, 1, |sm| {
            let one = sm.decode_us(1.0, 1000.0);
            let many = sm.decode_us(256.0, 1000.0);
            // One token touches 8 of 256 experts per layer; 256 tokens touch
            // nearly all, so the step reads far more weights.
            assert!(many > 3.0 * one, "{many} vs {one}");
        });
    }

    /// `sm` with its profile edited by `edit`.
    fn with_profile<'a>(
        sm: &StepModel<'a>,
        edit: impl FnOnce(&mut EngineProfile),
    ) -> StepModel<'a> {
        let mut profile = sm.profile.clone();
        edit(&mut profile);
        StepModel { profile, ..*sm }
    }

    #[test]
    fn decode_attention_takes_the_longer_of_its_read_and_its_arithmetic() {
        // Llama-70B at TP 8: 8 query heads share each GPU's KV head.
        with_model("Llama-3.1-70B", "H100", 8, 1, |sm| {
            let step = Step {
                decode: 1024.0,
                decode_ctx: 1000.0,
                ..Step::default()
            };
            let read = sm.step(&step).attention;
            let bound = with_profile(sm, |p| p.decode_attention_fp32 = 4.0);
            let t = bound.step(&step).attention;
            // 4 FLOPs per query head, head dimension and context token, at
            // a quarter of the 67 TFLOP/s FP32 peak, over 80 layers.
            let flops = 1024.0 * 1000.0 * 8.0 * 128.0 * 4.0 * 80.0;
            let want = flops / (67e12 / 4.0) * 1e6 * sm.profile.attention_scale;
            assert!(t > read, "{t} vs {read}");
            assert!((t - want).abs() < 1e-6 * want, "{t} vs {want}");
        });
        // MLA's decode kernels run on tensor cores: never bound this way.
        with_model("DeepSeek-V3", "H200", 8, 1, |sm| {
            let step = Step {
                decode: 256.0,
                decode_ctx: 2000.0,
                ..Step::default()
            };
            let read = sm.step(&step).attention;
            let bound = with_profile(sm, |p| p.decode_attention_fp32 = 10.0);
            assert_eq!(bound.step(&step).attention, read);
        });
    }

    #[test]
    fn mla_prefill_attention_counts_its_query_key_and_value_dimensions() {
        with_model("DeepSeek-V3", "H200", 8, 1, |sm| {
            let t = sm
                .step(&Step {
                    prefill: 4096.0,
                    prefill_seqs: 1.0,
                    ..Step::default()
                })
                .attention;
            // 128 heads over 8 GPUs, QKᵀ over 128 + 64 dimensions and PV
            // over 128: a mean of 160 per head, over 61 layers.
            let flops = prefill_attention_flops(4096.0, 0.0, 16.0, 160.0) * 61.0;
            let want = sm.calib.prefill_attention_us(sm.gpu, flops / 61.0) * 61.0;
            assert!((t - want).abs() < 1e-6 * want, "{t} vs {want}");
        });
    }

    #[test]
    fn the_bandwidth_bound_ratio_moves_decode_sized_gemms_most() {
        with_model("Llama-3.1-8B", "H100", 1, 1, |sm| {
            let fast = with_profile(sm, |p| p.gemm_bw_ratio = 0.5);
            let (small, big) = (
                fast.gemm(1.0, 4096.0, 4096.0) / sm.gemm(1.0, 4096.0, 4096.0),
                fast.gemm(8192.0, 4096.0, 4096.0) / sm.gemm(8192.0, 4096.0, 4096.0),
            );
            // A decode-sized GEMM streams its weights: the whole ratio. An
            // 8,192-token one is compute-bound (its stream a fifth of its
            // time): a fifth of the ratio's effect, in log terms.
            assert!((small - 0.5).abs() < 0.01, "{small}");
            assert!(big > 0.85 && big < 0.9, "{big}");
        });
    }
}
