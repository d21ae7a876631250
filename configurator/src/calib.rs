//! Calibration tables: per-operation times measured on a GPU
//! (`calibrate/gpu_ops.py`, stored in `data/calibration/*.json`), turned
//! into *efficiencies* that carry over to other GPUs of the catalog.
//!
//! For every measured operation the efficiency is its roofline time on the
//! GPU it was measured on (the larger of FLOPs over the dense peak and
//! bytes over HBM bandwidth) divided by the measured time. Predicting an
//! operation on any GPU is then its roofline time there over the
//! interpolated efficiency. So small GEMMs keep their launch- and
//! latency-bound inefficiency, large ones their tensor-core efficiency, and
//! a faster memory or tensor core shows up through the roofline.
//!
//! Invariants: efficiencies are in (0, 1]; interpolation is linear in the
//! logarithm of the work and clamps outside the measured range (no
//! extrapolated gains); a table with no entry for an operation is an error
//! at load time, not a silent default.

use crate::comm::Nccl;
use crate::memory::Dtype;
use crate::spec::Gpu;
use serde::Deserialize;
use thiserror::Error;

/// The H200 tables measured for this crate (2026-11-29, torch 2.11, CUDA 13).
pub const H200_JSON: &str = include_str!("../data/calibration/h200.json");

