/* Block-quantized weight x int8 activation matmuls for x86-64 with AVX2, FMA and F16C.
 *
 * Built and loaded by q4_native.py (its docstring: the formats, the error bounds, the speed).
 * A weight row is K / 32 blocks of 32 inputs in groups of up to GROUP blocks; a 4-bit group of
 * r blocks is [r fp16 scales][r fp16 offsets][r x 16 bytes of codes] (w = d * q + m; byte j of
 * a block holds q[j] in its low nibble and q[j + 16] in its high one), an 8-bit group
 * [r fp16 scales][r x 32 int8 codes] (w = d * q). Activation rows are quantized per block to
 * int8 (d = absmax / 127) into the same groups, with the block sums d * sum(q) for the offsets.
 * A block's dot product is 32 byte products summed in integers (vpmaddubsw + vpmaddwd), then
 * scaled once; the scales of a group convert and multiply as one vector. 4-bit: two blocks share
 * a 32-byte load, their code bytes interleaved 4 at a time (q4_native.pack_q4), so the low
 * nibbles hold both blocks' first halves and the high ones their second halves, and the 32-bit
 * sums alternate between the two blocks (one 8-byte broadcast of their two scales); a pair's
 * activations are stored in that order. Up to TILE activation rows share each unpacked weight
 * block; each row's sums take the same order however many rows share it (batch invariance).
 * Threads: one OpenMP team over output rows (torch's libgomp).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define QK 32
#define GROUP 8
#define TILE 8

/* One activation group: GROUP blocks' scales and sums (zero past the row's last block), codes. */
typedef struct { float d[GROUP], s[GROUP]; int8_t qs[GROUP * QK]; } act_group;

/* KEEP[r]: all ones in lanes below r, zero above. */
static const int32_t KEEP[GROUP][8] = {
    {0}, {-1}, {-1, -1}, {-1, -1, -1}, {-1, -1, -1, -1}, {-1, -1, -1, -1, -1},
    {-1, -1, -1, -1, -1, -1}, {-1, -1, -1, -1, -1, -1, -1}};

/* r fp16 values (1 <= r <= GROUP) as 8 floats, zero past r. Reads 16 bytes: callers pass a
 * pointer with that many bytes of the same group behind it (the layouts guarantee it). */
static inline __attribute__((always_inline)) __m256 load_halves(const uint16_t *p, int r) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return r == GROUP ? v : _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)KEEP[r])));
}

/* Quantize one block of 32 floats to int8 codes in element order; returns d, sets *sum. */
static float quantize_block(const float *x, int8_t *q, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
#define ROUND_INT(v) _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT))
    __m256i i0 = ROUND_INT(v0), i1 = ROUND_INT(v1), i2 = ROUND_INT(v2), i3 = ROUND_INT(v3);
#undef ROUND_INT
    /* Packing works within 128-bit lanes; the permute restores element order. */
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i sum32 = _mm256_madd_epi16(_mm256_add_epi16(p01, p23), _mm256_set1_epi16(1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order));
    const float d = amax / 127.0f;
    *sum = d * (float)_mm_cvtsi128_si32(s4);
    return d;
}

/* One activation row of k floats into k / 32 / GROUP (rounded up) groups; pairs: store each
 * block pair's codes as [first halves of both][second halves of both], the two blocks' bytes
 * interleaved 4 at a time (the 4-bit weights' order). */
static void quantize_row(const float *x, int64_t k, act_group *out, int pairs) {
    const int64_t nb = k / QK;
    for (int64_t g = 0; g * GROUP < nb; g++) {
        act_group *a = out + g;
        const int r = nb - g * GROUP < GROUP ? (int)(nb - g * GROUP) : GROUP;
        for (int b = 0; b < r; b++) a->d[b] = quantize_block(x + (g * GROUP + b) * QK, a->qs + b * QK, &a->s[b]);
        for (int b = r; b < GROUP; b++) a->d[b] = a->s[b] = 0.0f;
        if (!pairs) continue;
        for (int b = 0; b + 1 < r; b += 2) {
            int8_t *q = a->qs + b * QK;
            const __m128i l1 = _mm_loadu_si128((const __m128i *)q);
            const __m128i h1 = _mm_loadu_si128((const __m128i *)(q + 16));
            const __m128i l2 = _mm_loadu_si128((const __m128i *)(q + 32));
            const __m128i h2 = _mm_loadu_si128((const __m128i *)(q + 48));
            _mm_storeu_si128((__m128i *)q, _mm_unpacklo_epi32(l1, l2));
            _mm_storeu_si128((__m128i *)(q + 16), _mm_unpackhi_epi32(l1, l2));
            _mm_storeu_si128((__m128i *)(q + 32), _mm_unpacklo_epi32(h1, h2));
            _mm_storeu_si128((__m128i *)(q + 48), _mm_unpackhi_epi32(h1, h2));
        }
    }
}

