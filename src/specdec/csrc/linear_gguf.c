/* Batch-invariant matrix products on GGUF (ggml) quantized weights, and the few per-row helpers a
 * llama, qwen2, qwen3 and gemma3 forward pass needs around them (specdec.backends.gguf).
 *
 * y[r, j] = sum_i W[j, i] * x[r, i] for a pass of n_rows rows of x. Each weight block is read from
 * memory once per pass and applied to every row, so a pass costs one row's memory time plus each
 * row's arithmetic (docs/kernels.md, "Row cost"). Each output element is computed by exactly the same
 * sequence of floating-point operations whatever n_rows is and wherever the row sits in the pass:
 *
 *   - the activation row is quantized on its own (a per-row operation): to 8-bit blocks of 256 with
 *     one fp32 scale and sums of 16 (for the K types and IQ4_XS; llama.cpp's Q8_K), or of 32 with
 *     one fp32 scale and their sum (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; like llama.cpp's
 *     Q8_0 / Q8_1, with an fp32 scale);
 *   - for Q2_K, Q3_K, Q4_K, Q5_K and IQ4_XS, inside a weight block the products (each times its
 *     sub-block's integer scale) are integers, summed exactly (their order is irrelevant) into one
 *     integer, and so are the correction terms: Q2_K's, Q4_K's and Q5_K's mins (the sum over
 *     sub-blocks of m * the sum of its activations), Q3_K's offset (4 * the sum over sub-blocks of
 *     scale * the sum of its 16 activations, taken off the products' sum; IQ4_XS has none); blocks
 *     in order 0, 1, 2, ... then go into one fp32 accumulator per output: acc += (d * dx) * sum (one
 *     fused multiply-add; d the weight block's scale, dx the activation block's), then
 *     acc -= (dmin * dx) * mins (a second one, where there are mins); then the bias and the
 *     residual (if asked), in that order. (The vector kernels take 8 outputs at a time, a lane
 *     each, on rows repacked eight at a time: gguf_repack.)
 *   - for Q6_K, inside a weight block the products are integers, summed exactly into 8 integer
 *     lanes: lane l holds the products of the elements e with (e % 32) / 4 == l, times the
 *     sub-block's integer scale. The block's offset term is an integer too, lane l taking those of
 *     the sums of 16 activations number 2l and 2l + 1 (32 * scale * sum, subtracted from the lane);
 *     each block then adds its lanes, converted to float, into 8 fp32 lane accumulators, blocks in
 *     order: lane += (d * dx) * lanes;
 *   - the 8 lanes are summed in a fixed tree ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the bias
 *     and the residual (if asked) are added, in that order;
 *   - for the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) a block's products are summed
 *     exactly into one integer (Q4_0's and Q5_0's offset 8, 16 taken off as offset * the
 *     activation block's sum), added into one fp32 accumulator per output, blocks in order:
 *     acc += (d * dx) * sum (one fused multiply-add); Q4_1's and Q5_1's min terms go, in block
 *     order, into a second: s += (m * dx) * (the activation block's sum); then acc (+ s), the bias
 *     and the residual, in that order. (The vector kernels take 8 outputs at a time, a lane each,
 *     on rows repacked eight at a time: gguf_repack.)
 * Float weights (F32, F16, BF16) multiply the fp32 rows directly: 8 fp32 lanes (lane l: elements
 * i % 8 == l, in order), the same tree, then the tail in order.
 *
 * Threads split the OUTPUT elements j (chunks of weight rows, handed out as threads ask); the
 * reduction over i is never split, so neither the thread count nor the split changes a result. The AVX2 path and the portable scalar
 * path (gguf_set_path(P_PORTABLE); what a CPU without AVX2 runs) run the same operations: the scalar path
 * keeps the 8 lanes in arrays and uses fmaf where the vector path fuses, so they agree bit for bit.
 * Build with -ffp-contract=off (the scalar path must not fuse what the vector path rounds twice).
 *
 * Block layouts (ggml-common.h; sizes in bytes; fp16 scales; element e of a block):
 *   Q4_0 (32, 18): d, qs[16]; w = d * (q - 8), q = low nibble of qs[e] (e < 16) or high of qs[e-16]
 *   Q4_1 (32, 20): d, m, qs[16]; w = d * q + m
 *   Q8_0 (32, 34): d, int8 qs[32]; w = d * q
 *   Q4_K (256, 144): d, dmin, scales[12] (8 six-bit scales and mins), qs[128]; sub-block s of 32
 *        (s = 2k + h) is the low (h = 0) or high (h = 1) nibbles of qs[32k .. 32k + 31];
 *        w = d * sc[s] * q - dmin * m[s]
 *   Q6_K (256, 210): ql[128], qh[64], int8 scales[16], d; in half h (128 elements), element
 *        32s + i (s = 0..3) has low bits from ql[64h + 32(s & 1) + i] (low nibble for s < 2, else
 *        high) and two high bits (qh[32h + i] >> 2s) & 3; w = d * scales[e / 16] * (q - 32)
 *   Q5_1 (32, 24): d, m, qh (32 bits), qs[16]; q = Q4_1's nibble | bit e of qh << 4; w = d * q + m
 *   IQ4_NL (32, 18): d, qs[16]; Q4_0's nibbles, w = d * kv_iq4[q]
 *   Q2_K (256, 84): scales[16] (scale | min << 4, one per 16), qs[64], d, dmin; element
 *        128h + 32j + i is (qs[32h + i] >> 2j) & 3; w = d * sc * q - dmin * m
 *   Q3_K (256, 110): hmask[32], qs[64], scales[12] (16 six-bit, q3k_scales), d; element
 *        128h + 32j + i has the two bits (qs[32h + i] >> 2j) & 3 and a third, bit 4h + j of
 *        hmask[i], as 4; w = d * (scale - 32) * (q - 4)
 *   Q5_K (256, 176): d, dmin, scales[12] (as Q4_K), qh[32], qs[128]; Q4_K's nibbles, and bit s of
 *        qh[i] as 16 in element i of sub-block s; w = d * sc[s] * q - dmin * m[s]
 *   IQ4_XS (256, 136): d, scales_h (16 bits), scales_l[4], qs[128]; sub-block s of 32 is the low,
 *        then the high nibbles of qs[16s ..]; w = d * (scale[s] - 32) * kv_iq4[q] (iq4xs_scales)
 */
/* The file is read three ways. As itself (neither GG_COPY nor GG_KERNEL_BODY defined): what every
 * path shares, the run-time choice of the path, and the exported functions. As one copy of the
 * computing code (GG_COPY(name) naming its functions), included twice: once under GCC's target
 * pragma for AVX2 + FMA + F16C (x86-64 only), once without it (the portable path), so that one
 * build runs on any CPU and the CPU is detected in one place, gguf_cpu_paths. As one vector path's
 * kernels (GG_KERNEL_BODY), included by the AVX2 copy once per vector path. */
#if !defined(GG_COPY) && !defined(GG_KERNEL_BODY)
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* GG_X86: the AVX2 copy is compiled (GG_PORTABLE_ONLY: a build of the portable path alone, what
 * another CPU family compiles). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(GG_PORTABLE_ONLY)
#include <cpuid.h>
#include <immintrin.h>
#define GG_X86 1
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30
};

/* The types multiplied against activations quantized in blocks of 256 (Q8_K-like), and in blocks of 32. */
static inline int is_k(int t) { return t == T_Q2_K || t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_IQ4_XS; }
static inline int is_32(int t) { return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_IQ4_NL; }
/* The 256-weight types whose products sum a block into one integer per output and whose vector
 * kernels take 8 outputs at a time, like the 32-weight types (rows repacked eight at a time). */
static inline int is_k8(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_IQ4_XS || t == T_Q2_K || t == T_Q3_K; }
static inline int in_groups(int t) { return is_32(t) || is_k8(t); } /* the vector kernels take outputs 8 at a time */

/* A grouped type's id with this bit set: the tensor's rows repacked eight at a time (gguf_repack,
 * the layout below "rows repacked eight at a time"). */
#define GG_X8 0x100
static inline int is_x8(int t) { return (t & GG_X8) && in_groups(t & ~GG_X8); }
static inline int base_type(int t) { return is_x8(t) ? t & ~GG_X8 : t; }

/* IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml's kvalues_iq4nl), indexed by a nibble. */
static const int8_t kv_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#define RT 16 /* rows applied to one decoded weight block before the next tile of rows */
#define AMX_BLOCK 64 /* the AMX path's rows on one decoding of the weights (Q4_K: four tiles of 16) */
#define CHUNK_BYTES 262144 /* weights per unit of work handed to a thread (long runs: the prefetchers stream) */

/* The KV cache's element: fp32, or fp16 in a build with -DGG_KV_F16 (keys and values rounded to
 * the nearest fp16 as they are stored, read back exactly). */
#ifdef GG_KV_F16
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif

/* ---------------------------------------------------------------------------------------------- */
/* the interface: described once, here */

/* The exported functions. specdec.kernels declares each one to ctypes from the prototypes
 * that gguf_interface() returns, which are the text of these rows; the compiler checks each
 * function against its row (the declarations below, and the dispatchers generated from it). A row:
 * how it is defined (F: once, in this file; V, R: a function of the computing code, dispatched to
 * the copy of the path that runs, V returning void and R a value), the result, the name, the
 * parameters, the arguments as the dispatcher passes them on. */
#define GG_EXPORTS(X)                                                                                               \
    X(F, int, gguf_cpu_paths, (void), ())                                                                           \
    X(F, int, gguf_set_path, (int p), ())                                                                           \
    X(F, int, gguf_path, (void), ())                                                                                \
    X(F, int, gguf_avx2_compiled, (void), ())                                                                       \
    X(F, int, gguf_type_supported, (int type), ())                                                                  \
    X(F, int64_t, gguf_row_bytes, (int type, int64_t n_in), ())                                                     \
    X(F, int, gguf_get_rows, (int type, const uint8_t *w, int64_t n_in, const int64_t *ids, int64_t n, float *out), ()) \
    X(F, int, gguf_repacked_type, (int type), ())                                                                   \
    X(F, int64_t, gguf_repacked_bytes, (int type, int64_t n_out, int64_t n_in), ())                                 \
    X(F, int, gguf_repack, (int type, const uint8_t *w, int64_t n_out, int64_t n_in, uint8_t *out), ())             \
    X(V, void, gguf_quantize_rows, (const float *x, int64_t n_rows, int64_t n_in, int block, int8_t *q, float *d),   \
      (x, n_rows, n_in, block, q, d))                                                                               \
    X(R, int, gguf_matmul_multi, (int n_seg, const int32_t *types, const uint64_t *weights, const int64_t *n_outs,  \
      const uint64_t *biases, int64_t n_in, const float *x, int64_t n_rows, float *y, int64_t ldy, int accumulate,  \
      int n_threads), (n_seg, types, weights, n_outs, biases, n_in, x, n_rows, y, ldy, accumulate, n_threads))      \
    X(R, int, gguf_matmul, (int type, const uint8_t *w, int64_t n_out, int64_t n_in, const float *x, int64_t n_rows, \
      float *y, int accumulate, int n_threads), (type, w, n_out, n_in, x, n_rows, y, accumulate, n_threads))        \
    X(V, void, gguf_rmsnorm, (const float *x, const float *w, int64_t n_rows, int64_t dim, float eps, float *out),  \
      (x, w, n_rows, dim, eps, out))                                                                                \
    X(V, void, gguf_exp, (const float *x, int64_t n, float *y), (x, n, y))                                          \
    X(V, void, gguf_glu, (const float *gu, int64_t n_rows, int64_t ff, float *out, int act, int n_threads),          \
      (gu, n_rows, ff, out, act, n_threads))                                                                        \
    X(V, void, gguf_gelu, (const float *x, int64_t n, float *y), (x, n, y))                                         \
    X(V, void, gguf_rope_store, (const float *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,      \
      int neox, int64_t n, int64_t H, int64_t KV, int64_t d, float *q_out, kv_t *k_cache, kv_t *v_cache,            \
      int64_t cap, int64_t start), (qkv, pos, cos_t, sin_t, neox, n, H, KV, d, q_out, k_cache, v_cache, cap, start)) \
    X(R, int, gguf_attention, (const float *q, const kv_t *k, const kv_t *v, const uint8_t *visible, float *out,     \
      int64_t H, int64_t KV, int64_t n, int64_t L, int64_t d, int64_t cap, float scale, const int64_t *qpos,        \
      const int64_t *kpos, int64_t window, int n_threads),                                                          \
      (q, k, v, visible, out, H, KV, n, L, d, cap, scale, qpos, kpos, window, n_threads))                           \
    X(R, int, gguf_forward_seqs, (const int64_t *layers, int64_t n_layers, int64_t hidden, int64_t heads,           \
      int64_t kv, int64_t d, int64_t ffn, int neox, int act, int64_t cap, float eps, float scale, float *x,         \
      int64_t n, const int64_t *pos, int64_t n_seq, const int64_t *rows_of, const uint64_t *visibles,               \
      const uint64_t *caches, const int64_t *starts, const uint64_t *kposes, float *scratch, int threads),          \
      (layers, n_layers, hidden, heads, kv, d, ffn, neox, act, cap, eps, scale, x, n, pos, n_seq, rows_of,         \
       visibles, caches, starts, kposes, scratch, threads))

/* One layer's record for gguf_forward_seqs: int64 fields in this order (name, count), 0 where a
 * layer has no such tensor. The Python side builds each record by these names (gguf_interface). */
#define GG_LAYER(F)                                                                                                 \
    F(qkv_type, 3) F(qkv_ptr, 3) F(qkv_out, 3) F(qkv_bias, 3) /* Q, K, V: ggml types, weights, widths, fp32 biases */ \
    F(o_type, 1) F(o_ptr, 1) F(o_out, 1)                                                                            \
    F(gu_type, 2) F(gu_ptr, 2) F(gu_out, 2) /* gate, up */                                                          \
    F(down_type, 1) F(down_ptr, 1) F(down_out, 1)                                                                   \
    F(norm1, 1) F(norm2, 1)                                                                                         \
    F(q_norm, 1) F(k_norm, 1) /* fp32 [d]: RMSNorm of each head of Q and of K before RoPE (qwen3, gemma3) */        \
    F(post1, 1) F(post2, 1) /* fp32 [hidden]: RMSNorm of the attention's and the FFN's output before the residual add (gemma3) */ \
    F(cos, 1) F(sin, 1)     /* fp32 [cap, d / 2]: the layer's RoPE tables (gemma3's local and global layers differ) */ \
    F(window, 1)            /* > 0: the layer's rows see only keys within this many positions (sliding window) */

#define GG_FIELD_ENUM(name, count) L_##name, L_##name##_last = L_##name + (count)-1,
enum { GG_LAYER(GG_FIELD_ENUM) L_FIELDS };
#undef GG_FIELD_ENUM

#define GG_DECLARE(how, result, name, params, args) result name params;
GG_EXPORTS(GG_DECLARE)
#undef GG_DECLARE

/* The interface as text: one line a function (its C prototype), one a layer field ("field NAME COUNT"). */
#define GG_PROTOTYPE(how, result, name, params, args) #result " " #name #params ";\n"
#define GG_FIELD_LINE(name, count) "field " #name " " #count "\n"
static const char g_interface[] = GG_EXPORTS(GG_PROTOTYPE) GG_LAYER(GG_FIELD_LINE);
#undef GG_PROTOTYPE
#undef GG_FIELD_LINE

const char *gguf_interface(void) { return g_interface; }

/* ---------------------------------------------------------------------------------------------- */
/* dispatch */

/* The paths, chosen at run time by what the CPU reports (gguf_cpu_paths, the one detection) unless
 * set (gguf_set_path): the portable C; AVX2 + FMA + F16C; and the same with the integer products of
 * the quantized types done by VNNI instructions, in their AVX512-VNNI form (256-bit, with AVX512VL)
 * or their AVX-VNNI form; and the 512-bit VNNI path with Intel's AMX tile products for Q4_K passes
 * of many rows (where the OS grants the tiles: amx_usable). Every path gives the same bits: a VNNI
 * instruction or a tile product forms the same exact integers as the AVX2 instructions it replaces,
 * and the float operations are the AVX2 path's. */
enum { P_PORTABLE = 0, P_AVX2 = 1, P_AVX512VNNI = 2, P_AVXVNNI = 3, P_AMX = 4, N_PATHS = 5 };

#if defined(GG_X86) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && !defined(GG_NO_VNNI) && !defined(GG_EMULATE_VNNI)
#define GG_VNNI 1 /* the VNNI kernels are compiled (per function, with GCC's target pragmas) */
#if defined(__linux__) && defined(__x86_64__) && !defined(GG_NO_AMX)
#define GG_AMX 1 /* and the AMX path (the avx512vnni path with Intel's tile products for passes of several rows) */
#endif
#endif

#ifdef GG_AMX
/* Whether this process may run AMX tile instructions: the CPU has AMX-TILE and AMX-INT8 (CPUID leaf
 * 7), the OS saves the tile state (XCR0 bits 17 and 18), and Linux granted this process the tile
 * data (arch_prctl ARCH_REQ_XCOMP_PERM, which a process must ask for before its first tile
 * instruction: without it the instruction faults, as it does in a virtual machine that lists AMX). */
static int amx_usable(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return 0;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
#endif

static int g_path = -1; /* the path the kernels run; -1: not chosen yet (the best this CPU has) */

/* Bit p set: this build has path p and this CPU can run it. */
int gguf_cpu_paths(void) {
    int paths = 1 << P_PORTABLE;
#ifdef GG_X86
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    const int f16c = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1);
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)) return paths;
    paths |= 1 << P_AVX2;
#ifdef GG_VNNI
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
        paths |= 1 << P_AVX512VNNI;
    if (__builtin_cpu_supports("avxvnni")) paths |= 1 << P_AVXVNNI;
#endif
#ifdef GG_AMX
    static int amx = -1; /* asked once: the permission is the process's */
    if (amx < 0) amx = amx_usable();
    if (amx && ((paths >> P_AVX512VNNI) & 1)) paths |= 1 << P_AMX;
#endif
#endif
#ifdef GG_EMULATE_VNNI
    paths |= 1 << P_AVX512VNNI; /* a test build: the VNNI instructions emulated (SIMDe), any AVX2 CPU runs it */
