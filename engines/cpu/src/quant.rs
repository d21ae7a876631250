//! Quantized weight formats (as stored in GGUF) and the dot products the
//! forward pass is made of.
//!
//! - Weights: `Q4_1` (20-byte blocks of 32: f16 scale `d`, f16 min `m`, 16
//!   bytes of nibbles; value = d·q + m; low nibbles are elements 0..16, high
//!   nibbles 16..32) and `Q8_0` (34-byte blocks: f16 `d`, 32 × i8).
//! - Activations are quantized per 32-block to i16 ([`ActBlock`]), so every
//!   product is an exact integer sum per block, scaled once. i16 rather
//!   than ggml's i8: with i8 activations SmolLM2's logits move by ~1.5 and
//!   greedy answers change ("The capital of France is Paris" becomes
//!   "L'Étoile, ..."); with i16 they stay within ~1e-2 of f32, at a
//!   similar instruction count (`vpmaddwd` instead of `vpmaddubsw`).
//!
//! Invariants: the AVX2 kernels compute the same integer block sums as the
//! scalar ones (results differ only by float summation order, checked by
//! tests); the AVX2 path is taken only when the CPU reports avx2, fma and
//! f16c at run time.

pub const QK: usize = 32;
pub const Q4_1_BYTES: usize = 20;
pub const Q8_0_BYTES: usize = 34;

/// One 32-element block of quantized activations: `x ≈ d · qs`, `s = d · Σqs`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(8))]
pub struct ActBlock {
    pub d: f32,
    pub s: f32,
    pub qs: [i16; QK],
}

impl Default for ActBlock {
    fn default() -> Self {
        ActBlock {
            d: 0.0,
            s: 0.0,
            qs: [0; QK],
        }
    }
}

const QMAX: f32 = 32767.0;

/// IEEE half → f32 (exact, including subnormals, infinities and NaN).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: normalise.
            let shift = man.leading_zeros() - 21;
            let man = (man << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (man << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Quantizes `x` (a multiple of 32 long) into `out`.
pub fn quantize_row(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / QMAX;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in blk.qs.iter_mut().zip(xs) {
            let r = (v * id).round() as i32;
            *q = r.clamp(-(QMAX as i32), QMAX as i32) as i16;
            sum += *q as i32;
        }
        blk.d = d;
        blk.s = d * sum as f32;
    }
}

/// Dequantizes one row of `Q8_0` blocks.
pub fn dequant_q8_0(row: &[u8], out: &mut [f32]) {
    for (b, o) in row.chunks_exact(Q8_0_BYTES).zip(out.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        for (o, q) in o.iter_mut().zip(&b[2..]) {
            *o = d * (*q as i8) as f32;
        }
    }
}

/// Dequantizes one row of `Q4_1` blocks.
pub fn dequant_q4_1(row: &[u8], out: &mut [f32]) {
    for (b, o) in row.chunks_exact(Q4_1_BYTES).zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (half_at(b, 0), half_at(b, 2));
        for j in 0..16 {
            o[j] = d * (b[4 + j] & 0x0f) as f32 + m;
            o[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
        }
    }
}

pub fn dot_q4_1_scalar(row: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in row.chunks_exact(Q4_1_BYTES).zip(a) {
        let (d, m) = (half_at(b, 0), half_at(b, 2));
        let mut sum = 0i32;
        for j in 0..16 {
            sum += (b[4 + j] & 0x0f) as i32 * x.qs[j] as i32;
            sum += (b[4 + j] >> 4) as i32 * x.qs[j + 16] as i32;
        }
        acc += d * x.d * sum as f32 + m * x.s;
    }
    acc
}

pub fn dot_q8_0_scalar(row: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in row.chunks_exact(Q8_0_BYTES).zip(a) {
        let d = half_at(b, 0);
        let mut sum = 0i32;
        for j in 0..QK {
            sum += (b[2 + j] as i8) as i32 * x.qs[j] as i32;
        }
        acc += d * x.d * sum as f32;
    }
    acc
}

/// Whether the AVX2 kernels can run on this CPU.
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The weight format of a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    Q4_1,
    Q8_0,
}