/* acc[t] += (one group of r 4-bit blocks) . (activation row t's group g), t < tile. */
static inline __attribute__((always_inline)) void group_q4(const uint8_t *w, const act_group *a, int64_t ga,
                                                           int64_t g, const int r, __m256 *acc, const int tile) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t *qs = w + 4 * r;
    const __m256 dw = load_halves((const uint16_t *)w, r), mw = load_halves((const uint16_t *)w + r, r);
    /* The block scales go through memory: a broadcast load is one uop, a lane permute three. */
    float dd[TILE][GROUP] __attribute__((aligned(32)));
    for (int t = 0; t < tile; t++) {
        const act_group *at = a + t * ga + g;
        _mm256_store_ps(dd[t], _mm256_mul_ps(dw, _mm256_loadu_ps(at->d)));
        acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(at->s), acc[t]);
    }
    int b = 0;
    for (; b + 1 < r; b += 2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * b));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int t = 0; t < tile; t++) {
            const int8_t *x = a[t * ga + g].qs + b * QK;
            const __m256i first = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
            const __m256i second = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32)));
            const __m256i s16 = _mm256_add_epi16(first, second);
            /* lanes alternate between the two blocks: their scales as one 8-byte broadcast */
            const __m256 scale = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&dd[t][b]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), acc[t]);
        }
    }
    if (b < r) { /* an odd last block: its halves in element order */
        const __m128i h = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(h, 4), h), low);
        for (int t = 0; t < tile; t++) {
            const __m256i p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(a[t * ga + g].qs + b * QK))), ones);
            acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[t][b]), _mm256_cvtepi32_ps(p), acc[t]);
        }
    }
}

/* acc[t] += (one group of r 8-bit blocks) . (activation row t's group g); vpmaddubsw wants one
 * unsigned side: |w| against x with w's sign (|w| <= 127). */
static inline __attribute__((always_inline)) void group_q8(const uint8_t *w, const act_group *a, int64_t ga,
                                                           int64_t g, const int r, __m256 *acc, const int tile) {
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *qs = w + 2 * r;
    const __m256 dw = load_halves((const uint16_t *)w, r);
    /* The block scales go through memory: a broadcast load is one uop, a lane permute three. */
    float dd[TILE][GROUP] __attribute__((aligned(32)));
    for (int t = 0; t < tile; t++) _mm256_store_ps(dd[t], _mm256_mul_ps(dw, _mm256_loadu_ps(a[t * ga + g].d)));
    for (int b = 0; b < r; b++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + QK * b));
        const __m256i mag = _mm256_sign_epi8(q, q);
        for (int t = 0; t < tile; t++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a[t * ga + g].qs + b * QK));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, q)), ones);
            acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[t][b]), _mm256_cvtepi32_ps(p), acc[t]);
        }
    }
}

/* acc[t] += (a weight row of nb blocks of `bits` bits) . (activation row t): whole groups with
 * the group size a constant, then the row's last partial group. */
static inline __attribute__((always_inline)) void dot_row(int bits, const uint8_t *w, const act_group *a,
                                                          int64_t ga, int64_t nb, __m256 *acc, const int tile) {
    const int64_t group_bytes = (bits == 4 ? 20 : 34) * GROUP;
    int64_t g = 0;
    for (; (g + 1) * GROUP <= nb; g++, w += group_bytes) {
        if (bits == 4)
            group_q4(w, a, ga, g, GROUP, acc, tile);
        else
            group_q8(w, a, ga, g, GROUP, acc, tile);
    }
    if (g * GROUP < nb) {
        if (bits == 4)
            group_q4(w, a, ga, g, (int)(nb - g * GROUP), acc, tile);
        else
            group_q8(w, a, ga, g, (int)(nb - g * GROUP), acc, tile);
    }
}

/* One weight row against `tile` activation rows: y[t * ldy] (+)= the dot products. */
static inline __attribute__((always_inline)) void row_tile(int bits, const uint8_t *w, const act_group *a,
                                                           int64_t ga, int64_t nb, float *y, int64_t ldy,
                                                           int accumulate, const int tile) {
    /* One chain of sums a row whatever the tile, so that a row's result never depends on the
     * rows computed with it (a verify step's rows equal one-token steps', bit for bit); a second
     * chain for one or two rows measured no faster. */
    __m256 acc[TILE];
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
    dot_row(bits, w, a, ga, nb, acc, tile);
    for (int t = 0; t < tile; t++) {
        const float v = hsum8(acc[t]);
        y[t * ldy] = accumulate ? y[t * ldy] + v : v;
    }
}

/* The activation scratch of the calling thread, grown on demand: quantized groups, and one
 * row of floats (normalized, or the gated activation). */