#[derive(Debug, Error, PartialEq)]
pub enum CalibError {
    #[error("calibration file is not valid: {0}")]
    Parse(String),
    #[error("calibration has no {0} measurements")]
    Missing(&'static str),
    #[error("calibration entry {field} = {value} must be positive")]
    NotPositive { field: &'static str, value: f64 },
}

#[derive(Deserialize)]
struct Raw {
    gpu: String,
    date: String,
    copy_gbps: f64,
    graph_kernel_us: f64,
    gemm: Vec<RawGemm>,
    attn_decode: Vec<RawDecode>,
    attn_prefill: Vec<RawPrefill>,
}

#[derive(Deserialize)]
struct RawGemm {
    dtype: String,
    m: u64,
    n: u64,
    k: u64,
    us: f64,
}

#[derive(Deserialize)]
struct RawDecode {
    batch: u64,
    kv_heads: u64,
    ctx: u64,
    head_dim: u64,
    us: f64,
}

#[derive(Deserialize)]
struct RawPrefill {
    len: u64,
    q_heads: u64,
    head_dim: u64,
    us: f64,
}

/// Efficiency as a piecewise-linear function of log(x).
#[derive(Clone, Debug, PartialEq)]
pub struct Curve(Vec<(f64, f64)>);

impl Curve {
    fn new(mut points: Vec<(f64, f64)>) -> Self {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Average repeated x (e.g. the same bytes read at different shapes).
        let mut out: Vec<(f64, f64, u32)> = Vec::new();
        for (x, y) in points {
            let lx = x.ln();
            match out.last_mut() {
                Some(last) if (last.0 - lx).abs() < 1e-9 => {
                    last.1 += y;
                    last.2 += 1;
                }
                _ => out.push((lx, y, 1)),
            }
        }
        Curve(
            out.into_iter()
                .map(|(x, y, n)| (x, (y / n as f64).clamp(1e-4, 1.0)))
                .collect(),
        )
    }

    /// Efficiency at `x` (clamped to the measured range).
    pub fn at(&self, x: f64) -> f64 {
        let lx = x.max(f64::MIN_POSITIVE).ln();
        let p = &self.0;
        if lx <= p[0].0 {
            return p[0].1;
        }
        let last = p[p.len() - 1];
        if lx >= last.0 {
            return last.1;
        }
        let i = p.partition_point(|q| q.0 <= lx);
        let (a, b) = (p[i - 1], p[i]);
        a.1 + (b.1 - a.1) * (lx - a.0) / (b.0 - a.0)
    }
}

/// The GEMM efficiency curves (over M, the tokens) of one measured weight shape.
#[derive(Clone, Debug)]
struct GemmShape {
    dtype: Dtype,
    n: f64,
    k: f64,
    /// ln(n·k) and ln(n/k), for the nearest-shape lookup.
    ln_size: f64,
    ln_aspect: f64,
    over_m: Curve,
}

/// Efficiencies of one GPU's measured operations.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The GPU measured and the date, for reports.
    pub source: String,
    shapes: Vec<GemmShape>,
    /// Decode attention, over the KV bytes read by one call.
    decode: Curve,
    /// Causal prefill attention, over its FLOPs.
    prefill: Curve,
    /// Device copy bandwidth measured (read + write), as a share of HBM peak.
    pub copy_efficiency: f64,
    /// One small kernel inside a CUDA graph, µs (launch-bound work).
    pub kernel_us: f64,
    /// Measured collective times (`data/nccl.toml`).
    pub nccl: Nccl,
}

/// Roofline time in µs: FLOPs at the dtype's dense peak or bytes at HBM bandwidth.
pub fn roofline_us(gpu: &Gpu, flops: f64, bytes: f64, dtype: Dtype) -> f64 {
    let peak = match dtype.compute() {
        Dtype::Bf16 => gpu.bf16_tflops,
        _ => gpu.fp8_tflops,
    } * 1e12;
    (flops / peak).max(bytes / (gpu.hbm_tbps * 1e12)) * 1e6
}

/// FLOPs and bytes of an `m × k` by `k × n` product (bf16 output).
pub fn gemm_work(m: f64, n: f64, k: f64, dtype: Dtype) -> (f64, f64) {
    let b = dtype.bytes();
    (2.0 * m * n * k, (m * k + n * k) * b + m * n * 2.0)
}

/// FLOPs of causal attention over `len` new tokens after `past` cached ones.
pub fn prefill_attention_flops(len: f64, past: f64, q_heads: f64, head_dim: f64) -> f64 {
    // QKᵀ and PV, 2 FLOPs per multiply-add each, over the causal triangle.
    4.0 * len * (past + len / 2.0) * head_dim * q_heads
}

impl Calibration {
    /// Parses measured tables taken on `measured_on`.
    pub fn parse(json: &str, measured_on: &Gpu) -> Result<Self, CalibError> {
        let raw: Raw = serde_json::from_str(json).map_err(|e| CalibError::Parse(e.to_string()))?;
        for (field, v) in [
            ("copy_gbps", raw.copy_gbps),
            ("graph_kernel_us", raw.graph_kernel_us),
        ] {
            if v.is_nan() || v <= 0.0 {
                return Err(CalibError::NotPositive { field, value: v });
            }
        }
        let mut shapes: Vec<GemmShape> = Vec::new();
        for g in &raw.gemm {
            if g.us.is_nan() || g.us <= 0.0 {
                return Err(CalibError::NotPositive {
                    field: "gemm.us",
                    value: g.us,
                });
            }
            let dtype = match g.dtype.as_str() {
                "bf16" => Dtype::Bf16,
                "fp8" => Dtype::Fp8,
                other => return Err(CalibError::Parse(format!("unknown gemm dtype {other:?}"))),
            };
            let (n, k) = (g.n as f64, g.k as f64);
            let (flops, bytes) = gemm_work(g.m as f64, n, k, dtype);
            let eff = roofline_us(measured_on, flops, bytes, dtype) / g.us;
            match shapes
                .iter_mut()
                .find(|s| s.dtype == dtype && s.n == n && s.k == k)
            {
                Some(s) => s.over_m.0.push((g.m as f64, eff)),
                None => shapes.push(GemmShape {
                    dtype,
                    n,
                    k,
                    ln_size: (n * k).ln(),
                    ln_aspect: (n / k).ln(),
                    over_m: Curve(vec![(g.m as f64, eff)]),
                }),
            }
        }
        for s in &mut shapes {
            s.over_m = Curve::new(std::mem::take(&mut s.over_m.0));
        }
        for dtype in [Dtype::Bf16, Dtype::Fp8] {
            if !shapes.iter().any(|s| s.dtype == dtype) {
                return Err(CalibError::Missing(match dtype {
                    Dtype::Bf16 => "bf16 gemm",
                    _ => "fp8 gemm",
                }));
            }
        }
        if raw.attn_decode.is_empty() {
            return Err(CalibError::Missing("decode attention"));
        }
        if raw.attn_prefill.is_empty() {
            return Err(CalibError::Missing("prefill attention"));
        }
        let decode = Curve::new(
            raw.attn_decode
                .iter()
                .map(|a| {
                    let bytes = (2 * a.batch * a.kv_heads * a.ctx * a.head_dim * 2) as f64;
                    (
                        bytes,
                        roofline_us(measured_on, 0.0, bytes, Dtype::Bf16) / a.us,
                    )
                })
                .collect(),
        );
        let prefill = Curve::new(
            raw.attn_prefill
                .iter()
                .map(|a| {
                    let flops = prefill_attention_flops(
                        a.len as f64,
                        0.0,
                        a.q_heads as f64,
                        a.head_dim as f64,
                    );
                    (
                        flops,
                        roofline_us(measured_on, flops, 0.0, Dtype::Bf16) / a.us,
                    )
                })
                .collect(),
        );
        Ok(Calibration {
            source: format!("{} ({})", raw.gpu, raw.date),
            shapes,
            decode,
            prefill,
            copy_efficiency: (raw.copy_gbps / 1e3 / measured_on.hbm_tbps).min(1.0),
            kernel_us: raw.graph_kernel_us,
            nccl: Nccl::builtin().map_err(CalibError::Parse)?,
        })
    }