#endif
    return paths;
}

/* Run path p from now on (-1: the best this CPU has). Returns 0, or -1 where the CPU or the build lacks it. */
int gguf_set_path(int p) {
    const int paths = gguf_cpu_paths();
    if (p < 0) {
        p = P_PORTABLE;
        for (int q = P_AVX2; q < N_PATHS; q++) /* the VNNI forms are alike: the 512-bit one where both */
            if ((paths >> q) & 1 && !(q == P_AVXVNNI && ((paths >> P_AVX512VNNI) & 1))) p = q;
    }
    if (p >= N_PATHS || !((paths >> p) & 1)) return -1;
    g_path = p;
    return 0;
}

int gguf_path(void) {
    if (g_path < 0) gguf_set_path(-1);
    return g_path;
}

int gguf_avx2_compiled(void) {
#ifdef GG_X86
    return 1;
#else
    return 0;
#endif
}

static int vec(void) { return gguf_path() != P_PORTABLE; } /* every vector path runs the AVX2 copy (the AVX2 code outside the products) */

/* ---------------------------------------------------------------------------------------------- */
/* scalars */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* fp16 -> fp32, exact (subnormals, inf, nan included). */
static inline float f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normal = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormal = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormal) : f32_bits(normal)));
}

static inline float bf16(const uint8_t *p) { return bits_f32((uint32_t)(p[0] | (p[1] << 8)) << 16); }

/* fp32 -> fp16, rounded to nearest even (ggml's fp32_to_fp16: subnormals, inf, nan included). */
static inline uint16_t f16_of(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

#ifdef GG_KV_F16
static inline kv_t kv_put(float x) { return f16_of(x); }
static inline float kv_get(kv_t h) { const uint8_t p[2] = {(uint8_t)h, (uint8_t)(h >> 8)}; return f16(p); }
#else
static inline kv_t kv_put(float x) { return x; }
static inline float kv_get(kv_t x) { return x; }
#endif

/* The fixed reduction tree of 8 lanes. */
static inline float tree8(const float a[8]) {
    const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    const float c0 = b0 + b2, c1 = b1 + b3;
    return c0 + c1;
}


static inline void store(float *y, float v, const float *bias, int64_t j, int accumulate) {
    if (bias) v = v + bias[j];
    if (accumulate) v = *y + v;
    *y = v;
}

/* Q4_K's six-bit scales and mins of the 8 sub-blocks (as get_scale_min_k4). */
static inline void q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q3_K's 16 six-bit scales, minus 32 (12 bytes: the low nibbles of sub-blocks 0..7 in bytes 0..7,
 * those of 8..15 in their high nibbles; the two high bits of sub-block s in byte 8 + s % 4 at bit
 * 2 (s / 4)). As ggml's, on 32-bit words. */
static inline void q3k_scales(const uint8_t *s, int8_t sc[16]) {
    uint32_t a[3], u[4];
    memcpy(a, s, 12);
    u[0] = (a[0] & 0x0f0f0f0fu) | ((a[2] & 0x03030303u) << 4);
    u[1] = (a[1] & 0x0f0f0f0fu) | (((a[2] >> 2) & 0x03030303u) << 4);
    u[2] = ((a[0] >> 4) & 0x0f0f0f0fu) | (((a[2] >> 4) & 0x03030303u) << 4);
    u[3] = ((a[1] >> 4) & 0x0f0f0f0fu) | (((a[2] >> 6) & 0x03030303u) << 4);
    memcpy(sc, u, 16);
    for (int v = 0; v < 16; v++) sc[v] = (int8_t)(sc[v] - 32);
}

/* IQ4_XS's 8 six-bit scales, minus 32: the low nibbles in bytes 4..7 (two a byte), the two high
 * bits of sub-block s at bit 2s of the 16-bit word at byte 2. */
static inline void iq4xs_scales(const uint8_t *blk, int16_t sc[8]) {
    const unsigned hi = (unsigned)(blk[2] | (blk[3] << 8));
    for (int v = 0; v < 8; v++) sc[v] = (int16_t)((((blk[4 + v / 2] >> (4 * (v & 1))) & 0xF) | (((hi >> (2 * v)) & 3) << 4)) - 32);
}

/* ---------------------------------------------------------------------------------------------- */
/* block geometry */

static int block_elems(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_IQ4_NL: return 18;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_IQ4_XS: return 136;
    default: return 0;
    }
}

int gguf_type_supported(int type) { return block_elems(base_type(type)) > 0; }

/* Bytes of one weight row of n_in elements, or -1 (unsupported type, or n_in not whole blocks). */
int64_t gguf_row_bytes(int type, int64_t n_in) {
    type = base_type(type);
    const int be = block_elems(type);
    if (be == 0 || n_in <= 0 || n_in % be) return -1;
    return n_in / be * block_bytes(type);
}

/* ---------------------------------------------------------------------------------------------- */
/* rows repacked eight at a time (the 32-weight types, Q2_K, Q3_K, Q4_K, Q5_K and IQ4_XS)
 *
 * Output rows 8g .. 8g + 7 of a tensor (a group) are stored together, block by block: block b of
 * the group (its eight rows' blocks b, 8 * bb bytes, bb the type's block bytes) is one record at
 * byte (g * nb + b) * 8 * bb (nb blocks a row), so a group is 8 rows' bytes and a tensor whose row
 * count is not a multiple of 8 ends in a group padded with rows of zero bytes. In a record, with
 * k = 0..7 the row of the group and i = 0..3:
 *   d of row k at 2k (fp16), and Q4_1's and Q5_1's m at 16 + 2k;
 *   Q5_0's and Q5_1's high bits at 16 (Q5_1: 32), 32 bytes: byte 4k + i has, at bit v, bit 4v + i
 *     of row k's qh (the fifth bit of element 4v + i);
 *   the nibbles (Q4_0, IQ4_NL at 16; Q4_1 at 32; Q5_0 at 48; Q5_1 at 64), 128 bytes: byte
 *     32u + 4k + i is row k's qs[4u + i] (u = 0..3): low nibble element 4u + i, high 16 + 4u + i;
 *   Q8_0's values at 16, 256 bytes: byte 32v + 4k + i is row k's element 4v + i (v = 0..7).
 * So the 32 bytes at 32u are, in 32-bit lane k, four consecutive elements of row k: one vector
 * multiplies eight outputs by the same four activations (the vector kernels' layout).
 *
 * Q4_K and Q5_K the same way, a record being block b of the eight rows (8 * 144, 8 * 176 bytes):
 *   d of row k at 2k, dmin at 16 + 2k;
 *   the scales at 32, 96 bytes: byte 32 + 8i + k is row k's scales[i] (i = 0..11);
 *   Q5_K's high bits at 128, 256 bytes: byte 32q + 4k + i is row k's qh[4q + i] (q = 0..7);
 *   the nibbles at 128 (Q5_K: 384), 1024 bytes: byte 32(8p + q) + 4k + i is row k's
 *     qs[32p + 4q + i] (p = 0..3, q = 0..7): low nibble element 64p + 4q + i (sub-block 2p), high
 *     64p + 32 + 4q + i (sub-block 2p + 1).
 *
 * IQ4_XS the same way (8 * 136 bytes):
 *   d of row k at 2k, its scales_h (16 bits) at 16 + 2k, its scales_l at 32 + 4k (4 bytes);
 *   the nibbles at 64, 1024 bytes: byte 32(4s + q) + 4k + i is row k's qs[16s + 4q + i] (s = 0..7,
 *     q = 0..3): low nibble element 32s + 4q + i, high 32s + 16 + 4q + i (both sub-block s).
 * So vector u = 8p + q (Q4_K, Q5_K) or 4s + q (IQ4_XS) of a record is the 32 bytes at 32u of its
 * nibbles.
 *
 * Q2_K (8 * 84 bytes): d at 2k, dmin at 16 + 2k; scales[g] (g = 0..15) at 32 + 8g + k; qs at 160:
 *     byte 32u + 4k + i is row k's qs[4u + i] (u = 8h + q = 0..15), whose bits 2j .. 2j + 1 are
 *     element 128h + 32j + 4q + i.
 * Q3_K (8 * 110 bytes): d at 2k; scales[i] (i = 0..11) at 16 + 8i + k; hmask at 112: byte
 *     32q + 4k + i is row k's hmask[4q + i]; qs at 368, as Q2_K's. */

/* The quantized values in a record, and (Q4_K, Q5_K, IQ4_XS) in a block of the file's layout. */
static inline int k8_qs_at(int type) {
    return type == T_Q5_K ? 384 : type == T_IQ4_XS ? 64 : type == T_Q2_K ? 160 : type == T_Q3_K ? 368 : 128;
}
static inline int k8_qs_file(int type) { return type == T_Q5_K ? 48 : type == T_IQ4_XS ? 8 : 16; }

/* Row k's block (the file's layout, blk) into record rec, or (unpack) back. */
static void k8_move(int type, uint8_t *rec, int k, uint8_t *blk, int unpack) {
#define K8_MOVE(rec_at, blk_at, n) (unpack ? memcpy(blk + (blk_at), rec + (rec_at), n) : memcpy(rec + (rec_at), blk + (blk_at), n))
    if (type == T_Q2_K) {
        K8_MOVE(2 * k, 80, 2);
        K8_MOVE(16 + 2 * k, 82, 2);
        for (int g = 0; g < 16; g++) K8_MOVE(32 + 8 * g + k, g, 1);
        for (int u = 0; u < 16; u++) K8_MOVE(160 + 32 * u + 4 * k, 16 + 4 * u, 4);
        return;
    }
    if (type == T_Q3_K) {
        K8_MOVE(2 * k, 108, 2);
        for (int i = 0; i < 12; i++) K8_MOVE(16 + 8 * i + k, 96 + i, 1);
        for (int q = 0; q < 8; q++) K8_MOVE(112 + 32 * q + 4 * k, 4 * q, 4);
        for (int u = 0; u < 16; u++) K8_MOVE(368 + 32 * u + 4 * k, 32 + 4 * u, 4);
        return;
    }
    K8_MOVE(2 * k, 0, 2);
    K8_MOVE(16 + 2 * k, 2, 2);
    if (type == T_IQ4_XS) K8_MOVE(32 + 4 * k, 4, 4);
    else
        for (int i = 0; i < 12; i++) K8_MOVE(32 + 8 * i + k, 4 + i, 1);
    if (type == T_Q5_K)
        for (int q = 0; q < 8; q++) K8_MOVE(128 + 32 * q + 4 * k, 16 + 4 * q, 4);
    for (int u = 0; u < 32; u++) K8_MOVE(k8_qs_at(type) + 32 * u + 4 * k, k8_qs_file(type) + 4 * u, 4);
#undef K8_MOVE
}

static inline int x8_at(int type, int what) { /* what: 0 the nibbles (Q8_0's values), 1 the high bits */
    if (what == 1) return type == T_Q5_1 ? 32 : 16;
    return type == T_Q4_1 ? 32 : type == T_Q5_0 ? 48 : type == T_Q5_1 ? 64 : 16;
}

static inline int qs_at(int type) { /* the nibbles (Q8_0's values) in a block of the file's layout */
    return type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : type == T_Q5_1 ? 8 : 2;
}

/* Row k's block of record rec, in the file's layout, written to blk. */
static void x8_unpack(int type, const uint8_t *rec, int k, uint8_t *blk) {
    if (is_k8(type)) {
        k8_move(type, (uint8_t *)rec, k, blk, 1);
        return;
    }
    memcpy(blk, rec + 2 * k, 2);
    if (type == T_Q4_1 || type == T_Q5_1) memcpy(blk + 2, rec + 16 + 2 * k, 2);
    const uint8_t *q = rec + x8_at(type, 0);
    uint8_t *qs = blk + qs_at(type);
    for (int v = 0; v < (type == T_Q8_0 ? 8 : 4); v++) memcpy(qs + 4 * v, q + 32 * v + 4 * k, 4);
    if (type == T_Q5_0 || type == T_Q5_1) {
        const uint8_t *h = rec + x8_at(type, 1) + 4 * k;
        uint32_t qh = 0;
        for (int v = 0; v < 8; v++)
            for (int i = 0; i < 4; i++) qh |= (uint32_t)((h[i] >> v) & 1) << (4 * v + i);
        memcpy(qs - 4, &qh, 4);
    }
}

/* The records of one group: rows w, w + row_bytes, ... (n of them, 1..8; the others zeros), nb blocks each. */
static void x8_pack(int type, const uint8_t *w, int64_t row_bytes, int n, int64_t nb, uint8_t *out) {
    const int bb = block_bytes(type);
    memset(out, 0, (size_t)(8 * row_bytes));
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *rec = out + b * 8 * bb;
        for (int k = 0; k < n; k++) {
            const uint8_t *blk = w + k * row_bytes + b * bb;
            if (is_k8(type)) {
                k8_move(type, rec, k, (uint8_t *)blk, 0);
                continue;
            }
            memcpy(rec + 2 * k, blk, 2);
            if (type == T_Q4_1 || type == T_Q5_1) memcpy(rec + 16 + 2 * k, blk + 2, 2);
            const uint8_t *qs = blk + qs_at(type);
            uint8_t *q = rec + x8_at(type, 0);
            for (int v = 0; v < (type == T_Q8_0 ? 8 : 4); v++) memcpy(q + 32 * v + 4 * k, qs + 4 * v, 4);
            if (type == T_Q5_0 || type == T_Q5_1) {
                uint32_t qh;
                memcpy(&qh, qs - 4, 4);
                uint8_t *h = rec + x8_at(type, 1) + 4 * k;
                for (int i = 0; i < 4; i++) {
                    uint8_t byte = 0;
                    for (int v = 0; v < 8; v++) byte |= (uint8_t)(((qh >> (4 * v + i)) & 1) << v);
                    h[i] = byte;
                }
            }
        }
    }
}

/* The id of `type` repacked (type | GG_X8), or -1 where the type has no such layout. */
int gguf_repacked_type(int type) { return in_groups(type) ? type | GG_X8 : -1; }

/* Bytes of a repacked tensor of n_out rows (a multiple of 8 rows), or -1. */
int64_t gguf_repacked_bytes(int type, int64_t n_out, int64_t n_in) {
    const int64_t rb = gguf_row_bytes(type, n_in);
    if (!in_groups(base_type(type)) || rb < 0 || n_out <= 0) return -1;
    return (n_out + 7) / 8 * 8 * rb;
}

/* out (gguf_repacked_bytes of them) = the n_out rows of w (the file's layout) repacked eight at a
 * time. Returns 0, or -1 (a type without the layout, bad shape). */
int gguf_repack(int type, const uint8_t *w, int64_t n_out, int64_t n_in, uint8_t *out) {
    const int64_t rb = gguf_row_bytes(type, n_in);
    if (!in_groups(type) || rb < 0 || n_out <= 0) return -1;
    for (int64_t j = 0; j < n_out; j += 8)
        x8_pack(type, w + j * rb, rb, n_out - j < 8 ? (int)(n_out - j) : 8, n_in / block_elems(type), out + j * rb);
    return 0;
}

/* Block b of row j of a grouped type's tensor in the file's layout: where it lies, or (repacked)
 * tmp (block_bytes(type) of them), where it is reassembled. */
static inline const uint8_t *block_at(int type, int x8, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t b,
                                       uint8_t *tmp) {
    const int bb = block_bytes(type);
    if (!x8) return w + j * row_bytes + b * bb;
    x8_unpack(type, w + (j & ~(int64_t)7) * row_bytes + b * 8 * bb, (int)(j & 7), tmp);
    return tmp;
}

/* ---------------------------------------------------------------------------------------------- */
/* activation rows, quantized per row */

typedef struct {
    int64_t n_in;
    const float *x;            /* [rows, n_in] fp32 */
    int8_t *qk; float *dk; int16_t *bk; /* blocks of 256: q [rows, n_in], d [rows, n_in/256], sums of 16 [rows, n_in/16] */
    int8_t *q0; float *d0; int32_t *s0; /* blocks of 32:  q [rows, n_in], d [rows, n_in/32], sums [rows, n_in/32] */
} Acts;

/* ---------------------------------------------------------------------------------------------- */
/* kernels: rows [r0, r0 + nr) of the pass against weight rows [j0, j1) of one tensor */

typedef struct {
    int type; /* the block type (a repacked tensor's base type) */
    const uint8_t *w;
    int64_t row_bytes, n_out, col;
    const float *bias;
    int x8; /* a 32-weight type's rows repacked eight at a time (gguf_repack) */
} Seg;

typedef struct {
    const Acts *a;
    float *y;
    int64_t ldy;
    int accumulate;
} Out;

/* --- portable scalar path ---------------------------------------------------------------------- */

/* One block of a 256-weight type as the products take it: q[e], the integer each activation is
 * multiplied by (the weight's level, offset to be unsigned where the vector paths need it: Q3_K's
 * q + 4, Q6_K's q + 32); sc[g], the scale of the 16 elements 16g .. 16g + 15 (a sub-block of 32
 * gives its two halves the same scale); cw[g], the correction's weight for the sum of those 16
 * activations (the mins of Q2_K, Q4_K, Q5_K; the scales, for the offsets of Q3_K and Q6_K); d and
 * dmin. Returns the offset (4, 32) or 0. */
