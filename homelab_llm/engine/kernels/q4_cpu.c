/* Block-quantized weight x int8 activation matmuls for x86-64 with AVX2, FMA and F16C.
 *
 * Built and loaded by q4_native.py (see its docstring for the formats and the error bounds).
 * Weights keep 4-bit or 8-bit codes with one fp16 scale (and, for 4-bit, one fp16 offset) per 32
 * inputs; each activation row is quantized to int8 per 32 inputs (one fp32 scale a block) so that
 * a block's dot product is 32 byte products summed in integers (vpmaddubsw + vpmaddwd), scaled
 * once. Threads: one OpenMP team over output rows (torch's libgomp, already loaded by torch).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

/* A 4-bit block: w[i] = d * q[i] + m; qs[j] holds q[j] (low nibble) and q[j + 16] (high). */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4;
/* An 8-bit block: w[i] = d * q[i], q in [-127, 127]. */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8w;
/* A quantized activation block: x[i] ~ d * q[i]; s = d * sum(q). */
typedef struct { float d, s; int8_t qs[QK]; } block_act;

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Quantize one row of k floats (k % 32 == 0) into k / 32 activation blocks. */
static void quantize_row(const float *x, int64_t k, block_act *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), _MM_FROUND_TO_NEAREST_INT));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), _MM_FROUND_TO_NEAREST_INT));
        /* Packing works within 128-bit lanes; the permute restores element order. */
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i sum16 = _mm256_add_epi16(p01, p23);
        __m256i sum32 = _mm256_madd_epi16(sum16, ones);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
        _mm256_storeu_si256((__m256i *)out[b].qs, q);
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
}

static inline __m256i unpack_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

static float dot_q4(const block_q4 *w, const block_act *a, int64_t nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offsets = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(unpack_nibbles(w[b].qs), _mm256_loadu_si256((const __m256i *)a[b].qs)), ones);
        __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(unpack_nibbles(w[b + 1].qs), _mm256_loadu_si256((const __m256i *)a[b + 1].qs)),
            ones);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * a[b].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b + 1].d) * a[b + 1].d), _mm256_cvtepi32_ps(p1), acc1);
        offsets += half_to_float(w[b].m) * a[b].s + half_to_float(w[b + 1].m) * a[b + 1].s;
    }
    for (; b < nb; b++) {
        __m256i p = _mm256_madd_epi16(
            _mm256_maddubs_epi16(unpack_nibbles(w[b].qs), _mm256_loadu_si256((const __m256i *)a[b].qs)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * a[b].d), _mm256_cvtepi32_ps(p), acc0);
        offsets += half_to_float(w[b].m) * a[b].s;
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + offsets;
}

static float dot_q8(const block_q8w *w, const block_act *a, int64_t nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    /* vpmaddubsw wants one unsigned operand: |w| against a with w's sign (|w| <= 127). */
#define Q8_PRODUCT(i)                                                                     \
    _mm256_cvtepi32_ps(_mm256_madd_epi16(                                                \
        _mm256_maddubs_epi16(                                                            \
            _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w[i].qs),               \
                             _mm256_loadu_si256((const __m256i *)w[i].qs)),              \
            _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a[i].qs),               \
                             _mm256_loadu_si256((const __m256i *)w[i].qs))),             \
        ones))
    for (; b + 1 < nb; b += 2) {
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * a[b].d), Q8_PRODUCT(b), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b + 1].d) * a[b + 1].d), Q8_PRODUCT(b + 1), acc1);
    }
    for (; b < nb; b++)
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * a[b].d), Q8_PRODUCT(b), acc0);
#undef Q8_PRODUCT
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* The activation scratch of the calling thread, grown on demand. */
static __thread block_act *scratch;
static __thread int64_t scratch_blocks;

static block_act *quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx) {
    const int64_t need = m * (k / QK);
    if (need > scratch_blocks) {
        free(scratch);
        scratch = (block_act *)malloc((size_t)need * sizeof(block_act));
        scratch_blocks = scratch ? need : 0;
        if (!scratch) return NULL;
    }
    for (int64_t r = 0; r < m; r++) quantize_row(x + r * ldx, k, scratch + r * (k / QK));
    return scratch;
}

/* The first and one-past-last output row of this thread: 8-row aligned, even shares. */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t chunk = ((n + parts - 1) / parts + 7) & ~(int64_t)7;
    *lo = me * chunk < n ? me * chunk : n;
    *hi = *lo + chunk < n ? *lo + chunk : n;
}

/* y[r, j] (+)= sum_i x[r, i] * W[j, i] for r < m, j < n; x rows ldx floats apart, y rows ldy.
 * w: n rows of k / 32 blocks. accumulate: add to y instead of overwriting. Returns 0, or -1 when
 * the scratch could not be allocated (y untouched). */
int q4_matmul(const block_q4 *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
              float *y, int64_t ldy, int accumulate) {
    const block_act *a = quantize_rows(x, m, k, ldx);
    if (!a) return -1;
    const int64_t nb = k / QK;
#pragma omp parallel
    {
        int64_t lo, hi;
        share(n, &lo, &hi);
        for (int64_t j = lo; j < hi; j++)
            for (int64_t r = 0; r < m; r++) {
                const float v = dot_q4(w + j * nb, a + r * nb, nb);
                y[r * ldy + j] = accumulate ? y[r * ldy + j] + v : v;
            }
    }
    return 0;
}

int q8_matmul(const block_q8w *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
              float *y, int64_t ldy, int accumulate) {
    const block_act *a = quantize_rows(x, m, k, ldx);
    if (!a) return -1;
    const int64_t nb = k / QK;
#pragma omp parallel
    {
        int64_t lo, hi;
        share(n, &lo, &hi);
        for (int64_t j = lo; j < hi; j++)
            for (int64_t r = 0; r < m; r++) {
                const float v = dot_q8(w + j * nb, a + r * nb, nb);
                y[r * ldy + j] = accumulate ? y[r * ldy + j] + v : v;
            }
    }
    return 0;
}

/* Sizes the loader checks against its own view of the formats. */
int64_t block_bytes(int kind) {
    return kind == 4 ? (int64_t)sizeof(block_q4) : kind == 8 ? (int64_t)sizeof(block_q8w) : (int64_t)sizeof(block_act);
}