static __thread act_group *scratch;
static __thread int64_t scratch_groups;
static __thread float *normed;
static __thread int64_t normed_floats;

/* out = x * (1 / sqrt(mean(x^2) + eps)) * w over k floats (RMSNorm). */
static void rms_norm_row(const float *x, const float *w, float eps, int64_t k, float *out) {
    __m256 ss = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    float sum = hsum8(ss);
    for (; i < k; i++) sum += x[i] * x[i];
    const __m256 scale = _mm256_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum / (float)k + eps))));
    for (i = 0; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale), _mm256_loadu_ps(w + i)));
    for (; i < k; i++) out[i] = x[i] * _mm256_cvtss_f32(scale) * w[i];
}

/* out = silu(g) * u over k floats: a gated MLP's activation. */
static void swiglu_row(const float *g, const float *u, int64_t k, float *out) {
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    for (; i < k; i++) out[i] = _mm256_cvtss_f32(silu8(_mm256_set1_ps(g[i]))) * u[i];
}

/* The first and one-past-last output row of this thread: 8-row aligned, even shares. */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t chunk = ((n + parts - 1) / parts + 7) & ~(int64_t)7;
    *lo = me * chunk < n ? me * chunk : n;
    *hi = *lo + chunk < n ? *lo + chunk : n;
}

/* y[r, j] (+)= sum_i x[r, i] * W[j, i] for r < m, j < n; x rows ldx floats apart, y rows ldy.
 * w: n rows of k / 32 blocks of `bits` (4 or 8) bits. accumulate: add to y instead of setting
 * it. norm_w: when not NULL, each x row is RMS-normalized first (weights norm_w [k], eps).
 * swiglu: each x row holds 2k floats, gate then up, and the product takes silu(gate) * up.
 * Returns 0, or -1 when the scratch could not be allocated, bits is neither 4 nor 8, or both
 * norm_w and swiglu are given (y untouched). */
int q_matmul(int bits, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
             float *y, int64_t ldy, int accumulate, const float *norm_w, float eps, int swiglu) {
    const int64_t nb = k / QK, ga = (nb + GROUP - 1) / GROUP;
    const int64_t row_bytes = nb * (bits == 4 ? 20 : 34);
    if ((bits != 4 && bits != 8) || (norm_w && swiglu)) return -1;
    if (m * ga > scratch_groups) {
        free(scratch);
        scratch = (act_group *)malloc((size_t)(m * ga) * sizeof(act_group));
        scratch_groups = scratch ? m * ga : 0;
        if (!scratch) return -1;
    }
    if ((norm_w || swiglu) && k > normed_floats) {
        free(normed);
        normed = (float *)malloc((size_t)k * sizeof(float));
        normed_floats = normed ? k : 0;
        if (!normed) return -1;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        if (norm_w) {
            rms_norm_row(row, norm_w, eps, k, normed);
            row = normed;
        } else if (swiglu) {
            swiglu_row(row, row + k, k, normed);
            row = normed;
        }
        quantize_row(row, k, scratch + r * ga, bits == 4);
    }
    const act_group *a = scratch;
#pragma omp parallel
    {
        int64_t lo, hi;
        share(n, &lo, &hi);
        for (int64_t j = lo; j < hi; j++) {
            const uint8_t *wj = w + j * row_bytes;
            int64_t r = 0;
            for (; r + TILE <= m; r += TILE)
                row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, TILE);
            switch (m - r) {
            case 7: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 7); break;
            case 6: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 6); break;
            case 5: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 5); break;
            case 4: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 4); break;
            case 3: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 3); break;
            case 2: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 2); break;
            case 1: row_tile(bits, wj, a + r * ga, ga, nb, y + r * ldy + j, ldy, accumulate, 1); break;
            default: break;
            }
        }
    }
    return 0;
}

/* q_matmul's arguments as one struct (q4_native.QCall mirrors it; every field 8 bytes): ctypes
 * converts one pointer instead of 13 arguments, ~1 us a call instead of ~4.5, and the decode
 * plan binds its calls once. */
typedef struct {
    int64_t bits;
    const uint8_t *w;
    int64_t n, k;
    const float *x;
    int64_t m, ldx;
    float *y;
    int64_t ldy, accumulate;
    const float *norm_w;
    double eps;
    int64_t swiglu;
} q_call;

int q_matmul_call(const q_call *c) {
    return q_matmul((int)c->bits, c->w, c->n, c->k, c->x, c->m, c->ldx, c->y, c->ldy, (int)c->accumulate, c->norm_w,
                    (float)c->eps, (int)c->swiglu);
}

/* The layout constants the loader checks against its own. */
int64_t layout(int what) {
    return what == 0 ? QK : what == 1 ? GROUP : what == 2 ? (int64_t)sizeof(act_group)
         : what == 3 ? (int64_t)sizeof(q_call) : -1;
}