static inline int kq_decode(int type, const uint8_t *blk, int q[256], int sc[16], int cw[16], float *d, float *dmin) {
    *dmin = 0.0f;
    switch (type) {
    case T_Q4_K: case T_Q5_K: {
        *d = f16(blk), *dmin = f16(blk + 2);
        uint8_t sc8[8], m8[8];
        q4k_scales(blk + 4, sc8, m8);
        for (int v = 0; v < 16; v++) sc[v] = sc8[v >> 1], cw[v] = m8[v >> 1];
        const uint8_t *qh = blk + 16, *qs = blk + (type == T_Q5_K ? 48 : 16);
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 32; i++) { /* sub-blocks 2k, 2k + 1; Q5_K's fifth bit: bit s of qh[i] */
                q[64 * k + i] = qs[32 * k + i] & 0xF;
                q[64 * k + 32 + i] = qs[32 * k + i] >> 4;
                if (type == T_Q5_K) {
                    q[64 * k + i] |= ((qh[i] >> (2 * k)) & 1) << 4;
                    q[64 * k + 32 + i] |= ((qh[i] >> (2 * k + 1)) & 1) << 4;
                }
            }
        return 0;
    }
    case T_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        *d = f16(blk + 208);
        for (int v = 0; v < 16; v++) sc[v] = cw[v] = (int8_t)blk[192 + v];
        for (int h = 0; h < 2; h++)
            for (int sq = 0; sq < 4; sq++)
                for (int i = 0; i < 32; i++) {
                    const uint8_t lo = ql[64 * h + 32 * (sq & 1) + i];
                    q[128 * h + 32 * sq + i] = (sq < 2 ? lo & 0xF : lo >> 4) | (((qh[32 * h + i] >> (2 * sq)) & 3) << 4);
                }
        return 32;
    }
    case T_Q3_K: { /* element 128h + 32j + i: bits 2j of qs[32h + i], and bit 4h + j of hmask[i] (set: no -4) */
        const uint8_t *hm = blk, *qs = blk + 32;
        int8_t s8[16];
        q3k_scales(blk + 96, s8);
        *d = f16(blk + 108);
        for (int v = 0; v < 16; v++) sc[v] = cw[v] = s8[v];
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++)
                    q[128 * h + 32 * j + i] = ((qs[32 * h + i] >> (2 * j)) & 3) | (((hm[i] >> (4 * h + j)) & 1) << 2);
        return 4;
    }
    case T_Q2_K: { /* element 128h + 32j + i: bits 2j of qs[32h + i]; scale and min of 16: nibbles of scales[g] */
        const uint8_t *qs = blk + 16;
        *d = f16(blk + 80), *dmin = f16(blk + 82);
        for (int v = 0; v < 16; v++) sc[v] = blk[v] & 0xF, cw[v] = blk[v] >> 4;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++) q[128 * h + 32 * j + i] = (qs[32 * h + i] >> (2 * j)) & 3;
        return 0;
    }
    default: { /* IQ4_XS: sub-block s of 32 is the low, then the high nibbles of qs[16s .. 16s + 15] */
        const uint8_t *qs = blk + 8;
        int16_t s16[8];
        iq4xs_scales(blk, s16);
        *d = f16(blk);
        for (int v = 0; v < 16; v++) sc[v] = s16[v >> 1], cw[v] = 0;
        for (int sb = 0; sb < 8; sb++)
            for (int i = 0; i < 16; i++) {
                q[32 * sb + i] = kv_iq4[qs[16 * sb + i] & 0xF];
                q[32 * sb + 16 + i] = kv_iq4[qs[16 * sb + i] >> 4];
            }
        return 0;
    }
    }
}

static void kq_scalar(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 256;
    const int has_min = s->type == T_Q4_K || s->type == T_Q5_K || s->type == T_Q2_K;
    int q[256], sc[16], cw[16];
    uint8_t tmp[176];
    for (int64_t j = j0; j < j1; j++) {
        float acc[RT][8];
        memset(acc, 0, sizeof acc);
        for (int64_t b = 0; b < nb; b++) {
            float d, dmin;
            const int off = kq_decode(s->type, block_at(s->type, s->x8, s->w, s->row_bytes, j, b, tmp), q, sc, cw, &d, &dmin);
            if (is_k8(s->type)) { /* one integer per block, one accumulator (lane 0) */
                for (int64_t t = 0; t < nr; t++) {
                    const int64_t r = r0 + t;
                    const int8_t *x = A->qk + r * n_in + b * 256;
                    const int16_t *bs = A->bk + r * (n_in / 16) + b * 16;
                    const float dx = A->dk[r * nb + b];
                    int32_t isum = 0, iadj = 0;
                    for (int e = 0; e < 256; e++) isum += sc[e >> 4] * (q[e] * x[e]);
                    for (int g = 0; g < 16; g++) iadj += cw[g] * bs[g];
                    if (has_min) {
                        acc[t][0] = fmaf(d * dx, (float)isum, acc[t][0]);
                        acc[t][0] = fmaf(-(dmin * dx), (float)iadj, acc[t][0]);
                    } else { /* Q3_K's offset 4 (IQ4_XS: none, iadj 0) */
                        acc[t][0] = fmaf(d * dx, (float)(isum - off * iadj), acc[t][0]);
                    }
                }
                continue;
            }
            for (int64_t t = 0; t < nr; t++) {
                const int64_t r = r0 + t;
                const int8_t *x = A->qk + r * n_in + b * 256;
                const int16_t *bs = A->bk + r * (n_in / 16) + b * 16;
                const float dx = A->dk[r * nb + b];
                int32_t isum[8] = {0}, iadj[8];
                for (int e = 0; e < 256; e++) isum[(e & 31) >> 2] += sc[e >> 4] * (q[e] * x[e]);
                /* the correction of lane l: sums of 16 number 2l and 2l + 1 (the vector paths' madd) */
                for (int l = 0; l < 8; l++) iadj[l] = cw[2 * l] * bs[2 * l] + cw[2 * l + 1] * bs[2 * l + 1];
                const float dd = d * dx; /* Q6_K: the offset 32 */
                for (int l = 0; l < 8; l++) acc[t][l] = fmaf(dd, (float)(isum[l] - off * iadj[l]), acc[t][l]);
            }
        }
        for (int64_t t = 0; t < nr; t++)
            store(o->y + (r0 + t) * o->ldy + s->col + j, is_k8(s->type) ? acc[t][0] : tree8(acc[t]), s->bias, j,
                  o->accumulate);
    }
}

/* Q5_0: d (fp16), 32 high bits qh, 16 bytes of low nibbles; value i has nibble i of qs (the low
 * nibbles first, then the high ones) and bit i of qh above it, w = d * (q - 16). Q5_1: d, m, then
 * the same (qh at byte 4), w = d * q + m. */
static inline void q5_values(const uint8_t *blk, int type, int q[32]) {
    uint32_t qh;
    const int at = type == T_Q5_1 ? 4 : 2, off = type == T_Q5_1 ? 0 : 16;
    memcpy(&qh, blk + at, 4);
    const uint8_t *qs = blk + at + 4;
    for (int i = 0; i < 16; i++) {
        q[i] = ((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - off;
        q[i + 16] = ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off;
    }
}

static inline int has_m(int type) { return type == T_Q4_1 || type == T_Q5_1; } /* a min m per block of 32 */

static void k32_scalar(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 32;
    int q[32];
    uint8_t tmp[176];
    for (int64_t j = j0; j < j1; j++) {
        float acc[RT], accm[RT];
        memset(acc, 0, sizeof acc);
        memset(accm, 0, sizeof accm);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = block_at(s->type, s->x8, s->w, s->row_bytes, j, b, tmp);
            const float d = f16(blk);
            float m = 0.0f;
            if (has_m(s->type)) m = f16(blk + 2);
            if (s->type == T_Q8_0) {
                for (int i = 0; i < 32; i++) q[i] = (int8_t)blk[2 + i];
            } else if (s->type == T_Q5_0 || s->type == T_Q5_1) {
                q5_values(blk, s->type, q);
            } else if (s->type == T_IQ4_NL) {
                for (int i = 0; i < 16; i++) q[i] = kv_iq4[blk[2 + i] & 0xF], q[i + 16] = kv_iq4[blk[2 + i] >> 4];
            } else {
                const uint8_t *qs = blk + (s->type == T_Q4_1 ? 4 : 2);
                const int off = s->type == T_Q4_0 ? 8 : 0;
                for (int i = 0; i < 16; i++) q[i] = (qs[i] & 0xF) - off, q[i + 16] = (qs[i] >> 4) - off;
            }
            for (int64_t t = 0; t < nr; t++) {
                const int64_t r = r0 + t;
                const int8_t *x = A->q0 + r * n_in + b * 32;
                const float dx = A->d0[r * nb + b];
                int32_t isum = 0;
                for (int i = 0; i < 32; i++) isum += q[i] * x[i];
                acc[t] = fmaf(d * dx, (float)isum, acc[t]);
                if (has_m(s->type)) accm[t] = fmaf(m * dx, (float)A->s0[r * nb + b], accm[t]);
            }
        }
        for (int64_t t = 0; t < nr; t++) {
            float v = acc[t];
            if (has_m(s->type)) v = v + accm[t];
            store(o->y + (r0 + t) * o->ldy + s->col + j, v, s->bias, j, o->accumulate);
        }
    }
}

static inline float wget(int type, const uint8_t *row, int64_t i) {
    return type == T_F32 ? bits_f32((uint32_t)row[4 * i] | (uint32_t)row[4 * i + 1] << 8 | (uint32_t)row[4 * i + 2] << 16 | (uint32_t)row[4 * i + 3] << 24)
         : type == T_F16 ? f16(row + 2 * i) : bf16(row + 2 * i);
}

static void kf_scalar(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, n8 = n_in & ~(int64_t)7;
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = s->w + j * s->row_bytes;
        float acc[RT][8];
        memset(acc, 0, sizeof acc);
        for (int64_t i = 0; i < n8; i += 8) {
            float w[8];
            for (int l = 0; l < 8; l++) w[l] = wget(s->type, row, i + l);
            for (int64_t t = 0; t < nr; t++) {
                const float *x = A->x + (r0 + t) * n_in + i;
                for (int l = 0; l < 8; l++) acc[t][l] = fmaf(w[l], x[l], acc[t][l]);
            }
        }
        for (int64_t t = 0; t < nr; t++) {
            float v = tree8(acc[t]);
            for (int64_t i = n8; i < n_in; i++) v = fmaf(wget(s->type, row, i), A->x[(r0 + t) * n_in + i], v);
            store(o->y + (r0 + t) * o->ldy + s->col + j, v, s->bias, j, o->accumulate);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* the entry points */

/* A per-thread buffer of at least `bytes` bytes, 64-byte aligned, grown (never shrunk) in place. */
static uint8_t *grown(uint8_t **buf, size_t *size, size_t bytes) {
    if (bytes > *size) {
        free(*buf);
        *buf = NULL;
        *size = 0;
        if (posix_memalign((void **)buf, 64, bytes)) return NULL;
        *size = bytes;
    }
    return *buf;
}

static __thread uint8_t *g_scratch = NULL;
static __thread size_t g_scratch_size = 0;

static uint8_t *scratch(size_t bytes) { return grown(&g_scratch, &g_scratch_size, bytes); }

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* A kernel's own buffer (per thread): a group of 8 rows of a tensor in the file's layout, repacked
 * for the vector kernels (scratch() holds the calling thread's activations, which every thread reads). */
#ifdef GG_X86
static __thread uint8_t *g_pack = NULL;
static __thread size_t g_pack_size = 0;

static uint8_t *pack_buffer(size_t bytes) { return grown(&g_pack, &g_pack_size, bytes); }
#endif

/* ---------------------------------------------------------------------------------------------- */
/* dequantized rows (the embedding lookup): out[k, :] = W[ids[k], :], as gguf.quants computes it */

int gguf_get_rows(int type, const uint8_t *w, int64_t n_in, const int64_t *ids, int64_t n, float *out) {
    const int64_t rb = gguf_row_bytes(type, n_in);
    if (rb < 0) return -1;
    const int x8 = is_x8(type);
    type = base_type(type);
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *row = w + ids[k] * rb;
        float *y = out + k * n_in;
        uint8_t tmp[176];
        switch (type) {
        case T_F32: case T_F16: case T_BF16:
            for (int64_t i = 0; i < n_in; i++) y[i] = wget(type, row, i);
            break;
        case T_Q4_0: case T_Q4_1:
            for (int64_t b = 0; b < n_in / 32; b++) {
                const uint8_t *blk = block_at(type, x8, w, rb, ids[k], b, tmp);
                const float d = f16(blk), m = type == T_Q4_1 ? f16(blk + 2) : 0.0f;
                const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
                for (int i = 0; i < 32; i++) {
                    const int q = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
                    y[b * 32 + i] = type == T_Q4_0 ? d * (float)(q - 8) : d * (float)q + m;
                }
            }
            break;
        case T_Q5_0: case T_Q5_1:
            for (int64_t b = 0; b < n_in / 32; b++) {
                const uint8_t *blk = block_at(type, x8, w, rb, ids[k], b, tmp);
                const float d = f16(blk), m = type == T_Q5_1 ? f16(blk + 2) : 0.0f;
                int q[32];
                q5_values(blk, type, q);
                for (int i = 0; i < 32; i++) y[b * 32 + i] = type == T_Q5_0 ? d * (float)q[i] : d * (float)q[i] + m;
            }
            break;
        case T_IQ4_NL:
            for (int64_t b = 0; b < n_in / 32; b++) {
                const uint8_t *blk = block_at(type, x8, w, rb, ids[k], b, tmp);
                const float d = f16(blk);
                for (int i = 0; i < 32; i++) y[b * 32 + i] = d * (float)kv_iq4[i < 16 ? blk[2 + i] & 0xF : blk[2 + i - 16] >> 4];
            }
            break;
        case T_Q2_K: case T_Q3_K: case T_Q5_K: case T_IQ4_XS:
            /* as gguf.quants: (d * scale) * q, less dmin * min where there are mins; Q3_K's level
             * is q - 4 (its high bit clear), IQ4_XS's the non-linear level of q */
            for (int64_t b = 0; b < n_in / 256; b++) {
                int q[256], sc[16], cw[16];
                float d, dmin;
                const int off = kq_decode(type, block_at(type, x8, w, rb, ids[k], b, tmp), q, sc, cw, &d, &dmin);
                for (int e = 0; e < 256; e++) {
                    const float dl = d * (float)sc[e >> 4];
                    y[b * 256 + e] = type == T_Q2_K || type == T_Q5_K ? dl * (float)q[e] - dmin * (float)cw[e >> 4]
                                                                      : dl * (float)(q[e] - off);
                }
            }
            break;
        case T_Q8_0:
            for (int64_t b = 0; b < n_in / 32; b++) {
                const uint8_t *blk = block_at(type, x8, w, rb, ids[k], b, tmp);
                const float d = f16(blk);
                for (int i = 0; i < 32; i++) y[b * 32 + i] = (float)(int8_t)blk[2 + i] * d;
            }
            break;
        case T_Q4_K:
            for (int64_t b = 0; b < n_in / 256; b++) {
                const uint8_t *blk = block_at(type, x8, w, rb, ids[k], b, tmp);
                const float d = f16(blk), dmin = f16(blk + 2);
                uint8_t sc[8], m[8];
                q4k_scales(blk + 4, sc, m);
                for (int e = 0; e < 256; e++) {
                    const int sub = e >> 5, k = e >> 6, i = e & 31;
                    const int q = (sub & 1) ? blk[16 + 32 * k + i] >> 4 : blk[16 + 32 * k + i] & 0xF;
                    y[b * 256 + e] = (d * (float)sc[sub]) * (float)q - dmin * (float)m[sub];
                }
            }
            break;
        case T_Q6_K:
            for (int64_t b = 0; b < n_in / 256; b++) {
                const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
                const float d = f16(blk + 208);
                for (int e = 0; e < 256; e++) {
                    const int h = e >> 7, sq = (e >> 5) & 3, i = e & 31;
                    const uint8_t lo = ql[64 * h + 32 * (sq & 1) + i];
                    const int q = ((sq < 2 ? lo & 0xF : lo >> 4) | (((qh[32 * h + i] >> (2 * sq)) & 3) << 4)) - 32;
                    y[b * 256 + e] = (d * (float)(int8_t)blk[192 + (e >> 4)]) * (float)q;
                }
            }
            break;
        default:
            return -1;
        }
    }
    return 0;
}

enum { ACT_SWIGLU = 0, ACT_GEGLU = 1 };

/* ---------------------------------------------------------------------------------------------- */
/* the computing code, twice: the AVX2 copy (every function of it compiled for AVX2 + FMA + F16C,
 * as a build with -mavx2 -mfma -mf16c compiles it, and run only where gguf_cpu_paths finds them)
 * and the portable copy (compiled for any CPU of the family) */

#ifdef GG_X86
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define GG_AVX2 1
#define GG_COPY(name) name##_avx2
#include __FILE__
#undef GG_COPY
#undef GG_AVX2
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define GG_PICK(name) (vec() ? name##_avx2 : name##_portable)
#else
#define GG_PICK(name) name##_portable
#endif
#define GG_COPY(name) name##_portable
#include __FILE__
#undef GG_COPY

/* The exported functions of the computing code: each runs the copy of the path that runs. */
#define GG_DISPATCH_F(result, name, params, args)
#define GG_DISPATCH_V(result, name, params, args) result name params { GG_PICK(name) args; }
#define GG_DISPATCH_R(result, name, params, args) result name params { return GG_PICK(name) args; }
#define GG_DISPATCH(how, result, name, params, args) GG_DISPATCH_##how(result, name, params, args)
GG_EXPORTS(GG_DISPATCH)

#elif !defined(GG_KERNEL_BODY) /* one copy of the computing code (GG_AVX2 defined in the AVX2 copy) */

/* The names each copy defines, made the copy's own (quantize_block_avx2, quantize_block_portable, ...). */
#define quantize_block GG_COPY(quantize_block)
#define quantize_row_k GG_COPY(quantize_row_k)
#define quantize_row_32 GG_COPY(quantize_row_32)
#define gguf_quantize_rows GG_COPY(gguf_quantize_rows)
#define run_seg GG_COPY(run_seg)
#define gguf_matmul_multi GG_COPY(gguf_matmul_multi)
#define gguf_matmul GG_COPY(gguf_matmul)
#define gguf_rmsnorm GG_COPY(gguf_rmsnorm)
#define exp_s GG_COPY(exp_s)
#define gguf_exp GG_COPY(gguf_exp)
#define glu_z GG_COPY(glu_z)
#define gguf_glu GG_COPY(gguf_glu)
#define gguf_gelu GG_COPY(gguf_gelu)
#define gguf_rope_store GG_COPY(gguf_rope_store)
#define dot8 GG_COPY(dot8)
#define gguf_attention GG_COPY(gguf_attention)
#define add_rows GG_COPY(add_rows)
#define gguf_forward_seqs GG_COPY(gguf_forward_seqs)

#ifdef GG_AVX2
static inline float tree8v(__m256 v) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#endif

/* One block of `len` values: d = amax / 127, q = round-half-even(x * (127 / amax)). The same
 * elementwise operations in both paths (a max is exact in any order). */
static void quantize_block(const float *x, int len, int8_t *q, float *d) {
    float amax = 0.0f;
    int i = 0;
#ifdef GG_AVX2
    if (vec()) {
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();
        for (; i + 8 <= len; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    }
#endif
    for (; i < len; i++) { const float a = fabsf(x[i]); amax = a > amax ? a : amax; }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d = amax / 127.0f;
    i = 0;
#ifdef GG_AVX2
    if (vec()) {
        const __m256 vid = _mm256_set1_ps(id);
        for (; i + 32 <= len; i += 32) {
            __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i e = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);
            __m256i all = _mm256_packs_epi16(ab, ce);
            all = _mm256_permutevar8x32_epi32(all, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            all = _mm256_max_epi8(_mm256_min_epi8(all, _mm256_set1_epi8(127)), _mm256_set1_epi8(-127));
            _mm256_storeu_si256((__m256i *)(q + i), all);
        }
    }
#endif
    for (; i < len; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
}

static void quantize_row_k(const float *x, int64_t n_in, int8_t *q, float *d, int16_t *bs) {
    for (int64_t b = 0; b < n_in / 256; b++) {
        quantize_block(x + b * 256, 256, q + b * 256, d + b);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[b * 256 + g * 16 + i];
            bs[b * 16 + g] = (int16_t)s;
        }
    }
}

static void quantize_row_32(const float *x, int64_t n_in, int8_t *q, float *d, int32_t *s) {
    for (int64_t b = 0; b < n_in / 32; b++) {
        quantize_block(x + b * 32, 32, q + b * 32, d + b);
        int t = 0;
        for (int i = 0; i < 32; i++) t += q[b * 32 + i];
        s[b] = t;
    }
}

/* Exposed for tests: the activation quantization the kernels use (block 256 or 32). */
static void gguf_quantize_rows(const float *x, int64_t n_rows, int64_t n_in, int block, int8_t *q, float *d) {
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t b = 0; b < n_in / block; b++)
            quantize_block(x + r * n_in + b * block, block, q + r * n_in + b * block, d + r * (n_in / block) + b);
}

/* --- AVX2 path ------------------------------------------------------------------------------- */
#ifdef GG_AVX2

/* Software prefetch PF_AHEAD bytes ahead of the weight block being multiplied. A thread's weights
 * are one contiguous run (CHUNK_BYTES), read once; without it the loads of a block wait for memory
 * after the previous block's arithmetic, so a pass of n rows costs the memory time plus the
 * arithmetic of n rows. With it, the arithmetic of a few rows hides under the memory stream. Only
 * timing changes: no value depends on it. */
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif
/* The same, X8_PF bytes ahead, for the repacked 32-weight types (k32_group: a group of 8 rows is one
 * contiguous run, several records a 64-byte line apart; 4096 measured best, 2048 about 5% slower). */
#ifndef X8_PF
#define X8_PF 4096
#endif
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + PF_AHEAD + i), _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void q6k_vectors(const uint8_t *blk, int h, __m256i *qv) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    qv[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
    qv[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
    qv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
    qv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

/* Bit `from` of each byte of hb moved to bit `to`, the byte's other bits cleared. A 16-bit shift by
 * at most 5 carries bits across the bytes of a pair only into bits the mask clears (a right shift
 * by k fills bits 8 - k .. 7 of the low byte, above bit `to`; a left shift by k fills bits 0 .. k - 1
 * of the high byte, below it). */
static inline __attribute__((always_inline)) __m256i bit_moved(__m256i hb, const int from, const int to) {
    const __m256i moved = from >= to ? _mm256_srli_epi16(hb, from - to) : _mm256_slli_epi16(hb, to - from);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << to)));
}

/* The quantized types' integer products, once per vector path (the body at the end of this file,
 * included with the path's operations): DOT_FIRST(p, w) and DOT_ADD(acc, p, w) multiply s16 pairs
 * p * w and add each pair into an int32 lane (then into acc); DOT_ACC(acc, u, s), defined on the
 * VNNI paths only, adds four u8 * s8 products into each int32 lane of acc (one vpdpbusd), where the
 * AVX2 path sums maddubs' s16 pairs (k32_sum). The AVX2 forms use madd (and maddubs); the VNNI forms
 * are one vpdpwssd / vpdpbusd each. No sum overflows or saturates (weights below 2^7 in magnitude
 * times activations clamped to +-127, pairs below 2^15; k32_sum's bounds there), so every form gives
 * the same integers. */
#define GG_KERNEL_BODY 1
#define KN(name) name##_avx2
#define DOT_FIRST(p, w) _mm256_madd_epi16((p), (w))
#define DOT_ADD(acc, p, w) _mm256_add_epi32((acc), _mm256_madd_epi16((p), (w)))
#include __FILE__
#undef KN
#undef DOT_ADD
#if defined(GG_VNNI)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#define KN(name) name##_vnni512
#define DOT_ADD(acc, p, w) _mm256_dpwssd_epi32((acc), (p), (w))
#define DOT_ACC(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#include __FILE__
#pragma GCC pop_options
#undef KN
#undef DOT_ADD
#undef DOT_ACC
#pragma GCC push_options
#pragma GCC target("avxvnni")
#define KN(name) name##_avxvnni
#define DOT_ADD(acc, p, w) _mm256_dpwssd_avx_epi32((acc), (p), (w))
#define DOT_ACC(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#include __FILE__
#pragma GCC pop_options
#undef KN
#undef DOT_ADD
#undef DOT_ACC
#ifdef GG_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
#define KN(name) name##_amx
#define GG_AMX_BODY 1
#define DOT_ADD(acc, p, w) _mm256_dpwssd_epi32((acc), (p), (w))
#define DOT_ACC(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#include __FILE__
#pragma GCC pop_options
#undef KN
#undef GG_AMX_BODY
#undef DOT_ADD
#undef DOT_ACC
#endif
#elif defined(GG_EMULATE_VNNI)
/* A test build for CPUs without VNNI: the 512-bit VNNI path's code with its two instructions
 * emulated by SIMDe (their definition, in portable code), so that what the path computes can be
 * compared with the other paths on any AVX2 machine. */
#include <simde/x86/avx512/dpbusd.h>
#include <simde/x86/avx512/dpwssd.h>
#define KN(name) name##_vnni512
#define DOT_ADD(acc, p, w) simde_mm256_dpwssd_epi32((acc), (p), (w))
#define DOT_ACC(acc, u, s) simde_mm256_dpbusd_epi32((acc), (u), (s))
#include __FILE__
#undef KN
#undef DOT_ADD
#undef DOT_ACC
#endif
#undef DOT_FIRST
#undef GG_KERNEL_BODY

/* F32, F16, BF16 against G (1..4) rows, accumulators in registers. */
static inline __attribute__((always_inline)) void kf_group(const Seg *s, const uint8_t *row, int64_t j, int64_t r0,
                                                           const int G, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, n8 = n_in & ~(int64_t)7;
    const int type = s->type;
    __m256 acc[4];
    for (int t = 0; t < G; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        __m256 w;
        if (type == T_F32) w = _mm256_loadu_ps((const float *)(row + 4 * i));
        else if (type == T_F16) w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
        else w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
        for (int t = 0; t < G; t++) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(A->x + (r0 + t) * n_in + i), acc[t]);
    }
    for (int t = 0; t < G; t++) {
        float v = tree8v(acc[t]);
        for (int64_t i = n8; i < n_in; i++) v = fmaf(wget(type, row, i), A->x[(r0 + t) * n_in + i], v);
        store(o->y + (r0 + t) * o->ldy + s->col + j, v, s->bias, j, o->accumulate);
    }
}

static void kf_avx2(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = s->w + j * s->row_bytes;
        int64_t t = 0;
        for (; t + 4 <= nr; t += 4) kf_group(s, row, j, r0 + t, 4, o);
        switch (nr - t) {
        case 3: kf_group(s, row, j, r0 + t, 3, o); break;
        case 2: kf_group(s, row, j, r0 + t, 2, o); break;
        case 1: kf_group(s, row, j, r0 + t, 1, o); break;
        default: break;
        }
    }
}
#endif /* GG_AVX2 */

