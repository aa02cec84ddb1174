/* The attention of a step's few new tokens on an x86-64 CPU with AVX2 and FMA, fp32 paged cache.
 *
 * Built and loaded by decode_attention_native.py (its docstring: why, the bounds). One call does,
 * for every new token (a row: one sequence's decode token, a verify step's drafted tokens, a short
 * prompt's tokens), what the torch path does in ~8 ops: add the projection's bias (Qwen2), RMS-
 * normalize each q and k head (Qwen3), rotate q and k (rotate-half RoPE, cos | sin row of the
 * row's position), store k and v at the row's cache slot, then attend over the row's
 * positions (its sequence's, up to and including its own: causal) through its sequence's page
 * table, each query head against its KV head (GQA). All rows are stored before any attends, so a
 * sequence's later rows see its earlier ones. Positions are split in chunks; a task is one row, one
 * KV head and one chunk (scores for the head's query heads, their exponentials, sums and weighted
 * values: two passes over the chunk), tasks run on torch's OpenMP team, and the chunks' partial
 * results are merged by their maxima (flash-decoding).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define CHUNK 256
#define MAX_GROUP 16
#define MAX_DIM 256

/* out = rotate(x) over nh heads of d: out[j] = x[j] c[j] - x[j + h] s[j], out[j + h] = x[j + h] c[j]
 * + x[j] s[j] for j < h = d / 2 (cos_sin: c then s). */
static void rotate(const float *x, const float *cos_sin, int64_t nh, int64_t d, float *out) {
    const int64_t h = d / 2;
    for (int64_t head = 0; head < nh; head++, x += d, out += d)
        for (int64_t j = 0; j < h; j += 8) {
            const __m256 c = _mm256_loadu_ps(cos_sin + j), s = _mm256_loadu_ps(cos_sin + h + j);
            const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + h + j);
            _mm256_storeu_ps(out + j, _mm256_fnmadd_ps(b, s, _mm256_mul_ps(a, c)));
            _mm256_storeu_ps(out + h + j, _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c)));
        }
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* The 8 lanes' sums of a[0..7], as one vector (lane i: the sum of a[i]). */
static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One task: KV head kv, positions [lo, hi). part: per query head of the group, its maximum,
 * its sum of exponentials, then d weighted values. Scores take 8 positions at a time (8 dot
 * products in flight, summed across lanes together); the weighted values keep 64 of a head's
 * outputs in registers over the chunk's positions. */
static void attend_chunk(const float *q, const float *k_cache, const float *v_cache, const int32_t *pages,
                         int64_t page_size, int64_t hkv, int64_t group, int64_t d, int64_t kv, int64_t lo,
                         int64_t hi, float scale, float *part) {
    float scores[MAX_GROUP][CHUNK] __attribute__((aligned(32)));
    const float *keys[CHUNK], *values[CHUNK];
    const int64_t n = hi - lo, stride = 2 + d;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pos = lo + i, row = (int64_t)pages[pos / page_size] * page_size + pos % page_size;
        keys[i] = k_cache + (row * hkv + kv) * d;
        values[i] = v_cache + (row * hkv + kv) * d;
    }
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + (kv * group + g) * d;
        float *s = scores[g], *p = part + g * stride;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t j = 0; j < d; j += 8) {
                const __m256 qj = _mm256_loadu_ps(qg + j);
                for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(keys[i + r] + j), acc[r]);
            }
            _mm256_storeu_ps(s + i, _mm256_mul_ps(sums8(acc), sv));
        }
        for (; i < n; i++) s[i] = dot(qg, keys[i], d) * scale;
        float m = s[0];
        for (i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
        __m256 sum = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
            _mm256_storeu_ps(s + i, e);
            sum = _mm256_add_ps(sum, e);
        }
        float total = hsum8(sum);
        for (; i < n; i++) {
            s[i] = exp_neg1(s[i] - m);
            total += s[i];
        }
        p[0] = m;
        p[1] = total;
        for (int64_t j0 = 0; j0 < d; j0 += 64) {
            const int64_t width = d - j0 < 64 ? d - j0 : 64;
            __m256 acc[8];
            for (int b = 0; b < 8; b++) acc[b] = _mm256_setzero_ps();
            for (i = 0; i < n; i++) {
                const __m256 w = _mm256_set1_ps(s[i]);
                const float *vp = values[i] + j0;
                for (int b = 0; b < 8 && 8 * b < width; b++)
                    acc[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 8 * b), acc[b]);
            }
            for (int b = 0; b < 8 && 8 * b < width; b++) _mm256_storeu_ps(p + 2 + j0 + 8 * b, acc[b]);
        }
    }
}

static __thread float *scratch;
static __thread int64_t scratch_floats;

/* x[0..d) = x * (1 / sqrt(mean(x^2) + eps)) * w, for each of nh heads of d floats (d % 8 == 0). */
static void head_norms(float *x, const float *w, int64_t nh, int64_t d, float eps) {
    for (int64_t h = 0; h < nh; h++, x += d) {
        __m256 ss = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const float mean = hsum8(ss) / (float)d;
        const __m256 scale = _mm256_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps))));
        for (int64_t j = 0; j < d; j += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j), scale);
            _mm256_storeu_ps(x + j, _mm256_mul_ps(v, _mm256_loadu_ps(w + j)));
        }
    }
}

/* A row's chunk count. */
static inline int64_t chunks_of(int64_t len) { return (len + CHUNK - 1) / CHUNK; }

