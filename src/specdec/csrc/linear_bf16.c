/* y = x @ w.T with bf16 weights and fp32 activations, for a few rows of x at a time.
 *
 * Why: on CPUs without native bf16 arithmetic (AVX2 only), PyTorch's bf16 matmul costs about n
 * times its one-row cost for n rows, so verifying k drafted tokens costs about k target steps and
 * speculative decoding cannot win. This kernel reads each weight row from memory once per call,
 * widens it to fp32 in registers and multiplies it into every row of x: n rows cost little more
 * than one while the arithmetic hides under the memory traffic.
 *
 * Batch invariance: every output y[t, o] is accumulated in the same order whatever n is (one
 * 8-lane fp32 accumulator over i in steps of 8, a fixed horizontal sum, then the scalar tail), so
 * a row's result does not depend on which other rows share the call. A k-token verification pass
 * therefore computes bit for bit what k one-token passes would compute in these layers.
 *
 * Shapes: x (n, in) fp32 row-major; w (out, in) bf16 row-major as uint16; y (n, out) fp32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

/* The exported functions, described once: specdec.kernels declares each to ctypes from the
 * prototypes that linear_bf16_interface() returns, which are the text of these rows, and the
 * compiler checks each definition against its row (the declarations below). */
#define BF16_EXPORTS(X)                                                                                             \
    X(int, specdec_avx2_available, (void))                                                                          \
    X(void, specdec_linear_bf16, (const float *x, const uint16_t *w, float *y, int64_t n, int64_t in, int64_t out,   \
                                  int threads))                                                                     \
    X(void, specdec_linear_i8, (const float *x, const int8_t *w, const float *scales, float *y, int64_t n,          \
                                int64_t in, int64_t out, int threads))                                              \
    X(void, specdec_attention, (const float *q, const float *k, const float *v, const uint8_t *visible, float *out, \
                                int64_t heads, int64_t kv_heads, int64_t nq, int64_t L, int64_t d,                  \
                                int64_t kv_stride, float scale, float *scores, int threads))

#define BF16_DECLARE(result, name, params) result name params;
BF16_EXPORTS(BF16_DECLARE)
#undef BF16_DECLARE

/* The interface as text: one line a function, its C prototype. */
#define BF16_PROTOTYPE(result, name, params) #result " " #name #params ";\n"
static const char bf16_interface[] = BF16_EXPORTS(BF16_PROTOTYPE);
#undef BF16_PROTOTYPE

const char *linear_bf16_interface(void) { return bf16_interface; }

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    s = _mm_add_ss(s, h);
    return _mm_cvtss_f32(s);
}

/* The shared finish: horizontal sum, then the tail in index order. */
static inline float finish(__m256 acc, const float *x, const uint16_t *w, int64_t from, int64_t in) {
    float s = hsum8(acc);
    for (int64_t i = from; i < in; i++) s += x[i] * bf16_to_f32(w[i]);
    return s;
}

/* The weights are walked in blocks of 4 rows; within a block, in slices of KC inputs, and every
 * group of (up to) 3 activation rows runs over a slice while it is in L1. A group's 4 x 3 partial sums
 * are parked in memory between slices (exact), so each output is one 8-lane accumulator over i
 * ascending whatever n is. The block PF blocks ahead is prefetched slice by slice, so reading the
 * weights from memory overlaps the arithmetic: with more than 3 rows the kernel is compute bound,
 * and without the overlap a 5-row call cost the 3-row memory pass plus a second pass. */
#define KC 128
#define PF 2
#define GROUPS 16 /* rows are taken up to 3 * GROUPS at a time */

static inline __attribute__((always_inline)) void slice(const float *x, const uint16_t *w, __m256 *park,
                                                        int64_t in, int64_t len, const int T) {
    __m256 acc[4][3];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 3
        for (int t = 0; t < T; t++) acc[r][t] = park[r * 3 + t];
    for (int64_t i = 0; i < len; i += 8) {
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256 v = load_bf16x8(w + r * in + i);
            #pragma GCC unroll 3
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * in + i), acc[r][t]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 3
        for (int t = 0; t < T; t++) park[r * 3 + t] = acc[r][t];
}

/* One weight row against one activation row (the ragged edge), in the same order. */
static float dot_1x1(const float *x, const uint16_t *w, int64_t in) {
    const int64_t in8 = in & ~(int64_t)7;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < in8; i += 8) a = _mm256_fmadd_ps(load_bf16x8(w + i), _mm256_loadu_ps(x + i), a);
    return finish(a, x, w, in8, in);
}