typedef void (*kernel_fn)(const Seg *, int64_t, int64_t, int64_t, int64_t, const Out *);

static void run_seg(const Seg *s, int64_t j0, int64_t j1, int64_t n_rows, const Out *o) {
    /* Weight row j's blocks are applied to the rows RT at a time (the row stays in L1 across
     * tiles). Whatever the tiling, each output element sees the same operations: the tiles only
     * decide how often a block is decoded. */
    kernel_fn k;
    const int path = gguf_path();
    k = is_k(s->type) ? kq_scalar : is_32(s->type) ? k32_scalar : kf_scalar;
#ifdef GG_AVX2
#define PATH_KERNELS(SUFFIX)                                                          \
    switch (s->type) {                                                                \
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_IQ4_XS:                \
        k = k8_##SUFFIX;                                                              \
        break;                                                                        \
    case T_Q6_K: k = q6k_##SUFFIX; break;                                             \
    default: k = is_32(s->type) ? k32_##SUFFIX : kf_avx2; break;                      \
    }
    if (path == P_AVX2) { PATH_KERNELS(avx2) }
#if defined(GG_VNNI) || defined(GG_EMULATE_VNNI)
    if (path == P_AVX512VNNI) { PATH_KERNELS(vnni512) }
#endif
#ifdef GG_VNNI
    if (path == P_AVXVNNI) { PATH_KERNELS(avxvnni) }
#endif
#ifdef GG_AMX
    if (path == P_AMX) { PATH_KERNELS(amx) }
#endif
#undef PATH_KERNELS
#ifdef GG_AMX
    if (path == P_AMX && s->type == T_Q4_K && s->x8 && n_rows >= AMX_ROWS) {
        k8_amx_rows_amx(s, j0, j1, n_rows, o);
        return;
    }
    if (path == P_AMX && s->type == T_Q6_K && n_rows >= 4) {
        for (int64_t r0 = 0; r0 < n_rows; r0 += AMX_BLOCK)
            q6k_pairs_amx(s, j0, j1, r0, n_rows - r0 < AMX_BLOCK ? n_rows - r0 : AMX_BLOCK, o);
        return;
    }
#endif
#endif
    (void)path;
    if (n_rows <= RT) {
        k(s, j0, j1, 0, n_rows, o);
        return;
    }
    const int64_t step = in_groups(s->type) ? 8 : 1; /* the grouped types' kernels take outputs in groups of 8 */
    for (int64_t j = j0; j < j1; j += step)
        for (int64_t r0 = 0; r0 < n_rows; r0 += RT)
            k(s, j, j + step < j1 ? j + step : j1, r0, n_rows - r0 < RT ? n_rows - r0 : RT, o);
}

/* y[r, col_s + j] (= y + ) sum_i W_s[j, i] x[r, i] (+ bias_s[j]) for each segment s, whose
 * outputs sit side by side in y's rows (ldy floats apart): several tensors that read the same x
 * (Q, K and V; gate and up) in one call. types[s]: ggml type ids; weights[s]: the tensor's bytes
 * (n_outs[s] rows of gguf_row_bytes(type, n_in)); biases[s]: fp32 [n_outs[s]] or 0.
 * accumulate: add into y (a residual) instead of overwriting it. Returns 0, or -1 for an
 * unsupported type or shape, -2 when out of memory. */
static int gguf_matmul_multi(int n_seg, const int32_t *types, const uint64_t *weights, const int64_t *n_outs,
                      const uint64_t *biases, int64_t n_in, const float *x, int64_t n_rows, float *y, int64_t ldy,
                      int accumulate, int n_threads) {
    if (n_seg <= 0 || n_seg > 16 || n_rows <= 0) return n_rows == 0 ? 0 : -1;
    Seg segs[16];
    int need_k = 0, need_32 = 0;
    int64_t col = 0, total_bytes = 0;
    for (int i = 0; i < n_seg; i++) {
        const int64_t rb = gguf_row_bytes(types[i], n_in);
        if (rb < 0) return -1;
        const int type = base_type(types[i]);
        segs[i] = (Seg){type, (const uint8_t *)(uintptr_t)weights[i], rb, n_outs[i], col,
                        biases ? (const float *)(uintptr_t)biases[i] : NULL, is_x8(types[i])};
        col += n_outs[i];
        total_bytes += rb * n_outs[i];
        need_k |= is_k(type);
        need_32 |= is_32(type);
    }
    if (col > ldy) return -1;
    /* the quantized rows */
    const int64_t sz_qk = need_k ? align64(((n_rows + 15) & ~(int64_t)15) * n_in) + align64(n_rows * (n_in / 256) * 4) + align64(n_rows * (n_in / 16) * 2) : 0;
    const int64_t sz_q0 = need_32 ? align64(n_rows * n_in) + 2 * align64(n_rows * (n_in / 32) * 4) : 0;
    uint8_t *buf = scratch((size_t)(sz_qk + sz_q0 + 64));
    if (!buf) return -2;
    Acts A = {n_in, x, NULL, NULL, NULL, NULL, NULL, NULL};
    if (need_k) {
        A.qk = (int8_t *)buf;
        /* the quantized rows' buffer holds whole tiles of 16 rows (the AMX path's last tile reads them) */
        const int64_t q_bytes = align64(((n_rows + 15) & ~(int64_t)15) * n_in);
        A.dk = (float *)(buf + q_bytes);
        A.bk = (int16_t *)(buf + q_bytes + align64(n_rows * (n_in / 256) * 4));
    }
    if (need_32) {
        uint8_t *b0 = buf + sz_qk;
        A.q0 = (int8_t *)b0;
        A.d0 = (float *)(b0 + align64(n_rows * n_in));
        A.s0 = (int32_t *)(b0 + align64(n_rows * n_in) + align64(n_rows * (n_in / 32) * 4));
    }
    Out o = {&A, y, ldy, accumulate};
    int64_t first_chunk[17], chunk_rows[16];
    first_chunk[0] = 0;
    for (int i = 0; i < n_seg; i++) {
        chunk_rows[i] = CHUNK_BYTES / segs[i].row_bytes > 0 ? CHUNK_BYTES / segs[i].row_bytes : 1;
        if (in_groups(segs[i].type)) chunk_rows[i] = (chunk_rows[i] + 7) & ~(int64_t)7; /* whole groups of 8 rows */
        first_chunk[i + 1] = first_chunk[i] + (segs[i].n_out + chunk_rows[i] - 1) / chunk_rows[i];
    }
    const int64_t n_chunks = first_chunk[n_seg];
    if (n_threads < 1) n_threads = 1;
    if (total_bytes < 65536) n_threads = 1;
    #pragma omp parallel num_threads(n_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n_rows; r++) {
            if (need_k) quantize_row_k(x + r * n_in, n_in, A.qk + r * n_in, A.dk + r * (n_in / 256), A.bk + r * (n_in / 16));
            if (need_32) quantize_row_32(x + r * n_in, n_in, A.q0 + r * n_in, A.d0 + r * (n_in / 32), A.s0 + r * (n_in / 32));
        }
        /* Output rows in chunks of about CHUNK_BYTES of weights, handed out as threads come for
         * them: a thread that runs slower (or is descheduled) takes fewer. Which thread computes an
         * output never changes its value. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n_chunks; k++) {
            int i = 0;
            while (k >= first_chunk[i + 1]) i++;
            const Seg *sg = &segs[i];
            const int64_t j0 = (k - first_chunk[i]) * chunk_rows[i];
            const int64_t j1 = j0 + chunk_rows[i] < sg->n_out ? j0 + chunk_rows[i] : sg->n_out;
            run_seg(sg, j0, j1, n_rows, &o);
        }
    }
    return 0;
}

/* One tensor: y[r, j] = sum_i W[j, i] x[r, i] (+ y[r, j] when accumulate). */
static int gguf_matmul(int type, const uint8_t *w, int64_t n_out, int64_t n_in, const float *x, int64_t n_rows, float *y,
                int accumulate, int n_threads) {
    const int32_t t = type;
    const uint64_t p = (uint64_t)(uintptr_t)w;
    return gguf_matmul_multi(1, &t, &p, &n_out, NULL, n_in, x, n_rows, y, n_out, accumulate, n_threads);
}

/* ---------------------------------------------------------------------------------------------- */
/* per-row helpers of the forward pass (each a function of one row only) */

/* out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, the sum of squares in double, in order (as
 * ggml_rms_norm). */
static void gguf_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * dim;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)dim);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = (xr[i] * scale) * w[i];
    }
}

/* exp on fp32: range reduction by ln 2 and a degree-6 polynomial (Cephes' expf), the same
 * operations in both paths (max relative error about 2 ulp). Inputs are clamped to
 * [-87.34, 88]: 2^n stays a normal float. */
#define EXP_HI 88.0f
#define EXP_LO (-87.3365478515625f)
static inline float exp_s(float x) {
    x = x > EXP_HI ? EXP_HI : x;
    x = x < EXP_LO ? EXP_LO : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float z = r * r;
    float y = fmaf(p, z, r);
    y = y + 1.0f;
    return y * bits_f32((uint32_t)((int32_t)n + 127) << 23);
}