impl QType {
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_1 => Q4_1_BYTES,
            QType::Q8_0 => Q8_0_BYTES,
        }
    }
}

/// `*out.add(i * stride) = row · a[i]` for every activation row `i` of
/// `nb` blocks stored consecutively in `a`.
///
/// # Safety
/// `out.add(i * stride)` must be valid for writes for every row `i`, and
/// `row` must hold at least `nb` blocks of `qt`.
pub unsafe fn dot_many(
    qt: QType,
    row: &[u8],
    a: &[ActBlock],
    nb: usize,
    out: *mut f32,
    stride: usize,
) {
    let n = a.len() / nb;
    debug_assert!(row.len() >= nb * qt.block_bytes());
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: the CPU has avx2, fma and f16c (checked above).
        match qt {
            QType::Q4_1 => avx2::dot_many_q4_1(row, a, nb, out, stride),
            QType::Q8_0 => avx2::dot_many_q8_0(row, a, nb, out, stride),
        }
        return;
    }
    for i in 0..n {
        let ai = &a[i * nb..(i + 1) * nb];
        *out.add(i * stride) = match qt {
            QType::Q4_1 => dot_q4_1_scalar(row, ai),
            QType::Q8_0 => dot_q8_0_scalar(row, ai),
        };
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Σ w·x over one block as 8 i32 lanes (`wl`, `wh`: elements 0..16, 16..32).
    #[inline(always)]
    unsafe fn dot16(wl: __m256i, wh: __m256i, x: &ActBlock) -> __m256i {
        let p = x.qs.as_ptr() as *const __m256i;
        _mm256_add_epi32(
            _mm256_madd_epi16(wl, _mm256_loadu_si256(p)),
            _mm256_madd_epi16(wh, _mm256_loadu_si256(p.add(1))),
        )
    }

    /// d and m of a Q4_1 block, or d (twice) of a Q8_0 block start.
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
    }

    /// Scale, min and the 32 weights (as i16, elements 0..16 and 16..32) of
    /// the Q4_1 block at `p`.
    #[inline(always)]
    unsafe fn unpack_q4_1(p: *const u8) -> (f32, f32, __m256i, __m256i) {
        let dm = halves(p);
        let mask = _mm_set1_epi8(0x0f);
        let qs = _mm_loadu_si128(p.add(4) as *const __m128i);
        let lo = _mm_and_si128(qs, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
        (
            _mm_cvtss_f32(dm),
            _mm_cvtss_f32(_mm_movehdup_ps(dm)),
            _mm256_cvtepu8_epi16(lo),
            _mm256_cvtepu8_epi16(hi),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_many_q4_1(
        row: &[u8],
        a: &[ActBlock],
        nb: usize,
        out: *mut f32,
        stride: usize,
    ) {
        debug_assert!(row.len() >= nb * Q4_1_BYTES);
        let n = a.len() / nb;
        let rp = row.as_ptr();
        // Rows of activations in pairs: the unpacked weights serve both.
        let mut i = 0;
        while i + 2 <= n {
            let a0 = a.as_ptr().add(i * nb);
            let a1 = a.as_ptr().add((i + 1) * nb);
            let mut acc0 = _mm256_setzero_ps();
            let mut acc1 = _mm256_setzero_ps();
            let mut m0 = 0f32;
            let mut m1 = 0f32;
            for b in 0..nb {
                let (d, m, wl, wh) = unpack_q4_1(rp.add(b * Q4_1_BYTES));
                let x0 = &*a0.add(b);
                let x1 = &*a1.add(b);
                let p0 = dot16(wl, wh, x0);
                let p1 = dot16(wl, wh, x1);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * x0.d), _mm256_cvtepi32_ps(p0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * x1.d), _mm256_cvtepi32_ps(p1), acc1);
                m0 += m * x0.s;
                m1 += m * x1.s;
            }
            *out.add(i * stride) = hsum(acc0) + m0;
            *out.add((i + 1) * stride) = hsum(acc1) + m1;
            i += 2;
        }
        if i < n {
            let a0 = a.as_ptr().add(i * nb);
            let mut acc0 = _mm256_setzero_ps();
            let mut m0 = 0f32;
            for b in 0..nb {
                let (d, m, wl, wh) = unpack_q4_1(rp.add(b * Q4_1_BYTES));
                let x0 = &*a0.add(b);
                let p0 = dot16(wl, wh, x0);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * x0.d), _mm256_cvtepi32_ps(p0), acc0);
                m0 += m * x0.s;
            }
            *out.add(i * stride) = hsum(acc0) + m0;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_many_q8_0(
        row: &[u8],
        a: &[ActBlock],
        nb: usize,
        out: *mut f32,
        stride: usize,
    ) {
        debug_assert!(row.len() >= nb * Q8_0_BYTES);
        let n = a.len() / nb;
        let rp = row.as_ptr();
        for i in 0..n {
            let ai = a.as_ptr().add(i * nb);
            let mut acc = _mm256_setzero_ps();
            for b in 0..nb {
                let p = rp.add(b * Q8_0_BYTES);
                let d = _mm_cvtss_f32(halves(p));
                let w = _mm256_loadu_si256(p.add(2) as *const __m256i);
                let x = &*ai.add(b);
                let prod = dot16(
                    _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)),
                    _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)),
                    x,
                );
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(prod), acc);
            }
            *out.add(i * stride) = hsum(acc);
        }
    }
}

