//! Collective times from measured NCCL tables (`data/nccl.toml`, built in):
//! all-reduce time against message size per GPU type and rank count, as
//! `nccl-tests`' `all_reduce_perf` reports it.
//!
//! A query interpolates the measured times linearly in log(size) and
//! log(time); above the largest size it scales that time with the size
//! (bandwidth bound). The table's smallest time is NCCL's latency floor
//! (about 25–30 µs with NVLink SHARP); engines run small all-reduces with
//! their own one-shot kernels instead, so a query is the engine's latency
//! plus the table's time above its floor. A rank count without a table
//! takes the same GPU's table at the nearest rank count through its bus
//! bandwidth, which `nccl-tests` defines to be independent of the rank
//! count: a time scaled by 2(n−1)/n over the table's 2(m−1)/m. A GPU
//! without any table falls back to a ring: the latency plus 2(n−1)/n of
//! the bytes over the link.
//!
//! Invariants: every table has at least two sizes, strictly increasing,
//! with positive times; each names its source.

use crate::spec::Gpu;
use serde::Deserialize;

/// The built-in tables.
pub const NCCL_TOML: &str = include_str!("../data/nccl.toml");

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Table {
    pub gpu: String,
    pub ranks: u32,
    /// Where the figures come from.
    pub source: String,
    /// (message bytes, time µs), increasing in bytes.
    pub points: Vec<(f64, f64)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Nccl {
    pub tables: Vec<Table>,
}

#[derive(Deserialize)]
struct File {
    #[serde(default)]
    allreduce: Vec<Table>,
}

impl Nccl {
    pub fn builtin() -> Result<Self, String> {
        Self::parse(NCCL_TOML)
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let f: File = toml::from_str(text).map_err(|e| format!("nccl.toml: {e}"))?;
        for t in &f.allreduce {
            let ok = t.points.len() >= 2
                && t.points.windows(2).all(|w| w[1].0 > w[0].0)
                && t.points.iter().all(|(b, us)| *b > 0.0 && *us > 0.0)
                && t.ranks >= 2;
            if !ok {
                return Err(format!(
                    "nccl.toml: the {} × {} table needs two or more increasing sizes with positive times, and 2 or more ranks",
                    t.ranks, t.gpu
                ));
            }
        }
        Ok(Nccl {
            tables: f.allreduce,
        })
    }

    /// Time of an all-reduce of `bytes` across `ranks` GPUs of type `gpu`,
    /// µs, for an engine whose small all-reduce takes `latency_us`.
    pub fn allreduce_us(&self, gpu: &Gpu, ranks: u32, bytes: f64, latency_us: f64) -> f64 {
        if ranks <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        // The share of the message each rank sends in an all-reduce of
        // `r` ranks: nccl-tests' bus-bandwidth factor.
        let factor = |r: u32| 2.0 * (r as f64 - 1.0) / r as f64;
        let table = self
            .tables
            .iter()
            .filter(|t| t.gpu.eq_ignore_ascii_case(&gpu.name))
            .min_by_key(|t| (t.ranks.abs_diff(ranks), t.ranks));
        let Some(t) = table else {
            return latency_us + factor(ranks) * bytes / (gpu.link_gbps * 1e9) * 1e6;
        };
        let scale = factor(ranks) / factor(t.ranks);
        let p = &t.points;
        let (first, last) = (p[0], p[p.len() - 1]);
        let measured = if bytes <= first.0 {
            first.1
        } else if bytes >= last.0 {
            last.1 * bytes / last.0
        } else {
            let i = p.partition_point(|(b, _)| *b < bytes);
            let (a, b) = (p[i - 1], p[i]);
            let f = (bytes.ln() - a.0.ln()) / (b.0.ln() - a.0.ln());
            (a.1.ln() + f * (b.1.ln() - a.1.ln())).exp()
        };
        latency_us + (measured - first.1).max(0.0) * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Catalog;

    #[test]
    fn tables_interpolate_and_fall_back_to_a_ring() {
        let c = Catalog::builtin().unwrap();
        let h100 = c.gpu("H100").unwrap();
        let n = Nccl::parse(
            "[[allreduce]]\ngpu = \"H100\"\nranks = 8\nsource = \"test\"\npoints = [[1024.0, 20.0], [1048576.0, 40.0], [1073741824.0, 4000.0]]\n",
        )
        .unwrap();
        // The engine's latency in place of NCCL's floor, an interpolated
        // middle, a bandwidth-bound top.
        assert_eq!(n.allreduce_us(h100, 8, 10.0, 8.0), 8.0);
        let mid = n.allreduce_us(h100, 8, 32768.0, 8.0);
        assert!(mid > 8.0 && mid < 28.0, "{mid}");
        assert_eq!(
            n.allreduce_us(h100, 8, 2.0 * 1073741824.0, 8.0),
            8.0 + 8000.0 - 20.0
        );
        // No table for 4 ranks: the 8-rank table at the same bus
        // bandwidth, its time above the floor scaled by (2·3/4)/(2·7/8).
        let four = n.allreduce_us(h100, 4, 1048576.0, 8.0);
        assert!((four - (8.0 + 20.0 * 6.0 / 7.0)).abs() < 1e-9, "{four}");
        // No table for the GPU at all: a ring, latency plus 2·3/4 of 1 MB
        // over the link.
        let h200 = c.gpu("H200").unwrap();
        let ring = n.allreduce_us(h200, 4, 1e6, 8.0);
        assert!((ring - (8.0 + 1.5e6 / 450e9 * 1e6)).abs() < 1e-9, "{ring}");
        assert_eq!(n.allreduce_us(h100, 1, 1e6, 8.0), 0.0);
        assert!(Nccl::parse(
            "[[allreduce]]\ngpu = \"H100\"\nranks = 8\nsource = \"x\"\npoints = [[1.0, 1.0]]\n"
        )
        .is_err());
        Nccl::builtin().unwrap();
    }
}