#ifdef GG_AVX2
static inline __m256 exp_v(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_fmadd_ps(p, z, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* For tests: y[i] = the exp above. */
static void gguf_exp(const float *x, int64_t n, float *y) {
    int64_t i = 0;
#ifdef GG_AVX2
    if (vec())
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp_v(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) y[i] = exp_s(x[i]);
}

/* The gated feed-forward's activation: out[r, i] = act(gu[r, i]) * gu[r, ff + i], gate and up side
 * by side in each row of gu [n_rows, 2 * ff]; act(g) = g / (1 + exp(-z)) with
 * - SwiGLU (act 0): z = g, silu;
 * - GeGLU (act 1, Gemma's): z = (K g) (1 + A g^2), K = 2 sqrt(2 / pi), A = 0.044715: the tanh
 *   approximation 0.5 g (1 + tanh(sqrt(2 / pi) g (1 + A g^2))) that ggml_gelu_f32 writes, through the
 *   identity 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2 y)).
 * The same operations, in the same order, on both paths (no fused multiply-add). */
#define GELU_K 1.5957691216057308f /* 2 sqrt(2 / pi) */
#define GELU_A 0.044715f
static inline float glu_z(float g, int act) { return act ? (GELU_K * g) * (1.0f + GELU_A * (g * g)) : g; }

static void gguf_glu(const float *gu, int64_t n_rows, int64_t ff, float *out, int act, int n_threads) {
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_rows * ff >= 32768)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *g = gu + r * 2 * ff, *u = g + ff;
        float *o = out + r * ff;
        int64_t i = 0;
#ifdef GG_AVX2
        if (vec()) {
            const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
            const __m256 ka = _mm256_set1_ps(GELU_A), kk = _mm256_set1_ps(GELU_K);
            for (; i + 8 <= ff; i += 8) {
                const __m256 gv = _mm256_loadu_ps(g + i);
                const __m256 z = act ? _mm256_mul_ps(_mm256_mul_ps(kk, gv),
                                                     _mm256_add_ps(one, _mm256_mul_ps(ka, _mm256_mul_ps(gv, gv))))
                                     : gv;
                const __m256 e = exp_v(_mm256_xor_ps(z, neg));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
            }
        }
#endif
        for (; i < ff; i++) o[i] = (g[i] / (1.0f + exp_s(-glu_z(g[i], act)))) * u[i];
    }
}

/* For tests: y[i] = gelu(x[i]) as gguf_glu computes it (times an up of 1). */
static void gguf_gelu(const float *x, int64_t n, float *y) {
    float *gu = (float *)malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(float));
    if (!gu) return;
    for (int64_t i = 0; i < n; i++) gu[i] = x[i], gu[n + i] = 1.0f;
    gguf_glu(gu, 1, n, y, 1, 1);
    free(gu);
}

/* Rotary embedding of one pass's Q and K, written where attention reads them; V copied to the
 * cache. qkv [n, (H + 2 KV) * d] (Q, K, V side by side); pos [n]; cos_t, sin_t [positions, d / 2];
 * neox: 0 = pairs (2i, 2i + 1) (llama.cpp's NORM, GGUF llama), 1 = pairs (i, i + d / 2) (NEOX, qwen2).
 * q_out [H, n, d]; k_cache, v_cache [KV, cap, d], rows start .. start + n - 1 written. */
static void gguf_rope_store(const float *qkv, const int64_t *pos, const float *cos_t, const float *sin_t, int neox,
                     int64_t n, int64_t H, int64_t KV, int64_t d, float *q_out, kv_t *k_cache, kv_t *v_cache,
                     int64_t cap, int64_t start) {
    const int64_t width = (H + 2 * KV) * d, half = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *row = qkv + r * width;
        const float *c = cos_t + pos[r] * half, *s = sin_t + pos[r] * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xin = row + h * d;
            float *xo = q_out + (h * n + r) * d;
            for (int64_t i = 0; i < half; i++) {
                const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                const float x0 = xin[a], x1 = xin[b];
                xo[a] = x0 * c[i] - x1 * s[i];
                xo[b] = x0 * s[i] + x1 * c[i];
            }
        }
        for (int64_t h = 0; h < KV; h++) {
            const float *xin = row + (H + h) * d;
            kv_t *xo = k_cache + (h * cap + start + r) * d;
            for (int64_t i = 0; i < half; i++) {
                const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                const float x0 = xin[a], x1 = xin[b];
                xo[a] = kv_put(x0 * c[i] - x1 * s[i]);
                xo[b] = kv_put(x0 * s[i] + x1 * c[i]);
            }
            const float *vin = row + (H + KV + h) * d;
            kv_t *vo = v_cache + (h * cap + start + r) * d;
            for (int64_t i = 0; i < d; i++) vo[i] = kv_put(vin[i]);
        }
    }
}

static inline float dot8(const float *a, const kv_t *b, int64_t d) {
    const int64_t d8 = d & ~(int64_t)7;
    float s;
#ifdef GG_AVX2
    if (vec()) {
        __m256 acc = _mm256_setzero_ps();
#ifdef GG_KV_F16
        for (int64_t i = 0; i < d8; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))), acc);
#else
        for (int64_t i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
#endif
        s = tree8v(acc);
    } else
#endif
    {
        float acc[8] = {0};
        for (int64_t i = 0; i < d8; i += 8)
            for (int l = 0; l < 8; l++) acc[l] = fmaf(a[i + l], kv_get(b[i + l]), acc[l]);
        s = tree8(acc);
    }
    for (int64_t i = d8; i < d; i++) s = fmaf(a[i], kv_get(b[i]), s);
    return s;
}

/* Attention of each query row over the first L cached keys: out[r, h, :] = sum_j p_j v[j] with
 * p = softmax(scale * q.k_j) over the keys the row sees (visible[r, j] != 0; visible NULL: all),
 * and with a sliding window (window > 0) only those whose position is within the last `window`
 * positions of the row's: qpos[r] - kpos[j] < window (llama.cpp's standard window), qpos [n] the
 * rows' positions and kpos [L] the cached keys' (both unread when window is 0).
 * q [H, n, d]; k, v [KV, cap, d]; out [n, H, d]. Each (head, row) is computed by one thread over
 * its keys in order, so a row's result does not depend on the other rows nor on how many threads
 * run. A thread's job is one row and the query heads that share a kv head (or a share of them,
 * where there would be fewer jobs than threads): each key and value is read once for all those heads,
 * and their computations, interleaved key by key, are each the one it would be alone. (One job a
 * (head, row) read a kv head's whole cache once per query head and row: at a long context that
 * traffic, not the weights, made the step's time.) */
static int gguf_attention(const float *q, const kv_t *k, const kv_t *v, const uint8_t *visible, float *out, int64_t H,
                   int64_t KV, int64_t n, int64_t L, int64_t d, int64_t cap, float scale, const int64_t *qpos,
                   const int64_t *kpos, int64_t window, int n_threads) {
    const int64_t group = H / KV;
    /* a job: one row's query heads that share a kv head (or a share of them, so that there are at
     * least as many jobs as threads), each key and value read once for all of them */
    int64_t parts = (n_threads + KV * n - 1) / (KV * n);
    parts = parts < 1 ? 1 : parts > group ? group : parts;
    const int64_t jobs = KV * n * parts;
    int failed = 0;
    #pragma omp parallel num_threads(n_threads) if (H * n > 1 && L * d * H * n >= 16384)
    {
        float *s = (float *)malloc((size_t)(group * L + 2 * group) * sizeof(float)); /* scores, best, total */
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            if (!s) continue;
            const int64_t g = job / (n * parts), r = job / parts % n, part = job % parts;
            const int64_t h0 = g * group + part * group / parts, h1 = g * group + (part + 1) * group / parts;
            const int64_t m = h1 - h0; /* heads h0 .. h1 - 1: head h's scores at s + (h - h0) * L */
            float *best = s + group * L, *total = best + group;
            const kv_t *kh = k + g * cap * d, *vh = v + g * cap * d;
            const uint8_t *vis = visible ? visible + r * L : NULL;
            const int64_t far = window > 0 ? qpos[r] - window : 0; /* keys at this position or before: unseen */
#define UNSEEN(j) ((vis && !vis[j]) || (window > 0 && kpos[j] <= far))
            for (int64_t i = 0; i < m; i++) best[i] = -INFINITY, total[i] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                if (UNSEEN(j)) continue;
                for (int64_t i = 0; i < m; i++) {
                    float *si = s + i * L;
                    si[j] = dot8(q + ((h0 + i) * n + r) * d, kh + j * d, d) * scale;
                    best[i] = si[j] > best[i] ? si[j] : best[i];
                }
            }
            for (int64_t j = 0; j < L; j++) {
                if (UNSEEN(j)) continue;
                for (int64_t i = 0; i < m; i++) {
                    float *si = s + i * L;
                    si[j] = exp_s(si[j] - best[i]);
                    total[i] += si[j];
                }
            }
            for (int64_t i = 0; i < m; i++)
                for (int64_t x = 0; x < d; x++) out[(r * H + h0 + i) * d + x] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                if (UNSEEN(j)) continue;
                const kv_t *vj = vh + j * d;
                for (int64_t i = 0; i < m; i++) {
                    const float p = s[i * L + j] / total[i];
                    float *o = out + (r * H + h0 + i) * d;
#if defined(GG_KV_F16) && defined(GG_AVX2)
                    if (vec() && (d & 7) == 0) { /* the same products and sums, 8 at a time */
                        const __m256 pv = _mm256_set1_ps(p);
                        for (int64_t x = 0; x < d; x += 8) {
                            const __m256 vx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vj + x)));
                            _mm256_storeu_ps(o + x, _mm256_add_ps(_mm256_loadu_ps(o + x), _mm256_mul_ps(pv, vx)));
                        }
                        continue;
                    }
#endif
                    for (int64_t x = 0; x < d; x++) o[x] = o[x] + p * kv_get(vj[x]);
                }
            }
#undef UNSEEN
        }
        free(s);
    }
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* the decoder layers of one pass, in one call (the Python loop around the kernels cost about
 * 0.1 ms a layer) */

/* x[r, :] += y[r, :] (a residual add, elementwise). */
static void add_rows(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

/* x [n, hidden] (the embedded tokens in, the last layer's output out) through n_layers layers:
 *   h = norm1(x); q, k, v = qkv(h) (+ biases); q, k = qk_norm(q, k) per head (where the layer has
 *   them); q, k = rope(q, k); a = o(attention(q, k, v)); x += post1(a) (post1: where the layer has it);
 *   h = norm2(x); f = down(act(gate_up(h))) with act SwiGLU or GeGLU; x += post2(f),
 * for the rows of n_seq sequences at once: sequence s owns rows_of[s] consecutive rows of x (pos, likewise), its
 * own cache caches[s] ([layers, 2, kv, cap, d] fp32, the pass's keys and values going to its rows
 * starts[s] .. starts[s] + rows_of[s] - 1), the positions of its cache rows kposes[s] (int64 [cap],
 * those of the pass's rows already written; read by sliding-window layers) and mask visibles[s]
 * ([rows_of[s], starts[s] + rows_of[s]] uint8, or 0: one row that sees every key). Every weight is
 * read once for all the rows; each row's result is the one-sequence pass's, bit for bit (every step
 * is per row, and attention reads only its sequence's keys). scratch: at least n * (hidden + (heads
 * + 2 kv) d + 2 heads d + 3 ffn) floats. Returns 0, or the failing step's code. */
static int gguf_forward_seqs(const int64_t *layers, int64_t n_layers, int64_t hidden, int64_t heads, int64_t kv, int64_t d,
                      int64_t ffn, int neox, int act, int64_t cap, float eps, float scale, float *x, int64_t n,
                      const int64_t *pos, int64_t n_seq, const int64_t *rows_of, const uint64_t *visibles,
                      const uint64_t *caches, const int64_t *starts, const uint64_t *kposes, float *scratch, int threads) {
    const int64_t qkvw = (heads + 2 * kv) * d;
    float *h = scratch, *qkv = h + n * hidden, *q = qkv + n * qkvw, *att = q + n * heads * d, *gu = att + n * heads * d,
          *actv = gu + n * 2 * ffn;
    for (int64_t li = 0; li < n_layers; li++) {
        const int64_t *L = layers + li * L_FIELDS;
        int32_t t3[3], t2[2], t1;
        uint64_t p3[3], b3[3], p2[2], p1;
        int64_t o3[3], o2[2], o1;
        for (int i = 0; i < 3; i++) t3[i] = (int32_t)L[L_qkv_type + i], p3[i] = (uint64_t)L[L_qkv_ptr + i],
                                    o3[i] = L[L_qkv_out + i], b3[i] = (uint64_t)L[L_qkv_bias + i];
        for (int i = 0; i < 2; i++) t2[i] = (int32_t)L[L_gu_type + i], p2[i] = (uint64_t)L[L_gu_ptr + i], o2[i] = L[L_gu_out + i];
        const float *qnorm = (const float *)(uintptr_t)L[L_q_norm], *knorm = (const float *)(uintptr_t)L[L_k_norm];
        const float *post1 = (const float *)(uintptr_t)L[L_post1], *post2 = (const float *)(uintptr_t)L[L_post2];
        const float *cos_t = (const float *)(uintptr_t)L[L_cos], *sin_t = (const float *)(uintptr_t)L[L_sin];
        const int64_t window = L[L_window];
        int rc;
        gguf_rmsnorm(x, (const float *)(uintptr_t)L[L_norm1], n, hidden, eps, h);
        if ((rc = gguf_matmul_multi(3, t3, p3, o3, b3[0] || b3[1] || b3[2] ? b3 : NULL, hidden, h, n, qkv, qkvw, 0, threads))) return rc;
        for (int64_t r = 0; r < n; r++) { /* each head of Q and of K normalized on its own (in place) */
            if (qnorm) gguf_rmsnorm(qkv + r * qkvw, qnorm, heads, d, eps, qkv + r * qkvw);
            if (knorm) gguf_rmsnorm(qkv + r * qkvw + heads * d, knorm, kv, d, eps, qkv + r * qkvw + heads * d);
        }
        for (int64_t sq = 0, r = 0; sq < n_seq; r += rows_of[sq], sq++) {
            kv_t *keys = (kv_t *)(uintptr_t)caches[sq] + li * 2 * kv * cap * d, *values = keys + kv * cap * d;
            const int64_t m = rows_of[sq], start = starts[sq];
            gguf_rope_store(qkv + r * qkvw, pos + r, cos_t, sin_t, neox, m, heads, kv, d, q + r * heads * d, keys, values,
                            cap, start);
            if ((rc = gguf_attention(q + r * heads * d, keys, values, (const uint8_t *)(uintptr_t)visibles[sq],
                                     att + r * heads * d, heads, kv, m, start + m, d, cap, scale, pos + r,
                                     (const int64_t *)(uintptr_t)kposes[sq], window, threads))) return rc;
        }
        t1 = (int32_t)L[L_o_type], p1 = (uint64_t)L[L_o_ptr], o1 = L[L_o_out];
        if (post1) { /* the attention's output normalized, then added (h is free once Q, K, V are made) */
            if ((rc = gguf_matmul_multi(1, &t1, &p1, &o1, NULL, heads * d, att, n, h, hidden, 0, threads))) return rc;
            gguf_rmsnorm(h, post1, n, hidden, eps, h);
            add_rows(x, h, n * hidden);
        } else if ((rc = gguf_matmul_multi(1, &t1, &p1, &o1, NULL, heads * d, att, n, x, hidden, 1, threads))) {
            return rc;
        }
        gguf_rmsnorm(x, (const float *)(uintptr_t)L[L_norm2], n, hidden, eps, h);
        if ((rc = gguf_matmul_multi(2, t2, p2, o2, NULL, hidden, h, n, gu, 2 * ffn, 0, threads))) return rc;
        gguf_glu(gu, n, ffn, actv, act == ACT_GEGLU, threads);
        t1 = (int32_t)L[L_down_type], p1 = (uint64_t)L[L_down_ptr], o1 = L[L_down_out];
        if (post2) {
            if ((rc = gguf_matmul_multi(1, &t1, &p1, &o1, NULL, ffn, actv, n, h, hidden, 0, threads))) return rc;
            gguf_rmsnorm(h, post2, n, hidden, eps, h);
            add_rows(x, h, n * hidden);
        } else if ((rc = gguf_matmul_multi(1, &t1, &p1, &o1, NULL, ffn, actv, n, x, hidden, 1, threads))) {
            return rc;
        }
    }
    return 0;
}

#undef quantize_block
#undef quantize_row_k
#undef quantize_row_32
#undef gguf_quantize_rows
#undef run_seg
#undef gguf_matmul_multi
#undef gguf_matmul
#undef gguf_rmsnorm
#undef exp_s
#undef gguf_exp
#undef glu_z
#undef gguf_glu
#undef gguf_gelu
#undef gguf_rope_store
#undef dot8
#undef gguf_attention
#undef add_rows
#undef gguf_forward_seqs

#else /* GG_KERNEL_BODY: one vector path's kernels for the quantized types (see above) */

/* The tiled K-type kernels (four rows and more) take a block in two halves of 128 weights (4 vectors
 * of 32 and their 4 scale vectors held in registers) and run each half over the rows; a row's
 * integer lanes from the first half wait in `part` (exact). For one to three rows the whole block
 * stays in registers instead (the register kernels). */

static inline __attribute__((always_inline)) __m256i KN(k_half)(const __m256i *qv, const __m256i *sv, const int8_t *x) {
    __m256i sum = DOT_FIRST(_mm256_maddubs_epi16(qv[0], _mm256_loadu_si256((const __m256i *)x)), sv[0]);
    sum = DOT_ADD(sum, _mm256_maddubs_epi16(qv[1], _mm256_loadu_si256((const __m256i *)(x + 32))), sv[1]);
    sum = DOT_ADD(sum, _mm256_maddubs_epi16(qv[2], _mm256_loadu_si256((const __m256i *)(x + 64))), sv[2]);
    return DOT_ADD(sum, _mm256_maddubs_epi16(qv[3], _mm256_loadu_si256((const __m256i *)(x + 96))), sv[3]);
}

static inline __attribute__((always_inline)) void KN(q6k_few)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, const int NR,
                                                           const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 256;
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = s->w + j * s->row_bytes;
        __m256 acc[4];
        for (int t = 0; t < NR; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 210;
            prefetch_block(blk, 210);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            __m256i sum[4];
            for (int t = 0; t < NR; t++) sum[t] = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++) {
                __m256i qv[4];
                q6k_vectors(blk, h, qv);
                const __m256i sh = _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
                for (int v = 0; v < 4; v++) {
                    const __m256i sv = _mm256_shuffle_epi8(sh, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v + 1))),
                                                                                _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v)))));
                    for (int t = 0; t < NR; t++) {
                        const int8_t *x = A->qk + (r0 + t) * n_in + b * 256 + 128 * h + 32 * v;
                        sum[t] = DOT_ADD(sum[t], _mm256_maddubs_epi16(qv[v], _mm256_loadu_si256((const __m256i *)x)), sv);
                    }
                }
            }
            const __m256 dv = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[208] | (blk[209] << 8))));
            for (int t = 0; t < NR; t++) {
                const int64_t r = r0 + t;
                const __m256i adj = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(A->bk + r * (n_in / 16) + b * 16)));
                const __m256i st = _mm256_sub_epi32(sum[t], _mm256_slli_epi32(adj, 5));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(A->dk + r * nb + b)), _mm256_cvtepi32_ps(st), acc[t]);
            }
        }
        for (int t = 0; t < NR; t++)
            store(o->y + (r0 + t) * o->ldy + s->col + j, tree8v(acc[t]), s->bias, j, o->accumulate);
    }
}