/// f32 helpers the attention uses (vectorised by the compiler inside
/// `target_feature` functions when the CPU allows).
pub mod f32ops {
    #[inline(always)]
    pub(crate) fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for k in 0..8 {
                acc[k] = x[k].mul_add(y[k], acc[k]);
            }
        }
        let mut s = acc.iter().sum::<f32>();
        for (x, y) in ra.iter().zip(rb) {
            s += x * y;
        }
        s
    }

    #[inline(always)]
    pub(crate) fn axpy_generic(alpha: f32, x: &[f32], y: &mut [f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = alpha.mul_add(*x, *y);
        }
    }

    /// `e^x` to ~2e-7 relative error, branch-free so loops of it vectorise
    /// (libm's `expf` does not, and softmax and SiLU call it per element).
    #[inline(always)]
    pub(crate) fn exp_approx(x: f32) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        let x = x.clamp(-87.0, 88.0);
        let n = (x * LOG2E + 0.5).floor();
        let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
        let mut p = 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        p * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }

    /// `x[i] = e^(x[i] - max)`; returns the sum.
    #[inline(always)]
    pub(crate) fn softmax_exp_generic(x: &mut [f32], max: f32) -> f32 {
        for v in x.iter_mut() {
            *v = exp_approx(*v - max);
        }
        let mut acc = [0f32; 8];
        let chunks = x.chunks_exact(8);
        let rest: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            for k in 0..8 {
                acc[k] += c[k];
            }
        }
        acc.iter().sum::<f32>() + rest
    }

    #[inline(always)]
    fn silu_mul_generic(g: &mut [f32], u: &[f32]) {
        for (g, u) in g.iter_mut().zip(u) {
            *g = *g / (1.0 + exp_approx(-*g)) * u;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) {
        silu_mul_generic(g, u)
    }

    /// `g = silu(g) · u`.
    pub fn silu_mul(g: &mut [f32], u: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::simd_available() {
            // SAFETY: avx2 and fma are present.
            return unsafe { silu_mul_avx2(g, u) };
        }
        silu_mul_generic(g, u)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        dot_generic(a, b)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
        axpy_generic(alpha, x, y)
    }

    /// `a · b` (same length).
    #[inline]
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if super::simd_available() {
            // SAFETY: avx2 and fma are present.
            return unsafe { dot_avx2(a, b) };
        }
        dot_generic(a, b)
    }

    /// `y += alpha · x`.
    #[inline]
    pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::simd_available() {
            // SAFETY: avx2 and fma are present.
            return unsafe { axpy_avx2(alpha, x, y) };
        }
        axpy_generic(alpha, x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn f32_to_f16(x: f32) -> u16 {
        // Good enough for test data: normal range, truncation.
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        if exp <= 0 {
            return sign;
        }
        sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
    }

    fn q4_1_row(seed: &mut u64, nb: usize) -> Vec<u8> {
        let mut row = Vec::new();
        for _ in 0..nb {
            row.extend_from_slice(&f32_to_f16(rng(seed) * 0.1).to_le_bytes());
            row.extend_from_slice(&f32_to_f16(rng(seed) * 0.5).to_le_bytes());
            for _ in 0..16 {
                row.push((rng(seed).abs() * 255.0) as u8);
            }
        }
        row
    }

    fn q8_0_row(seed: &mut u64, nb: usize) -> Vec<u8> {
        let mut row = Vec::new();
        for _ in 0..nb {
            row.extend_from_slice(&f32_to_f16(rng(seed) * 0.05).to_le_bytes());
            for _ in 0..32 {
                row.push(((rng(seed) * 127.0) as i8) as u8);
            }
        }
        row
    }

    #[test]
    fn halves_convert_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x3555), 0.33325195);
    }

    #[test]
    fn kernels_match_dequantized_dot_products() {
        let mut seed = 42;
        let nb = 18;
        for qt in [QType::Q4_1, QType::Q8_0] {
            let row = match qt {
                QType::Q4_1 => q4_1_row(&mut seed, nb),
                QType::Q8_0 => q8_0_row(&mut seed, nb),
            };
            let mut w = vec![0f32; nb * QK];
            match qt {
                QType::Q4_1 => dequant_q4_1(&row, &mut w),
                QType::Q8_0 => dequant_q8_0(&row, &mut w),
            }
            let n = 5;
            let x: Vec<f32> = (0..n * nb * QK).map(|_| rng(&mut seed)).collect();
            let mut a = vec![ActBlock::default(); n * nb];
            for i in 0..n {
                quantize_row(
                    &x[i * nb * QK..(i + 1) * nb * QK],
                    &mut a[i * nb..(i + 1) * nb],
                );
            }
            let mut out = vec![0f32; n * 3];
            unsafe { dot_many(qt, &row, &a, nb, out.as_mut_ptr(), 3) };
            for i in 0..n {
                let xi = &x[i * nb * QK..(i + 1) * nb * QK];
                let exact: f32 = w.iter().zip(xi).map(|(a, b)| a * b).sum();
                let ai = &a[i * nb..(i + 1) * nb];
                let scalar = match qt {
                    QType::Q4_1 => dot_q4_1_scalar(&row, ai),
                    QType::Q8_0 => dot_q8_0_scalar(&row, ai),
                };
                let norm: f32 = w.iter().zip(xi).map(|(a, b)| (a * b).abs()).sum();
                assert!(
                    (scalar - out[i * 3]).abs() <= 1e-5 * norm,
                    "{qt:?} simd vs scalar"
                );
                assert!(
                    (scalar - exact).abs() <= 0.02 * norm,
                    "{qt:?}: {scalar} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn exp_approximation_is_accurate() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (f32ops::exp_approx(x), x.exp());
            assert!((a - b).abs() <= 3e-7 * b, "{x}: {a} vs {b}");
            x += 0.01;
        }
        let mut v = vec![0.0, -1.0, -2.0, 1.0];
        let sum = f32ops::softmax_exp_generic(&mut v, 1.0);
        let want: f32 = [-1.0f32, -2.0, -3.0, 0.0].iter().map(|x| x.exp()).sum();
        assert!((sum - want).abs() < 1e-6);
    }

    #[test]
    fn f32_helpers_match_plain_loops() {
        let mut seed = 7;
        let a: Vec<f32> = (0..67).map(|_| rng(&mut seed)).collect();
        let b: Vec<f32> = (0..67).map(|_| rng(&mut seed)).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((f32ops::dot(&a, &b) - plain).abs() < 1e-4);
        let mut y = b.clone();
        f32ops::axpy(0.5, &a, &mut y);
        for k in 0..67 {
            assert!((y[k] - (b[k] + 0.5 * a[k])).abs() < 1e-6);
        }
    }
}