/* qkv: rows x [hq * d | hkv * d | hkv * d] projections (unrotated), row stride ldqkv; cos_sin:
 * rows x d (each row's position's cos | sin); k_cache / v_cache: [cache rows, hkv, d] of this
 * layer; page_table: one row of page ids per sequence (page_size cache rows each), table_stride
 * apart; info: per row, its sequence's index in page_table, its cache slot, and the positions it
 * attends (its own included); out: rows x hq * d, row stride ldout. bias: NULL, or the
 * projection's (hq + 2 hkv) * d bias, added first; q_norm / k_norm: NULL, or each q / k head's RMSNorm
 * weights [d] (eps), applied before the rotation (both or neither). Returns 0, or -1 for shapes
 * it does not take (d % 16, d > MAX_DIM, hq / hkv > MAX_GROUP, a row with no positions or a
 * negative slot) or -2 for no memory (nothing written either way). */
int attend_rows(const float *qkv, int64_t ldqkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                const float *cos_sin, float *k_cache, float *v_cache, const int32_t *page_table,
                int64_t table_stride, const int64_t *info, int64_t page_size, float scale, float *out,
                int64_t ldout, const float *bias, const float *q_norm, const float *k_norm, float eps) {
    const int64_t group = hq / hkv, stride = 2 + d, width = (hq + 2 * hkv) * d;
    const int pre = bias || q_norm;
    if (d % 16 || d > MAX_DIM || group > MAX_GROUP || group * hkv != hq || rows < 1 || !q_norm != !k_norm)
        return -1;
    int64_t tasks = 0, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (info[3 * r + 2] < 1 || info[3 * r + 1] < 0) return -1;
        tasks += hkv * chunks_of(info[3 * r + 2]);
        work += info[3 * r + 2];
    }
    const int64_t q_floats = rows * hq * d, part_floats = tasks * group * stride, pre_floats = pre ? width : 0;
    if (q_floats + part_floats + pre_floats > scratch_floats) {
        free(scratch);
        scratch = (float *)malloc((size_t)(q_floats + part_floats + pre_floats) * sizeof(float));
        scratch_floats = scratch ? q_floats + part_floats + pre_floats : 0;
        if (!scratch) return -2;
    }
    float *q = scratch, *parts = scratch + q_floats, *staged = parts + part_floats;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = qkv + r * ldqkv, *cs = cos_sin + r * d;
        if (pre) { /* bias, then the q / k heads' norms, on a copy of the row */
            for (int64_t j = 0; j < width; j++) staged[j] = bias ? x[j] + bias[j] : x[j];
            if (q_norm) {
                head_norms(staged, q_norm, hq, d, eps);
                head_norms(staged + hq * d, k_norm, hkv, d, eps);
            }
            x = staged;
        }
        const int64_t slot = info[3 * r + 1];
        rotate(x, cs, hq, d, q + r * hq * d);
        rotate(x + hq * d, cs, hkv, d, k_cache + slot * hkv * d);
        for (int64_t j = 0; j < hkv * d; j++) v_cache[slot * hkv * d + j] = x[(hq + hkv) * d + j];
    }
    /* A team only when there is enough work to pay for its fork and join. */
#pragma omp parallel if (tasks > 1 && work * hq * d >= (1 << 16))
    {
        const int64_t parts_n = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t r = 0, first = 0; /* the row of task t, and that row's first task */
        for (int64_t t = me; t < tasks; t += parts_n) {
            while (t >= first + hkv * chunks_of(info[3 * r + 2])) first += hkv * chunks_of(info[3 * r++ + 2]);
            const int64_t len = info[3 * r + 2], chunks = chunks_of(len);
            const int64_t kv = (t - first) / chunks, c = (t - first) % chunks;
            const int64_t lo = c * CHUNK, hi = lo + CHUNK < len ? lo + CHUNK : len;
            attend_chunk(q + r * hq * d, k_cache, v_cache, page_table + info[3 * r] * table_stride, page_size, hkv,
                         group, d, kv, lo, hi, scale, parts + t * group * stride);
        }
    }
    const float *row_parts = parts;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t chunks = chunks_of(info[3 * r + 2]);
        for (int64_t kv = 0; kv < hkv; kv++)
            for (int64_t g = 0; g < group; g++) {
                float m = -3.0e38f, total = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    const float pm = row_parts[((kv * chunks + c) * group + g) * stride];
                    m = pm > m ? pm : m;
                }
                float *o = out + r * ldout + (kv * group + g) * d;
                for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    const float *p = row_parts + ((kv * chunks + c) * group + g) * stride;
                    const float w = exp_neg1(p[0] - m);
                    total += w * p[1];
                    for (int64_t j = 0; j < d; j++) o[j] += w * p[2 + j];
                }
                const float inv = 1.0f / total;
                for (int64_t j = 0; j < d; j++) o[j] *= inv;
            }
        row_parts += hkv * chunks * group * stride;
    }
    return 0;
}

/* attend_rows's arguments as one struct (decode_attention_native.AttendCall mirrors it; every
 * field 8 bytes): one pointer through ctypes instead of 20 arguments. */
typedef struct {
    const float *qkv;
    int64_t ldqkv, rows, hq, hkv, d;
    const float *cos_sin;
    float *k_cache, *v_cache;
    const int32_t *page_table;
    int64_t table_stride;
    const int64_t *info;
    int64_t page_size;
    double scale;
    float *out;
    int64_t ldout;
    const float *bias, *q_norm, *k_norm;
    double eps;
} attend_call;

int attend_rows_call(const attend_call *c) {
    return attend_rows(c->qkv, c->ldqkv, c->rows, c->hq, c->hkv, c->d, c->cos_sin, c->k_cache, c->v_cache,
                       c->page_table, c->table_stride, c->info, c->page_size, (float)c->scale, c->out, c->ldout,
                       c->bias, c->q_norm, c->k_norm, (float)c->eps);
}

/* The struct's size, which the loader checks against its own. */
int64_t attend_call_size(void) { return (int64_t)sizeof(attend_call); }