/* Q6_K: ql[128], qh[64], int8 scales[16], d (fp16). Half h is ql[64h .. 64h + 63] and qh[32h ..]. */
static inline __attribute__((always_inline)) void KN(q6k_tile)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, const int64_t nr,
                                                            const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 256;
    __m256i part[RT];
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = s->w + j * s->row_bytes;
        __m256 acc[RT];
        for (int t = 0; t < nr; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 210;
            prefetch_block(blk, 210);
            const __m256 dv = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[208] | (blk[209] << 8))));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            for (int h = 0; h < 2; h++) {
                __m256i qv[4];
                q6k_vectors(blk, h, qv);
                /* vector v (elements 32v .. 32v + 31 of the half) has sub-blocks 8h + 2v (low 128 bits)
                 * and 8h + 2v + 1 (high): their scales are s16 lanes 2v, 2v + 1 of sc16's half h */
                const __m256i sh = _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
                __m256i sv[4];
                for (int v = 0; v < 4; v++)
                    sv[v] = _mm256_shuffle_epi8(sh, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v + 1))),
                                                                     _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v)))));
                for (int64_t t = 0; t < nr; t++) {
                    const int64_t r = r0 + t;
                    const __m256i half = KN(k_half)(qv, sv, A->qk + r * n_in + b * 256 + 128 * h);
                    if (h == 0) {
                        part[t] = half;
                        continue;
                    }
                    __m256i sum = _mm256_add_epi32(part[t], half);
                    const __m256i adj = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(A->bk + r * (n_in / 16) + b * 16)));
                    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(adj, 5));
                    const __m256 dx = _mm256_set1_ps(A->dk[r * nb + b]);
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(sum), acc[t]);
                }
            }
        }
        for (int64_t t = 0; t < nr; t++)
            store(o->y + (r0 + t) * o->ldy + s->col + j, tree8v(acc[t]), s->bias, j, o->accumulate);
    }
}

#ifdef GG_AMX_BODY
static inline __attribute__((always_inline)) __m512i KN(pair512)(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Q6_K on the AMX path for passes of 4 rows and more (AMX_BLOCK at most): two outputs at a time,
 * one in each half of a 512-bit vector, every row of the pass on one decoding of their blocks. A
 * half is q6k_tile's 8 lanes with the same integers (the same products, added in another order:
 * exact) and the same float operations in their order, so each output gets q6k_tile's and
 * q6k_few's bits; the vector instructions per row and output are halved. (Q6_K's sub-blocks of 16
 * and its 8-lane float sums leave the tile products nothing to take without other bits.) */
static void KN(q6k_pairs)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, const int64_t nr, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 256;
    __m512 acc[AMX_BLOCK];
    for (int64_t j = j0; j < j1; j += 2) {
        const int64_t j2 = j + 1 < j1 ? j + 1 : j; /* an odd last output pairs with itself, stored once */
        const uint8_t *row0 = s->w + j * s->row_bytes, *row1 = s->w + j2 * s->row_bytes;
        for (int64_t t = 0; t < nr; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk0 = row0 + b * 210, *blk1 = row1 + b * 210;
            prefetch_block(blk0, 210);
            prefetch_block(blk1, 210);
            const __m512 dv = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_castps256_ps512(_mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk0[208] | (blk0[209] << 8)))))),
                _mm256_castps_pd(_mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk1[208] | (blk1[209] << 8))))), 1));
            const __m256i sca = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk0 + 192)));
            const __m256i scb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk1 + 192)));
            const __m512i sc16 = KN(pair512)(sca, scb);
            __m512i qv[8], sv[8]; /* half h, vector v at 4h + v */
            for (int h = 0; h < 2; h++) {
                __m256i qa[4], qb[4];
                q6k_vectors(blk0, h, qa);
                q6k_vectors(blk1, h, qb);
                const __m256i sha = _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(sca, 1) : _mm256_castsi256_si128(sca));
                const __m256i shb = _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(scb, 1) : _mm256_castsi256_si128(scb));
                for (int v = 0; v < 4; v++) {
                    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v + 1))),
                                                          _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * v))));
                    qv[4 * h + v] = KN(pair512)(qa[v], qb[v]);
                    sv[4 * h + v] = KN(pair512)(_mm256_shuffle_epi8(sha, pick), _mm256_shuffle_epi8(shb, pick));
                }
            }
            /* two rows at a time, each row's sum in two halves (independent chains of products) */
#define Q6K_ROW(t)                                                                                                          \
    do {                                                                                                                    \
        const int64_t r = r0 + (t);                                                                                         \
        const int8_t *x = A->qk + r * n_in + b * 256;                                                                       \
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();                                                   \
        for (int u = 0; u < 4; u++) {                                                                                       \
            lo = _mm512_dpwssd_epi32(lo, _mm512_maddubs_epi16(qv[u], _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 32 * u)))), sv[u]); \
            hi = _mm512_dpwssd_epi32(hi, _mm512_maddubs_epi16(qv[u + 4], _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 128 + 32 * u)))), sv[u + 4]); \
        }                                                                                                                   \
        const __m512i bk = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(A->bk + r * (n_in / 16) + b * 16))); \
        const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_slli_epi32(_mm512_madd_epi16(sc16, bk), 5));  \
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(A->dk[r * nb + b])), _mm512_cvtepi32_ps(sum), acc[t]);   \
    } while (0)
            int64_t t = 0;
            for (; t + 2 <= nr; t += 2) {
                Q6K_ROW(t);
                Q6K_ROW(t + 1);
            }
            if (t < nr) Q6K_ROW(t);
#undef Q6K_ROW
        }
        for (int64_t t = 0; t < nr; t++) {
            float *y = o->y + (r0 + t) * o->ldy + s->col;
            store(y + j, tree8v(_mm512_castps512_ps256(acc[t])), s->bias, j, o->accumulate);
            if (j2 != j)
                store(y + j2, tree8v(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))), s->bias, j2,
                      o->accumulate);
        }
    }
}
#endif

static void KN(q6k)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    switch (nr) { /* the register kernel, its loops over the rows unrolled, for up to three rows */
    case 1: KN(q6k_few)(s, j0, j1, r0, 1, o); break;
    case 2: KN(q6k_few)(s, j0, j1, r0, 2, o); break;
    case 3: KN(q6k_few)(s, j0, j1, r0, 3, o); break;
    default: KN(q6k_tile)(s, j0, j1, r0, nr, o);
    }
}

/* The 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), one function per type (`type` a
 * constant: no branch on it in the loops), on groups of 8 outputs in the repacked layout (see "rows
 * repacked eight at a time"; a tensor in the file's layout is repacked here, a group at a time, into
 * the thread's pack_buffer). A 32-bit lane is an output: vector v of a record holds elements
 * 4v .. 4v + 3 of each of the 8 rows, multiplied by those 4 activations broadcast, so each
 * activation block is read once for 8 outputs and the block's integer sums of the 8 outputs land in
 * one vector, then one multiply-add of 8 fp32 accumulators, as k32_scalar does for each output.
 *
 * k32_weights: record rec's 8 vectors of unsigned weights, for Q4_0, Q4_1 (the nibble q), Q5_0,
 * Q5_1 (the five bits q): Q4_0's and Q5_0's offset (8, 16) is taken off the sum as offset * (the
 * activation block's sum). (Q8_0's and IQ4_NL's signed weights: k32_signed.) */
static inline __attribute__((always_inline)) void KN(k32_weights)(const int type, const uint8_t *rec, __m256i w[8]) {
    const uint8_t *qs = rec + x8_at(type, 0);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int u = 0; u < 4; u++) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * u));
        w[u] = _mm256_and_si256(p, m4);
        w[u + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
    }
    if (type == T_Q5_0 || type == T_Q5_1) { /* bit v of the high bits' bytes, as 16, into vector v */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(rec + x8_at(type, 1)));
        for (int v = 0; v < 8; v++) w[v] = _mm256_or_si256(w[v], bit_moved(h, v, 4));
    }
}

/* The block's integer sums of the 8 outputs against activation block x (s0: its sum), w the
 * weights as k32_weights gives them. AVX2: maddubs' s16 pairs summed as s16 where no sum can
 * overflow (a pair of Q4's nibbles (<= 15) times activations (|x| <= 127) is below 3810 in
 * magnitude: eight pairs' sum below 2^15; Q5's five bits (<= 31): four), then madd by 1 into int32. */
static inline __attribute__((always_inline)) __m256i KN(k32_sum)(const int type, const __m256i *w, const int8_t *x,
                                                                int32_t s0) {
    __m256i xb[8];
    for (int v = 0; v < 8; v++) {
        int32_t x4;
        memcpy(&x4, x + 4 * v, 4);
        xb[v] = _mm256_set1_epi32(x4);
    }
#ifdef DOT_ACC
    __m256i sum = DOT_ACC(_mm256_setzero_si256(), w[0], xb[0]);
    for (int v = 1; v < 8; v++) sum = DOT_ACC(sum, w[v], xb[v]);
#else
    const __m256i one = _mm256_set1_epi16(1);
    __m256i p[8];
    for (int v = 0; v < 8; v++) p[v] = _mm256_maddubs_epi16(w[v], xb[v]);
    const __m256i a = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    const __m256i b = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
    __m256i sum;
    if (type == T_Q4_0 || type == T_Q4_1) sum = _mm256_madd_epi16(_mm256_add_epi16(a, b), one);
    else sum = _mm256_add_epi32(_mm256_madd_epi16(a, one), _mm256_madd_epi16(b, one));
#endif
    if (type == T_Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(s0 * 8));
    if (type == T_Q5_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(s0 * 16));
    return sum;
}

/* Q8_0's and IQ4_NL's block b (record rec) against rows r0 .. r0 + G - 1: the integer sums of the
 * 8 outputs into sum[0 .. G - 1], taken a vector at a time, each applied to every row (with eight
 * vectors and their magnitudes held across the rows, the registers spill). The weights are signed:
 * |w| times x with w's sign (exact: |x| <= 127), a pair of products up to 2 * 128 * 127, so each
 * vector's s16 pairs go into int32 at once (madd by 1). */
static inline __attribute__((always_inline)) void KN(k32_signed)(const int type, const uint8_t *rec, const int8_t *xq,
                                                              int64_t n_in, const int G, __m256i *sum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4));
    for (int t = 0; t < G; t++) sum[t] = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) {
        __m256i w;
        if (type == T_Q8_0) w = _mm256_loadu_si256((const __m256i *)(rec + 16 + 32 * v));
        else { /* IQ4_NL: the low nibbles of the 32 bytes at 32v (v < 4), the high ones of those at 32(v - 4) */
            const __m256i p = _mm256_loadu_si256((const __m256i *)(rec + x8_at(type, 0) + 32 * (v & 3)));
            w = _mm256_shuffle_epi8(levels, _mm256_and_si256(v < 4 ? p : _mm256_srli_epi16(p, 4), m4));
        }
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int t = 0; t < G; t++) {
            int32_t x4;
            memcpy(&x4, xq + t * n_in + 4 * v, 4);
            const __m256i xb = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
#ifdef DOT_ACC
            sum[t] = DOT_ACC(sum[t], aw, xb);
#else
            sum[t] = DOT_ADD(sum[t], _mm256_maddubs_epi16(aw, xb), _mm256_set1_epi16(1));
#endif
            __asm__("" : "+x"(sum[t])); /* a running sum in a register */
        }
    }
}

/* The 8 outputs of group grp (records of nb blocks; the first n of them written) against G (1..4)
 * rows, their accumulators in registers: per block, lanes += (d * dx) * sums (one fused
 * multiply-add), and Q4_1's and Q5_1's mins: lanes_m += (m * dx) * s0; then lanes (+ lanes_m). */
static inline __attribute__((always_inline)) void KN(k32_group)(const int type, const Seg *s, const uint8_t *grp, int64_t j,
                                                            const int n, int64_t r0, const int G, const Out *o) {
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 32;
    const int rec_bytes = 8 * block_bytes(type);
    const int sgn = type == T_Q8_0 || type == T_IQ4_NL;
    const int8_t *xq = A->q0 + r0 * n_in;
    const float *xd = A->d0 + r0 * nb;
    const int32_t *xs = A->s0 + r0 * nb;
    __m256 acc[4], accm[4];
    for (int t = 0; t < G; t++) acc[t] = _mm256_setzero_ps(), accm[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = grp + b * rec_bytes;
        for (int i = 0; X8_PF && i < rec_bytes; i += 64) _mm_prefetch((const char *)(rec + X8_PF + i), _MM_HINT_T0);
        __m256i sums[4];
        if (sgn) KN(k32_signed)(type, rec, xq + b * 32, n_in, G, sums);
        else {
            __m256i w[8];
            KN(k32_weights)(type, rec, w);
            for (int t = 0; t < G; t++) sums[t] = KN(k32_sum)(type, w, xq + t * n_in + b * 32, xs[t * nb + b]);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
        for (int t = 0; t < G; t++) {
            const __m256i sum = sums[t];
            const __m256 dx = _mm256_set1_ps(xd[t * nb + b]);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sum), acc[t]);
            if (has_m(type)) {
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
                accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(m, dx), _mm256_set1_ps((float)xs[t * nb + b]), accm[t]);
            }
        }
    }
    for (int t = 0; t < G; t++) {
        float v[8];
        _mm256_storeu_ps(v, has_m(type) ? _mm256_add_ps(acc[t], accm[t]) : acc[t]);
        for (int k = 0; k < n; k++) store(o->y + (r0 + t) * o->ldy + s->col + j + k, v[k], s->bias, j + k, o->accumulate);
    }
}

/* The 8 outputs of group grp against rows r0 .. r0 + nr - 1, four at a time. */
static inline __attribute__((always_inline)) void KN(k32_rows)(const int type, const Seg *s, const uint8_t *grp, int64_t j,
                                                            const int n, int64_t r0, const int64_t nr, const Out *o) {
    int64_t t = 0;
    for (; t + 4 <= nr; t += 4) KN(k32_group)(type, s, grp, j, n, r0 + t, 4, o);
    switch (nr - t) {
    case 3: KN(k32_group)(type, s, grp, j, n, r0 + t, 3, o); break;
    case 2: KN(k32_group)(type, s, grp, j, n, r0 + t, 2, o); break;
    case 1: KN(k32_group)(type, s, grp, j, n, r0 + t, 1, o); break;
    default: break;
    }
}

/* One function per grouped type: outputs j0 .. j1 - 1 (j0 a multiple of 8 for a repacked tensor) in
 * groups of 8, each through ROWS(TYPE, s, grp, j, n, r0, nr, o); a tensor in the file's layout is
 * repacked a group at a time into the thread's pack_buffer (where there is no memory for a group,
 * SCALAR runs: the portable kernel, the same operations). */
#define GROUPED_TYPE(NAME, TYPE, SCALAR, ROWS)                                                                \
    static void KN(NAME)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {        \
        const int64_t nb = o->a->n_in / block_elems(TYPE);                                                    \
        uint8_t *buf = s->x8 ? NULL : pack_buffer((size_t)(8 * s->row_bytes));                               \
        if (!s->x8 && !buf) {                                                                                 \
            SCALAR(s, j0, j1, r0, nr, o);                                                                     \
            return;                                                                                           \
        }                                                                                                     \
        for (int64_t j = j0; j < j1; j += 8) {                                                                \
            const int n = j1 - j < 8 ? (int)(j1 - j) : 8;                                                     \
            const uint8_t *grp = s->w + j * s->row_bytes;                                                     \
            if (!s->x8) {                                                                                     \
                x8_pack(TYPE, grp, s->row_bytes, n, nb, buf);                                                 \
                grp = buf;                                                                                    \
            }                                                                                                 \
            KN(ROWS)(TYPE, s, grp, j, n, r0, nr, o);                                                          \
        }                                                                                                     \
    }
GROUPED_TYPE(k32_q4_0, T_Q4_0, k32_scalar, k32_rows)
GROUPED_TYPE(k32_q4_1, T_Q4_1, k32_scalar, k32_rows)
GROUPED_TYPE(k32_q5_0, T_Q5_0, k32_scalar, k32_rows)
GROUPED_TYPE(k32_q5_1, T_Q5_1, k32_scalar, k32_rows)
GROUPED_TYPE(k32_q8_0, T_Q8_0, k32_scalar, k32_rows)
GROUPED_TYPE(k32_iq4_nl, T_IQ4_NL, k32_scalar, k32_rows)

static void KN(k32)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    switch (s->type) {
    case T_Q4_0: KN(k32_q4_0)(s, j0, j1, r0, nr, o); break;
    case T_Q4_1: KN(k32_q4_1)(s, j0, j1, r0, nr, o); break;
    case T_Q5_0: KN(k32_q5_0)(s, j0, j1, r0, nr, o); break;
    case T_Q5_1: KN(k32_q5_1)(s, j0, j1, r0, nr, o); break;
    case T_Q8_0: KN(k32_q8_0)(s, j0, j1, r0, nr, o); break;
    default: KN(k32_iq4_nl)(s, j0, j1, r0, nr, o);
    }
}