    /// Time of an `m × k` by `k × n` GEMM on `gpu`, µs: the measured shape
    /// nearest in size and aspect gives the efficiency at `m`.
    pub fn gemm_us(&self, gpu: &Gpu, m: f64, n: f64, k: f64, dtype: Dtype) -> f64 {
        let (ln_size, ln_aspect) = ((n * k).ln(), (n / k).ln());
        let near = |s: &GemmShape| {
            let size = s.ln_size - ln_size;
            let aspect = s.ln_aspect - ln_aspect;
            size * size + 0.25 * aspect * aspect
        };
        let shape = self
            .shapes
            .iter()
            .filter(|s| s.dtype == dtype.compute())
            .min_by(|a, b| near(a).total_cmp(&near(b)))
            .expect("parse checked each dtype has shapes");
        let (flops, bytes) = gemm_work(m, n, k, dtype);
        roofline_us(gpu, flops, bytes, dtype) / shape.over_m.at(m)
    }

    /// Decode attention reading `kv_bytes` of KV in one call, µs.
    pub fn decode_attention_us(&self, gpu: &Gpu, kv_bytes: f64) -> f64 {
        roofline_us(gpu, 0.0, kv_bytes, Dtype::Bf16) / self.decode.at(kv_bytes)
    }

    /// Causal prefill attention of `flops` FLOPs, µs.
    pub fn prefill_attention_us(&self, gpu: &Gpu, flops: f64) -> f64 {
        roofline_us(gpu, flops, 0.0, Dtype::Bf16) / self.prefill.at(flops)
    }

    /// Memory-bound elementwise work moving `bytes`, µs.
    pub fn stream_us(&self, gpu: &Gpu, bytes: f64) -> f64 {
        roofline_us(gpu, 0.0, bytes, Dtype::Bf16) / self.copy_efficiency
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Catalog;

    fn h200() -> (Catalog, Calibration) {
        let c = Catalog::builtin().unwrap();
        let cal = Calibration::parse(H200_JSON, c.gpu("H200").unwrap()).unwrap();
        (c, cal)
    }

    #[test]
    fn measured_points_come_back_on_the_gpu_they_were_measured_on() {
        let (c, cal) = h200();
        let g = c.gpu("H200").unwrap();
        // From the table: bf16 1024×28672×4096 took 346.6 µs, fp8 41.5 µs at m = 1.
        let t = cal.gemm_us(g, 1024.0, 28672.0, 4096.0, Dtype::Bf16);
        assert!((t - 346.6).abs() / 346.6 < 0.01, "{t}");
        let t = cal.gemm_us(g, 1.0, 28672.0, 4096.0, Dtype::Fp8);
        assert!((t - 41.5).abs() / 41.5 < 0.01, "{t}");
        // Between measured m, time is monotone.
        let a = cal.gemm_us(g, 700.0, 28672.0, 4096.0, Dtype::Bf16);
        let b = cal.gemm_us(g, 900.0, 28672.0, 4096.0, Dtype::Bf16);
        assert!(a < b && b < 346.6, "{a} {b}");
    }

    #[test]
    fn other_gpus_follow_their_roofline() {
        let (c, cal) = h200();
        let (h100, h200, a100) = (
            c.gpu("H100").unwrap(),
            c.gpu("H200").unwrap(),
            c.gpu("A100").unwrap(),
        );
        // Decode-sized GEMMs are bandwidth-bound: H100 slower by 4.8 / 3.35.
        let small = |g| cal.gemm_us(g, 8.0, 8192.0, 8192.0, Dtype::Bf16);
        assert!((small(h100) / small(h200) - 4.8 / 3.35).abs() < 0.01);
        // Large ones are compute-bound: same tensor cores, same time; A100 slower.
        let big = |g| cal.gemm_us(g, 8192.0, 8192.0, 8192.0, Dtype::Bf16);
        assert!((big(h100) / big(h200) - 1.0).abs() < 0.01);
        assert!(big(a100) > 3.0 * big(h200));
        // Decode attention scales with bandwidth, and more bytes cost more time.
        let d = cal.decode_attention_us(h200, 64e6);
        assert!(d > cal.decode_attention_us(h200, 8e6));
        assert!((cal.decode_attention_us(h100, 64e6) / d - 4.8 / 3.35).abs() < 0.01);
    }

    #[test]
    fn curves_clamp_outside_the_measured_range() {
        let c = Curve::new(vec![(1.0, 0.1), (100.0, 0.5), (100.0, 0.7)]);
        assert_eq!(c.at(0.01), 0.1);
        assert_eq!(c.at(1e9), 0.6);
        assert!((c.at(10.0) - 0.35).abs() < 1e-9);
    }

    #[test]
    fn broken_tables_are_errors() {
        let c = Catalog::builtin().unwrap();
        let g = c.gpu("H200").unwrap();
        assert!(matches!(
            Calibration::parse("{", g),
            Err(CalibError::Parse(_))
        ));
        let empty = r#"{"gpu":"x","date":"d","copy_gbps":1,"graph_kernel_us":1,
            "gemm":[],"attn_decode":[],"attn_prefill":[]}"#;
        assert_eq!(
            Calibration::parse(empty, g).unwrap_err(),
            CalibError::Missing("bf16 gemm")
        );
    }
}