int specdec_avx2_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* n <= 3 * GROUPS rows in groups of 3, the remainder spread so that no group has 1 row when n > 1
 * (4 = 2 + 2): group g is rows first[g] .. first[g] + size[g] - 1. Returns the number of groups. */
static int64_t split_rows(int64_t n, int64_t *first, int64_t *size) {
    const int64_t groups = (n + 2) / 3, twos = n == 1 ? 0 : (3 - n % 3) % 3;
    for (int64_t g = 0, start = 0; g < groups; start += size[g], g++) {
        first[g] = start;
        size[g] = n == 1 ? 1 : g >= groups - twos ? 2 : 3;
    }
    return groups;
}

/* At most 3 * GROUPS rows of x. */
static void rows(const float *x, const uint16_t *w, float *y, int64_t n, int64_t in, int64_t out, int threads) {
    const int64_t blocks = out / 4, in8 = in & ~(int64_t)7;
    int64_t first[GROUPS], size[GROUPS];
    const int64_t groups = split_rows(n, first, size);
    #pragma omp parallel num_threads(threads)
    {
        __m256 park[12 * GROUPS];
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t o = 4 * b;
            const uint16_t *wb = w + o * in;
            for (int64_t j = 0; j < 12 * groups; j++) park[j] = _mm256_setzero_ps();
            for (int64_t i0 = 0; i0 < in8; i0 += KC) {
                const int64_t len = in8 - i0 < KC ? in8 - i0 : KC;
                if (b + PF < blocks)
                    for (int r = 0; r < 4; r++)
                        for (int64_t i = 0; i < len; i += 32)  /* 32 bf16 = one 64-byte line */
                            _mm_prefetch((const char *)(wb + PF * 4 * in + r * in + i0 + i), _MM_HINT_T0);
                for (int64_t g = 0; g < groups; g++) {
                    const float *xg = x + first[g] * in + i0;
                    if (size[g] == 3) slice(xg, wb + i0, park + 12 * g, in, len, 3);
                    else if (size[g] == 2) slice(xg, wb + i0, park + 12 * g, in, len, 2);
                    else slice(xg, wb + i0, park + 12 * g, in, len, 1);
                }
            }
            for (int64_t g = 0; g < groups; g++)
                for (int r = 0; r < 4; r++)
                    for (int t = 0; t < size[g]; t++) {
                        const int64_t row = first[g] + t;
                        y[row * out + o + r] = finish(park[12 * g + r * 3 + t], x + row * in, wb + r * in, in8, in);
                    }
        }
    }
    for (int64_t o = 4 * blocks; o < out; o++)
        for (int64_t t = 0; t < n; t++) y[t * out + o] = dot_1x1(x + t * in, w + o * in, in);
}

void specdec_linear_bf16(const float *x, const uint16_t *w, float *y, int64_t n, int64_t in, int64_t out,
                         int threads) {
    for (int64_t t = 0; t < n; t += 3 * GROUPS) {
        const int64_t m = n - t < 3 * GROUPS ? n - t : 3 * GROUPS;
        /* rows writes y with row stride out: offset x and y by whole rows */
        rows(x + t * in, w, y + t * out, m, in, out, threads);
    }
}

/* y = x @ (scale * q).T with int8 weights q and one fp32 scale per row per QG inputs: half the bytes
 * of bf16, for draft models, whose numerics never change the output law (the verifier corrects
 * for whatever the draft proposes). Same walk as the bf16 kernel; each QG-long slice is summed on
 * its own and added to the parked total times its scale.
 *
 * Shapes: x (n, in) fp32; q (out, in) int8; scales (out, in / QG) fp32; y (n, out) fp32; in % QG == 0.
 */
#define QG KC

static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __attribute__((always_inline)) void slice_i8(const float *x, const int8_t *w, const float *scale,
                                                           int64_t sstride, __m256 *park, int64_t in, const int T) {
    __m256 acc[4][3];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        #pragma GCC unroll 3
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < QG; i += 8) {
        #pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256 v = load_i8x8(w + r * in + i);
            #pragma GCC unroll 3
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * in + i), acc[r][t]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        const __m256 s = _mm256_set1_ps(scale[r * sstride]);
        #pragma GCC unroll 3
        for (int t = 0; t < T; t++) park[r * 3 + t] = _mm256_fmadd_ps(acc[r][t], s, park[r * 3 + t]);
    }
}