/* Q4_K and Q5_K on groups of 8 outputs in the repacked layout (a tensor in the file's layout is
 * repacked a group at a time into the thread's pack_buffer), a 32-bit lane an output, as the
 * 32-weight types: vector (p, q) of a record holds qs[32p + 4q ..] of each of the 8 rows, its low
 * nibbles multiplied by activations 64p + 4q .. (sub-block 2p), its high ones by 64p + 32 + 4q ..
 * (sub-block 2p + 1), each four broadcast. maddubs' s16 pairs of one sub-block add up as s16 where
 * no sum can overflow (a pair of nibbles times activations is below 3810 in magnitude: eight
 * vectors' sum below 2^15; Q5_K's five bits, below 7874: four), then one multiply by the 8 outputs'
 * scales into int32 (DOT_ADD). The mins' term, one integer per output: sum over the sub-blocks of
 * m * (the sum of its 32 activations). Per block and output: acc += (d * dx) * sum, then
 * acc -= (dmin * dx) * mins (kq_scalar's operations).
 *
 * IQ4_XS the same way, its vector (s, q) holding qs[16s + 4q ..] of the 8 rows, low and high
 * nibbles both of sub-block s, through the level table. The levels are signed: |w| times x with
 * w's sign (exact: |x| <= 127), and a pair of those can reach 2 * 127 * 127, so each vector's s16
 * pairs are multiplied by the scales into int32 at once. Per block and output: acc += (d * dx) * sum. */

/* The 8 outputs' scales and mins of a record: byte 8s + k (s = 0..3) of lo, of hi for s + 4. */
static inline __attribute__((always_inline)) void KN(k8_scales)(const uint8_t *rec, __m256i *sc_lo, __m256i *sc_hi,
                                                             __m256i *mn_lo, __m256i *mn_hi) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(rec + 32)), b = _mm256_loadu_si256((const __m256i *)(rec + 64));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + 96));
    const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    /* get_scale_min_k4 on all 8 rows at once: scales[0..3] & 63, scales[4..7] & 63 (the mins), and
     * for sub-blocks 4..7 the nibbles of scales[8..11] with the top two bits of scales[0..3] (of
     * scales[4..7] for the mins) above them. A 16-bit shift by 6 (4) leaves in a byte's low 2 (4)
     * bits only its own bits. */
    *sc_lo = _mm256_and_si256(a, m6);
    *mn_lo = _mm256_and_si256(b, m6);
    *sc_hi = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(a, 6), m2), 4));
    *mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 6), m2), 4));
}

/* What a record's products need besides its weights: sv[s], the 8 outputs' scales of sub-block s
 * (each in both s16 halves of its lane); mv[p], their mins of sub-blocks 2p, 2p + 1 (the s16 pair
 * of each lane); d, dmin. */
typedef struct {
    __m256i sv[8], mv[4];
    __m256 d, dmin;
    const uint8_t *sb; /* Q2_K, Q3_K: the 8 rows' scale bytes of sub-block g at sb + 8g (k16_rec) */
    uint8_t q3[128];   /* Q3_K's, unpacked */
} KN(K8Rec);


/* Q2_K and Q3_K (sub-blocks of 16): vector (h, j, q) of a record holds elements 128h + 32j + 4q ..
 * of the 8 rows (bits 2j of qs vector 8h + q; Q3_K's third bit, bit 4h + j of hmask vector q, as
 * 4), multiplied by those four activations broadcast. The four vectors of a sub-block add up as
 * s16 (pairs below 2 * 7 * 127), then one multiply by the 8 outputs' scales. The correction, one
 * integer per output: Q2_K's mins (sum over g of m * the sum of 16 activations g), Q3_K's offset
 * 4 * (sum over g of scale * that sum), taken off the products' sum. */

/* K8Rec for Q2_K, Q3_K: sb, the 8 rows' scale bytes of sub-block g at sb + 8g (byte k: row k):
 * Q2_K's own (scale | min << 4), Q3_K's unpacked into q3 (its six-bit scale, 0..63, 32 above the value). */
static inline __attribute__((always_inline)) void KN(k16_rec)(const int type, const uint8_t *rec, KN(K8Rec) *R) {
    if (type == T_Q2_K) {
        R->sb = rec + 32;
        R->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
    } else { /* q3k_scales on the 8 rows at once: a0, a1, a2 the bytes 0..3, 4..7, 8..11 of each */
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(rec + 16)), a1 = _mm256_loadu_si256((const __m256i *)(rec + 48));
        const __m256i a2 = _mm256_loadu_si256((const __m256i *)(rec + 80));
        _mm256_storeu_si256((__m256i *)R->q3, _mm256_or_si256(_mm256_and_si256(a0, m4), _mm256_slli_epi16(_mm256_and_si256(a2, m2), 4)));
        _mm256_storeu_si256((__m256i *)(R->q3 + 32),
                            _mm256_or_si256(_mm256_and_si256(a1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(a2, 2), m2), 4)));
        _mm256_storeu_si256((__m256i *)(R->q3 + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a0, 4), m4),
                                                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(a2, 4), m2), 4)));
        _mm256_storeu_si256((__m256i *)(R->q3 + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a1, 4), m4),
                                                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(a2, 6), m2), 4)));
        R->sb = R->q3;
    }
    R->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
}

/* Sub-block g's 8 scales (Q2_K's low nibbles, Q3_K's less 32), each in both s16 halves of its lane. */
static inline __attribute__((always_inline)) __m256i KN(k16_scale)(const int type, const KN(K8Rec) *R, int g) {
    const __m256i dup = _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128,
                                         4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7, -128);
    int64_t w;
    memcpy(&w, R->sb + 8 * g, 8);
    __m256i v = _mm256_set1_epi64x(w);
    if (type == T_Q2_K) v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    v = _mm256_shuffle_epi8(v, dup);
    return type == T_Q3_K ? _mm256_sub_epi16(v, _mm256_set1_epi16(32)) : v;
}

/* The correction's weights of sub-blocks 2p, 2p + 1 (Q2_K's mins, Q3_K's scales less 32) as the s16
 * pair of each lane. */
static inline __attribute__((always_inline)) __m256i KN(k16_pair)(const int type, const KN(K8Rec) *R, int p) {
    const __m256i pair = _mm256_setr_epi8(0, -128, 8, -128, 1, -128, 9, -128, 2, -128, 10, -128, 3, -128, 11, -128,
                                          4, -128, 12, -128, 5, -128, 13, -128, 6, -128, 14, -128, 7, -128, 15, -128);
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(R->sb + 16 * p)));
    if (type == T_Q2_K) v = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    v = _mm256_shuffle_epi8(v, pair);
    return type == T_Q3_K ? _mm256_sub_epi16(v, _mm256_set1_epi16(32)) : v;
}

static inline __attribute__((always_inline)) __m256i KN(k16_vector)(const int type, const uint8_t *rec, int h, int j, int q) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(rec + k8_qs_at(type) + 32 * (8 * h + q)));
    __m256i v = _mm256_and_si256(j ? _mm256_srli_epi16(bits, 2 * j) : bits, _mm256_set1_epi8(3));
    if (type == T_Q3_K) v = _mm256_or_si256(v, bit_moved(_mm256_loadu_si256((const __m256i *)(rec + 112 + 32 * q)), 4 * h + j, 2));
    return v;
}

/* Sub-block 8h + 2j + half of block b (record rec: its four vectors decoded here, or read from dec)
 * against rows r0 .. r0 + G - 1, into the integer sums sum[0 .. G - 1]. A few rows (Q2_K: 1-2,
 * Q3_K: 1-3): each vector applied to every row as it is decoded, the rows' 16-bit sums running
 * side by side; more: the four vectors held, each row's 16-bit sum made in turn (the rows' running
 * sums would fill the registers). Measured both ways (benchmarks/gguf_kernel_ab.c): held, 4 rows
 * 1.05-1.3x faster, 2 rows (Q3_K: 3) 1.2-1.4x slower. */
static inline __attribute__((always_inline)) void KN(k16_sub)(const int type, const uint8_t *rec, const __m256i *dec,
                                                           const KN(K8Rec) *R, const Acts *A, int64_t b, int64_t r0,
                                                           const int G, int h, int j, int half, __m256i *sum) {
    const int8_t *x = A->qk + r0 * A->n_in + b * 256 + 128 * h + 32 * j + 16 * half; /* row r0's activations */
    if (G < (type == T_Q3_K ? 4 : 3)) {
        __m256i sl[3];
        for (int t = 0; t < G; t++) sl[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            const __m256i v = dec ? dec[8 * (4 * h + j) + 4 * half + q] : KN(k16_vector)(type, rec, h, j, 4 * half + q);
            for (int t = 0; t < G; t++) {
                int32_t xw;
                memcpy(&xw, x + t * A->n_in + 4 * q, 4);
                sl[t] = _mm256_add_epi16(sl[t], _mm256_maddubs_epi16(v, _mm256_set1_epi32(xw)));
                __asm__("" : "+x"(sl[t])); /* running sums in registers */
            }
        }
        const __m256i sv = KN(k16_scale)(type, R, 8 * h + 2 * j + half); /* (made here: one register fewer in the loop) */
        for (int t = 0; t < G; t++) sum[t] = DOT_ADD(sum[t], sl[t], sv);
        return;
    }
    const __m256i sv = KN(k16_scale)(type, R, 8 * h + 2 * j + half);
    __m256i v[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) v[q] = dec ? dec[8 * (4 * h + j) + 4 * half + q] : KN(k16_vector)(type, rec, h, j, 4 * half + q);
    for (int t = 0; t < G; t++) {
        __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            int32_t xw;
            memcpy(&xw, x + t * A->n_in + 4 * q, 4);
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[q], _mm256_set1_epi32(xw)));
        }
        sum[t] = DOT_ADD(sum[t], s16, sv);
        __asm__("" : "+x"(sum[t]));
    }
}

/* Block b (record rec) of the 8 outputs against rows r0 .. r0 + G - 1 (G = 1..4), into acc. Decoding
 * as it goes (dec NULL), the loops are unrolled: each vector's shift a constant (GCC left them as
 * loops, with a shift by a register and a compare and branch a vector: one row cost 1.2-1.7x more).
 * On a record decoded ahead (dec, a pass of many rows) they stay loops: unrolled there too, passes
 * of 8 and 16 rows cost 1.4-2.0x more (benchmarks/gguf_kernel_ab.c). */
static inline __attribute__((always_inline)) void KN(k16_rows)(const int type, const uint8_t *rec, const __m256i *dec,
                                                            const KN(K8Rec) *R, const Acts *A, int64_t b, int64_t r0,
                                                            const int G, __m256 *acc) {
    const int64_t n_in = A->n_in, nb = n_in / 256;
    __m256i sum[4];
    for (int t = 0; t < G; t++) sum[t] = _mm256_setzero_si256();
    if (dec) {
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int half = 0; half < 2; half++) KN(k16_sub)(type, rec, dec, R, A, b, r0, G, h, j, half, sum);
    } else {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++) KN(k16_sub)(type, rec, NULL, R, A, b, r0, G, h, j, half, sum);
    }
    __m256i cw[8]; /* the correction's weights, pair p: Q2_K's mins, Q3_K's scales */
    for (int p = 0; p < 8; p++) cw[p] = KN(k16_pair)(type, R, p);
    for (int t = 0; t < G; t++) {
        const int64_t r = r0 + t;
        const int16_t *bs = A->bk + r * (n_in / 16) + b * 16; /* dword p: the sums of 16 number 2p, 2p + 1 */
        __m256i adj = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            int32_t w2;
            memcpy(&w2, bs + 2 * p, 4);
            adj = DOT_ADD(adj, cw[p], _mm256_set1_epi32(w2));
        }
        const __m256 dx = _mm256_set1_ps(A->dk[r * nb + b]);
        if (type == T_Q3_K) {
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(R->d, dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(sum[t], _mm256_slli_epi32(adj, 2))), acc[t]);
        } else {
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(R->d, dx), _mm256_cvtepi32_ps(sum[t]), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(R->dmin, dx), _mm256_cvtepi32_ps(adj), acc[t]);
        }
    }
}

/* IQ4_XS's scales of the 8 outputs: lane k of L holds row k's scales_l (sub-blocks 2i and 2i + 1
 * in the nibbles of byte i), of H row k's scales_h (sub-block s at bit 2s) spread a nibble a byte;
 * so byte i of lane k of ev (od) is row k's six-bit scale of sub-block 2i (2i + 1), plus 32. */
static inline __attribute__((always_inline)) void KN(k8_rec_iq4)(const uint8_t *rec, KN(K8Rec) *R) {
    const __m256i L = _mm256_loadu_si256((const __m256i *)(rec + 32));
    __m256i H = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rec + 16)));
    H = _mm256_and_si256(_mm256_or_si256(H, _mm256_slli_epi32(H, 8)), _mm256_set1_epi32(0x00FF00FF));
    H = _mm256_and_si256(_mm256_or_si256(H, _mm256_slli_epi32(H, 4)), _mm256_set1_epi32(0x0F0F0F0F));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const __m256i ev = _mm256_or_si256(_mm256_and_si256(L, m4), _mm256_slli_epi16(_mm256_and_si256(H, m2), 4));
    const __m256i od = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m2), 4));
    for (int s = 0; s < 8; s++) { /* byte s / 2 of each lane into both of its s16 halves, less 32 */
        const int i = s >> 1;
        const __m256i ctl = _mm256_setr_epi32((int)0x80008000 + 0x00010001 * i, (int)0x80008000 + 0x00010001 * (4 + i),
                                              (int)0x80008000 + 0x00010001 * (8 + i), (int)0x80008000 + 0x00010001 * (12 + i),
                                              (int)0x80008000 + 0x00010001 * i, (int)0x80008000 + 0x00010001 * (4 + i),
                                              (int)0x80008000 + 0x00010001 * (8 + i), (int)0x80008000 + 0x00010001 * (12 + i));
        R->sv[s] = _mm256_sub_epi16(_mm256_shuffle_epi8((s & 1) ? od : ev, ctl), _mm256_set1_epi16(32));
    }
    R->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
}

static inline __attribute__((always_inline)) void KN(k8_rec)(const int type, const uint8_t *rec, KN(K8Rec) *R) {
    if (type == T_Q2_K || type == T_Q3_K) {
        KN(k16_rec)(type, rec, R);
        return;
    }
    if (type == T_IQ4_XS) {
        KN(k8_rec_iq4)(rec, R);
        return;
    }
    __m256i sc_lo, sc_hi, mn_lo, mn_hi;
    KN(k8_scales)(rec, &sc_lo, &sc_hi, &mn_lo, &mn_hi);
    for (int p = 0; p < 4; p++) {
        const __m256i sc = p < 2 ? sc_lo : sc_hi, mn = p < 2 ? mn_lo : mn_hi;
        const __m128i s2 = (p & 1) ? _mm256_extracti128_si256(sc, 1) : _mm256_castsi256_si128(sc);
        const __m128i m2 = (p & 1) ? _mm256_extracti128_si256(mn, 1) : _mm256_castsi256_si128(mn);
        R->sv[2 * p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s2, s2));
        R->sv[2 * p + 1] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s2, s2));
        R->mv[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m2, _mm_srli_si128(m2, 8)));
    }
    R->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
    R->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
}

/* Vector u of a record: its low and high values as bytes (Q4_K, Q5_K: u = 8p + q, sub-blocks 2p and
 * 2p + 1; IQ4_XS: u = 4s + q, the signed levels, both of sub-block s). */
static inline __attribute__((always_inline)) void KN(k8_vector)(const int type, const uint8_t *rec, int u, __m256i *lo,
                                                             __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(rec + k8_qs_at(type) + 32 * u));
    *lo = _mm256_and_si256(bits, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    if (type == T_Q5_K) { /* bits 2p, 2p + 1 of qh[4q + i], as 16 */
        const int p = u >> 3, q = u & 7;
        const __m256i h = _mm256_loadu_si256((const __m256i *)(rec + 128 + 32 * q));
        *lo = _mm256_or_si256(*lo, bit_moved(h, 2 * p, 4));
        *hi = _mm256_or_si256(*hi, bit_moved(h, 2 * p + 1, 4));
    }
    if (type == T_IQ4_XS) {
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4));
        *lo = _mm256_shuffle_epi8(levels, *lo);
        *hi = _mm256_shuffle_epi8(levels, *hi);
    }
}

/* IQ4_XS's block b against rows r0 .. r0 + G - 1 (k8_rows' contract). */
static inline __attribute__((always_inline)) void KN(k8_rows_iq4)(const uint8_t *rec, const __m256i *dec, const KN(K8Rec) *R,
                                                               const Acts *A, int64_t b, int64_t r0, const int G,
                                                               __m256 *acc) {
    const int64_t n_in = A->n_in, nb = n_in / 256;
    __m256i sum[4];
    for (int t = 0; t < G; t++) sum[t] = _mm256_setzero_si256();
    for (int u = 0; u < 32; u++) {
        __m256i lo, hi;
        if (dec) lo = dec[2 * u], hi = dec[2 * u + 1];
        else KN(k8_vector)(T_IQ4_XS, rec, u, &lo, &hi);
        const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi), sv = R->sv[u >> 2];
        for (int t = 0; t < G; t++) {
            const int8_t *x = A->qk + (r0 + t) * n_in + b * 256 + 32 * (u >> 2) + 4 * (u & 3);
            int32_t xl, xh;
            memcpy(&xl, x, 4);
            memcpy(&xh, x + 16, 4);
            sum[t] = DOT_ADD(sum[t], _mm256_maddubs_epi16(alo, _mm256_sign_epi8(_mm256_set1_epi32(xl), lo)), sv);
            sum[t] = DOT_ADD(sum[t], _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(_mm256_set1_epi32(xh), hi)), sv);
            __asm__("" : "+x"(sum[t])); /* a running sum in a register (not a tree of spilled products) */
        }
    }
    for (int t = 0; t < G; t++) {
        const __m256 dx = _mm256_set1_ps(A->dk[(r0 + t) * nb + b]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(R->d, dx), _mm256_cvtepi32_ps(sum[t]), acc[t]);
    }
}

/* Block b (record rec) of the 8 outputs against rows r0 .. r0 + G - 1 (G = 1..4), into acc[0 .. G - 1];
 * the weights decoded here, or (dec) read as decoded before: vectors 2(8p + q) and 2(8p + q) + 1. */
