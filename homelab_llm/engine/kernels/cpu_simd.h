/* AVX2 helpers shared by this folder's C kernels (q4_cpu.c, decode_attention_cpu.c); built with
 * them by native_build.py, which hashes this header into their library names. */
#ifndef HOMELAB_LLM_CPU_SIMD_H
#define HOMELAB_LLM_CPU_SIMD_H

#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0: 2^n e^r with n = round(x log2 e) and a degree-6 polynomial for e^r on
 * |r| <= ln 2 / 2 (relative error ~1e-7); below -87 it returns 0. */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float exp_neg1(float x) { return _mm256_cvtss_f32(exp_neg(_mm256_set1_ps(x))); }

/* x * sigmoid(x), from e = e^-|x| so the exponential never overflows: sigmoid(|x|) = 1 / (1 + e),
 * and 1 minus that for negative x (the sign bit picks). */
static inline __m256 silu8(__m256 x) {
    const __m256 e = exp_neg(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sig_pos = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(sig_pos, _mm256_sub_ps(one, sig_pos), x);
    return _mm256_mul_ps(x, sig);
}

#endif