static void rows_i8(const float *x, const int8_t *w, const float *scales, float *y, int64_t n, int64_t in,
                    int64_t out, int threads) {
    const int64_t blocks = out / 4, ng = in / QG;
    int64_t first[GROUPS], size[GROUPS];
    const int64_t groups = split_rows(n, first, size);
    #pragma omp parallel num_threads(threads)
    {
        __m256 park[12 * GROUPS];
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks + (out % 4 ? 1 : 0); b++) {
            const int64_t o = 4 * b;
            const int R = out - o < 4 ? (int)(out - o) : 4;
            const int8_t *wb = w + o * in;
            for (int64_t j = 0; j < 12 * groups; j++) park[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < ng; c++) {
                const int64_t i0 = c * QG;
                if (b + PF < blocks)
                    for (int r = 0; r < 4; r++)
                        for (int64_t i = 0; i < QG; i += 64) _mm_prefetch((const char *)(wb + PF * 4 * in + r * in + i0 + i), _MM_HINT_T0);
                for (int64_t g = 0; g < groups; g++) {
                    const float *xg = x + first[g] * in + i0;
                    const float *sc = scales + o * ng + c;
                    if (R < 4) {  /* the ragged edge: one row at a time, one token at a time */
                        for (int r = 0; r < R; r++)
                            for (int t = 0; t < size[g]; t++) {
                                __m256 a = _mm256_setzero_ps();
                                for (int64_t i = 0; i < QG; i += 8)
                                    a = _mm256_fmadd_ps(load_i8x8(wb + r * in + i0 + i), _mm256_loadu_ps(xg + t * in + i), a);
                                park[12 * g + r * 3 + t] = _mm256_fmadd_ps(a, _mm256_set1_ps(sc[r * ng]), park[12 * g + r * 3 + t]);
                            }
                    } else if (size[g] == 3) slice_i8(xg, wb + i0, sc, ng, park + 12 * g, in, 3);
                    else if (size[g] == 2) slice_i8(xg, wb + i0, sc, ng, park + 12 * g, in, 2);
                    else slice_i8(xg, wb + i0, sc, ng, park + 12 * g, in, 1);
                }
            }
            for (int64_t g = 0; g < groups; g++)
                for (int r = 0; r < R; r++)
                    for (int t = 0; t < size[g]; t++) y[(first[g] + t) * out + o + r] = hsum8(park[12 * g + r * 3 + t]);
        }
    }
}

void specdec_linear_i8(const float *x, const int8_t *w, const float *scales, float *y, int64_t n, int64_t in,
                       int64_t out, int threads) {
    for (int64_t t = 0; t < n; t += 3 * GROUPS) {
        const int64_t m = n - t < 3 * GROUPS ? n - t : 3 * GROUPS;
        rows_i8(x + t * in, w, scales, y + t * out, m, in, out, threads);
    }
}

/* Attention for a few query rows, batch invariant: each query row's output depends only on its own
 * query and the keys and values it may see, taken in cache order, never on the other rows.
 * A row computes exactly what a one-token decoding step at its position computes.
 *
 * q (heads, nq, d) fp32 contiguous; k and v (kv_heads, L, d) fp32, each head's L keys contiguous and
 * kv_stride floats apart from the next head's (L * d when packed; more for a preallocated cache);
 * visible (nq, L) bytes, 1 = the row sees that key, or NULL for every row seeing every key;
 * out (nq, heads, d) fp32.
 * Head h reads kv head h / (heads / kv_heads). scores: a scratch of threads * L floats.
 */
#include <math.h>

static inline float dot_f32(const float *a, const float *b, int64_t d) {
    const int64_t d8 = d & ~(int64_t)7;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (int64_t i = d8; i < d; i++) s += a[i] * b[i];
    return s;
}

void specdec_attention(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                       int64_t heads, int64_t kv_heads, int64_t nq, int64_t L, int64_t d, int64_t kv_stride,
                       float scale, float *scores, int threads) {
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t job = 0; job < heads * nq; job++) {
        const int64_t h = job / nq, row = job % nq;
        const float *qr = q + (h * nq + row) * d;
        const float *kh = k + (h / group) * kv_stride, *vh = v + (h / group) * kv_stride;
        const uint8_t *vis = visible ? visible + row * L : NULL;
        float *s = scores + (int64_t)omp_get_thread_num() * L;
        float *o = out + (row * heads + h) * d;
        float best = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            if (vis && !vis[j]) continue;
            s[j] = dot_f32(qr, kh + j * d, d) * scale;
            if (s[j] > best) best = s[j];
        }
        float total = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            if (vis && !vis[j]) continue;
            s[j] = expf(s[j] - best);
            total += s[j];
        }
        for (int64_t x = 0; x < d; x++) o[x] = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            if (vis && !vis[j]) continue;
            const float p = s[j] / total;
            const float *vj = vh + j * d;
            for (int64_t x = 0; x < d; x++) o[x] += p * vj[x];
        }
    }
}