static inline __attribute__((always_inline)) void KN(k8_rows)(const int type, const uint8_t *rec, const __m256i *dec,
                                                           const KN(K8Rec) *R, const Acts *A, int64_t b, int64_t r0,
                                                           const int G, __m256 *acc) {
    if (type == T_IQ4_XS) {
        KN(k8_rows_iq4)(rec, dec, R, A, b, r0, G, acc);
        return;
    }
    if (type == T_Q2_K || type == T_Q3_K) {
        KN(k16_rows)(type, rec, dec, R, A, b, r0, G, acc);
        return;
    }
    const int64_t n_in = A->n_in, nb = n_in / 256;
    const int run = type == T_Q5_K ? 4 : 8; /* vectors whose s16 pair sums add up without overflow */
    __m256i sum[4];
    for (int t = 0; t < G; t++) sum[t] = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++)
        for (int q0 = 0; q0 < 8; q0 += run) {
            __m256i sl[4], sh[4];
            for (int t = 0; t < G; t++) sl[t] = sh[t] = _mm256_setzero_si256();
            for (int q = q0; q < q0 + run; q++) {
                __m256i lo, hi;
                if (dec) lo = dec[2 * (8 * p + q)], hi = dec[2 * (8 * p + q) + 1];
                else KN(k8_vector)(type, rec, 8 * p + q, &lo, &hi);
                for (int t = 0; t < G; t++) {
                    const int8_t *x = A->qk + (r0 + t) * n_in + b * 256 + 64 * p + 4 * q;
                    int32_t xl, xh;
                    memcpy(&xl, x, 4);
                    memcpy(&xh, x + 32, 4);
                    sl[t] = _mm256_add_epi16(sl[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
                    sh[t] = _mm256_add_epi16(sh[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
                    /* running sums in registers (the compiler would otherwise keep every product to
                     * add them as a tree, and spill) */
                    __asm__("" : "+x"(sl[t]), "+x"(sh[t]));
                }
            }
            for (int t = 0; t < G; t++) sum[t] = DOT_ADD(DOT_ADD(sum[t], sl[t], R->sv[2 * p]), sh[t], R->sv[2 * p + 1]);
        }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = 0; t < G; t++) {
        const int64_t r = r0 + t;
        /* the sums of 32 activations as s16 pairs: dword p of each 128-bit half of `pairs` holds
         * sub-blocks 2p, 2p + 1 (the low half 0..3, the high 4..7) */
        const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(A->bk + r * (n_in / 16) + b * 16)), ones);
        const __m256i pairs = _mm256_packs_epi32(s32, s32); /* |a sum of 32| <= 4064: no saturation */
        __m256i adj = _mm256_madd_epi16(R->mv[0], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(0)));
        adj = _mm256_add_epi32(adj, _mm256_madd_epi16(R->mv[1], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(1))));
        adj = _mm256_add_epi32(adj, _mm256_madd_epi16(R->mv[2], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(4))));
        adj = _mm256_add_epi32(adj, _mm256_madd_epi16(R->mv[3], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(5))));
        const __m256 dx = _mm256_set1_ps(A->dk[r * nb + b]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(R->d, dx), _mm256_cvtepi32_ps(sum[t]), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(R->dmin, dx), _mm256_cvtepi32_ps(adj), acc[t]);
    }
}

/* The 8 outputs of group grp (the first n of them written) from accumulators acc[0 .. nr - 1]. */
static inline __attribute__((always_inline)) void KN(k8_store)(const Seg *s, int64_t j, int n, int64_t r0, int64_t nr,
                                                            const __m256 *acc, const Out *o) {
    for (int64_t t = 0; t < nr; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
        for (int k = 0; k < n; k++) store(o->y + (r0 + t) * o->ldy + s->col + j + k, v[k], s->bias, j + k, o->accumulate);
    }
}

/* Record b of group grp, prefetched ahead, and what its products need besides its weights. */
static inline __attribute__((always_inline)) const uint8_t *KN(k8_open)(const int type, const uint8_t *grp, int64_t b,
                                                                     KN(K8Rec) *R) {
    const int rec_bytes = 8 * block_bytes(type);
    const uint8_t *rec = grp + b * rec_bytes;
    for (int i = 0; X8_PF && i < rec_bytes; i += 64) _mm_prefetch((const char *)(rec + X8_PF + i), _MM_HINT_T0);
    KN(k8_rec)(type, rec, R);
    return rec;
}

/* The 8 outputs of group grp against G (1..4) rows: each vector decoded as it is used, the
 * accumulators in registers. */
static inline __attribute__((always_inline)) void KN(k8_few)(const int type, const Seg *s, const uint8_t *grp, int64_t j,
                                                          const int n, int64_t r0, const int G, const Out *o) {
    const int64_t nb = o->a->n_in / 256;
    __m256 acc[4];
    for (int t = 0; t < G; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        KN(K8Rec) R;
        const uint8_t *rec = KN(k8_open)(type, grp, b, &R);
        KN(k8_rows)(type, rec, NULL, &R, o->a, b, r0, G, acc);
    }
    KN(k8_store)(s, j, n, r0, G, acc, o);
}

/* The same against nr (more than four; Q3_K: four and more; up to RT) rows: each record decoded
 * once into dec, then taken four rows at a time. */
static inline __attribute__((always_inline)) void KN(k8_many)(const int type, const Seg *s, const uint8_t *grp, int64_t j,
                                                           const int n, int64_t r0, const int64_t nr, const Out *o) {
    const int64_t nb = o->a->n_in / 256;
    __m256 acc[RT];
    __m256i dec[64];
    for (int64_t t = 0; t < nr; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        KN(K8Rec) R;
        const uint8_t *rec = KN(k8_open)(type, grp, b, &R);
        if (type == T_Q2_K || type == T_Q3_K) {
            for (int h = 0; h < 2; h++)
                for (int jj = 0; jj < 4; jj++)
                    for (int q = 0; q < 8; q++) dec[8 * (4 * h + jj) + q] = KN(k16_vector)(type, rec, h, jj, q);
        } else {
            for (int u = 0; u < 32; u++) KN(k8_vector)(type, rec, u, &dec[2 * u], &dec[2 * u + 1]);
        }
        int64_t t = 0;
        for (; nr - t >= 4; t += 4) KN(k8_rows)(type, rec, dec, &R, o->a, b, r0 + t, 4, acc + t);
        if (nr - t == 3) KN(k8_rows)(type, rec, dec, &R, o->a, b, r0 + t, 3, acc + t);
        else if (nr - t == 2) KN(k8_rows)(type, rec, dec, &R, o->a, b, r0 + t, 2, acc + t);
        else if (nr - t == 1) KN(k8_rows)(type, rec, dec, &R, o->a, b, r0 + t, 1, acc + t);
    }
    KN(k8_store)(s, j, n, r0, nr, acc, o);
}

#ifdef GG_AMX_BODY
/* The AMX path: Q4_K's outputs of two groups (16; grp and the next group) against nr (1 ..
 * AMX_BLOCK) rows with Intel's tile products. A tile product (tdpbssd) forms, for each row and
 * output, the exact integer sum of a sub-block's 32 weight levels times its 32 quantized
 * activations; each is multiplied by the output's sub-block scale and added up as integers, which
 * gives the integer k8_rows forms (the same sum in another order: exact). The rest, the mins'
 * correction and the float operations, is k8_rows' own, lane by lane in its order, so every row
 * gets the avx512vnni path's bits whatever the pass's size. The activation tile is read in place
 * (rows n_in bytes apart; a last tile of fewer than 16 rows after a full one reads the rows after
 * the pass, which the activations' buffer holds (gguf_matmul_multi rounds it up to 16 rows), and
 * its sums there are never read); the weight tile, 8 rows of 4 levels for each of the 16 outputs,
 * is the two records' decoded vectors side by side, decoded once for all the rows' tiles. Four sum
 * tiles take four sub-blocks in turn, so that the products overlap. What it gains is bounded by
 * the sum tiles stored and scaled per sub-block of 32 (Q4_K's scales are per sub-block, so a tile
 * cannot sum a whole block) and by the weights' decoding (docs/kernels.md, "The AMX path"). */
#define AMX_ROWS 10   /* fewer rows: the avx512vnni kernels are as fast (measured on a 2-core Xeon VM) */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) KN(TileConfig);

static inline __attribute__((always_inline)) __m512 KN(joined)(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* Block b of both groups' records: their decoded vectors as the weight tiles (w[sub-block][tile
 * row][two groups' 32 bytes]) and their records (R[group]). */
static inline __attribute__((always_inline)) void KN(k8_amx_decode)(const uint8_t *grp, const uint8_t *grp2, int64_t b,
                                                                 int8_t (*w)[8][64], KN(K8Rec) *R) {
    for (int e = 0; e < 2; e++) {
        const uint8_t *rec = KN(k8_open)(T_Q4_K, e ? grp2 : grp, b, &R[e]);
        for (int u = 0; u < 32; u++) {
            __m256i lo, hi;
            KN(k8_vector)(T_Q4_K, rec, u, &lo, &hi);
            _mm256_store_si256((__m256i *)(w[2 * (u >> 3)][u & 7] + 32 * e), lo);
            _mm256_store_si256((__m256i *)(w[2 * (u >> 3) + 1][u & 7] + 32 * e), hi);
        }
    }
}

static inline __attribute__((always_inline)) void KN(k8_amx)(const Seg *s, const uint8_t *grp, int64_t j, const int n,
                                                          int64_t r0, const int64_t nr, const Out *o) {
    /* two groups (16 outputs: j .. j + 15, the second's first n - 8 written), rows r0 .. r0 + nr - 1
     * in tiles of 16 (the configured tile height: 16, or nr where nr < 16) */
    const Acts *A = o->a;
    const int64_t n_in = A->n_in, nb = n_in / 256;
    const uint8_t *grp2 = grp + 8 * s->row_bytes;
    __m512 acc[AMX_BLOCK];
    int8_t w[2][8][8][64] __attribute__((aligned(64))); /* b & 1, sub-block, then the weight tile (both groups' vectors) */
    int32_t c[8][16][16] __attribute__((aligned(64))); /* a tile of rows' sums per sub-block, stored */
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t t = 0; t < nr; t++) acc[t] = _mm512_setzero_ps();
    KN(K8Rec) Rb[2][2]; /* the blocks' records (b & 1), both groups */
    KN(k8_amx_decode)(grp, grp2, 0, w[0], Rb[0]);
    for (int64_t b = 0; b < nb; b++) {
        const KN(K8Rec) *R = Rb[b & 1];
        __m512i sc[8];
        for (int k = 0; k < 8; k++)
            sc[k] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(R[0].sv[k]), R[1].sv[k], 1), low16);
        __m512i mv[4];
        for (int i = 0; i < 4; i++) mv[i] = _mm512_inserti64x4(_mm512_castsi256_si512(R[0].mv[i]), R[1].mv[i], 1);
        const __m512 d = KN(joined)(R[0].d, R[1].d), dmin = KN(joined)(R[0].dmin, R[1].dmin);
        for (int64_t t0 = 0; t0 < nr; t0 += 16) {
            const int8_t *xb = A->qk + (r0 + t0) * n_in + b * 256;
            /* four sub-blocks at a time on four sum tiles (0..3), the activation and weight tiles
             * alternating (4, 5 and 6, 7), so that the products overlap instead of waiting in turn */
            for (int h = 0; h < 8; h += 4) {
#define AMX_PRODUCT(k, a, w_)                                    \
    _tile_loadd(a, xb + 32 * (h + k), n_in);                     \
    _tile_loadd(w_, w[b & 1][h + k], 64);                        \
    _tile_dpbssd(k, a, w_);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                AMX_PRODUCT(0, 4, 6)
                AMX_PRODUCT(1, 5, 7)
                AMX_PRODUCT(2, 4, 6)
                AMX_PRODUCT(3, 5, 7)
#undef AMX_PRODUCT
                _tile_stored(0, c[h], 64);
                _tile_stored(1, c[h + 1], 64);
                _tile_stored(2, c[h + 2], 64);
                _tile_stored(3, c[h + 3], 64);
            }
            /* the next block's weights decoded while this block's products run: its tiles are
             * loaded an iteration later, after the stores have left the core's store buffer */
            if (t0 == 0 && b + 1 < nb) KN(k8_amx_decode)(grp, grp2, b + 1, w[(b + 1) & 1], Rb[(b + 1) & 1]);
            const int64_t tn = nr - t0 < 16 ? nr - t0 : 16;
            for (int64_t t = 0; t < tn; t++) {
                const int64_t r = r0 + t0 + t;
                __m512i sum = _mm512_mullo_epi32(_mm512_load_si512((const void *)c[0][t]), sc[0]);
                for (int k = 1; k < 8; k++)
                    sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(_mm512_load_si512((const void *)c[k][t]), sc[k]));
                /* k8_rows' correction and float operations, for both groups' 16 outputs at once
                 * (each lane's operations are the 8-lane ones) */
                const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(A->bk + r * (n_in / 16) + b * 16)), ones);
                const __m512i pairs = _mm512_broadcast_i64x4(_mm256_packs_epi32(s32, s32));
                __m512i adj = _mm512_madd_epi16(mv[0], _mm512_permutexvar_epi32(_mm512_set1_epi32(0), pairs));
                adj = _mm512_add_epi32(adj, _mm512_madd_epi16(mv[1], _mm512_permutexvar_epi32(_mm512_set1_epi32(1), pairs)));
                adj = _mm512_add_epi32(adj, _mm512_madd_epi16(mv[2], _mm512_permutexvar_epi32(_mm512_set1_epi32(4), pairs)));
                adj = _mm512_add_epi32(adj, _mm512_madd_epi16(mv[3], _mm512_permutexvar_epi32(_mm512_set1_epi32(5), pairs)));
                const __m512 dx = _mm512_set1_ps(A->dk[r * nb + b]);
                acc[t0 + t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sum), acc[t0 + t]);
                acc[t0 + t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(adj), acc[t0 + t]);
            }
        }
    }
    for (int64_t t0 = 0; t0 < nr; t0 += RT) {
        const int64_t tn = nr - t0 < RT ? nr - t0 : RT;
        __m256 out[2][RT];
        for (int64_t t = 0; t < tn; t++) {
            out[0][t] = _mm512_castps512_ps256(acc[t0 + t]);
            out[1][t] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t0 + t]), 1));
        }
        KN(k8_store)(s, j, 8, r0 + t0, tn, out[0], o);
        KN(k8_store)(s, j + 8, n - 8, r0 + t0, tn, out[1], o);
    }
}
#endif


/* Up to four rows (Q3_K: three, whose third bit fills the registers at four) decoded as they go,
 * more on records decoded once (k8_many). */
static inline __attribute__((always_inline)) void KN(k8_group)(const int type, const Seg *s, const uint8_t *grp, int64_t j,
                                                            const int n, int64_t r0, const int64_t nr, const Out *o) {
    if (nr > (type == T_Q3_K ? 3 : 4)) {
        KN(k8_many)(type, s, grp, j, n, r0, nr, o);
        return;
    }
    switch (nr) {
    case 1: KN(k8_few)(type, s, grp, j, n, r0, 1, o); break;
    case 2: KN(k8_few)(type, s, grp, j, n, r0, 2, o); break;
    case 3: KN(k8_few)(type, s, grp, j, n, r0, 3, o); break;
    default: KN(k8_few)(type, s, grp, j, n, r0, 4, o);
    }
}

#ifdef GG_AMX_BODY
/* Rows [0, n_rows) of a pass against the Q4_K tensor's outputs [j0, j1) (repacked, j0 a multiple
 * of 8) on the AMX path: AMX_BLOCK rows at a time (the tiles configured once for each), every pair
 * of groups of 8 outputs against them, its weights decoded once for the block's tiles of 16 rows
 * (the thread's share of the weights stays in its cache across the blocks). */
static void KN(k8_amx_rows)(const Seg *s, int64_t j0, int64_t j1, int64_t n_rows, const Out *o) {
    for (int64_t r0 = 0; r0 < n_rows; r0 += AMX_BLOCK) {
        const int64_t nr = n_rows - r0 < AMX_BLOCK ? n_rows - r0 : AMX_BLOCK, th = nr < 16 ? nr : 16;
        KN(TileConfig) cfg __attribute__((aligned(64)));
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int k = 0; k < 4; k++) cfg.rows[k] = (uint8_t)th, cfg.colsb[k] = 64; /* the sums: th rows x 16 outputs (int32) */
        cfg.rows[4] = cfg.rows[5] = (uint8_t)th, cfg.colsb[4] = cfg.colsb[5] = 32; /* the activations: th rows x 32 */
        cfg.rows[6] = cfg.rows[7] = 8, cfg.colsb[6] = cfg.colsb[7] = 64; /* the weights: 8 x (4 levels x 16 outputs) */
        _tile_loadconfig(&cfg);
        int64_t j = j0;
        for (; j1 - j > 8; j += 16) KN(k8_amx)(s, s->w + j * s->row_bytes, j, j1 - j < 16 ? (int)(j1 - j) : 16, r0, nr, o);
        _tile_release();
        if (j < j1) /* a last group alone: the avx512vnni path's kernel (the same bits) */
            for (int64_t t0 = 0; t0 < nr; t0 += RT)
                KN(k8_group)(T_Q4_K, s, s->w + j * s->row_bytes, j, (int)(j1 - j), r0 + t0, nr - t0 < RT ? nr - t0 : RT, o);
    }
}
#endif

GROUPED_TYPE(k8_q4k, T_Q4_K, kq_scalar, k8_group)
GROUPED_TYPE(k8_q5k, T_Q5_K, kq_scalar, k8_group)
GROUPED_TYPE(k8_iq4xs, T_IQ4_XS, kq_scalar, k8_group)
GROUPED_TYPE(k8_q2k, T_Q2_K, kq_scalar, k8_group)
GROUPED_TYPE(k8_q3k, T_Q3_K, kq_scalar, k8_group)
#undef GROUPED_TYPE

static void KN(k8)(const Seg *s, int64_t j0, int64_t j1, int64_t r0, int64_t nr, const Out *o) {
    switch (s->type) {
    case T_Q5_K: KN(k8_q5k)(s, j0, j1, r0, nr, o); break;
    case T_IQ4_XS: KN(k8_iq4xs)(s, j0, j1, r0, nr, o); break;
    case T_Q2_K: KN(k8_q2k)(s, j0, j1, r0, nr, o); break;
    case T_Q3_K: KN(k8_q3k)(s, j0, j1, r0, nr, o); break;
    default: KN(k8_q4k)(s, j0, j1, r0, nr, o);
    }
}

#endif /* GG_KERNEL_BODY */
