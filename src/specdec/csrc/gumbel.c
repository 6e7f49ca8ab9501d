/* The Gumbel-max sampler's candidate filter (specdec.sampling.gumbel_max).
 *
 * The sampler draws argmax_v (s_v - log E_v), where E_v = -log U_v and U_v = (k_v + 1/2) 2^-53 with
 * k_v the top 53 bits of SplitMix64's output for token v's counter (specdec.sampling._noise).
 * Computing E_v for a 152k vocabulary costs two logarithms a token. Given a key K that some token
 * already reaches, token v can reach it only if log E_v <= s_v - K =: d_v. Since
 * -log(1 - w) >= w, E_v >= W_v := 1 - U_v, so that needs log W_v <= d_v, and log W_v >= e_v ln 2
 * where 2^e_v <= W_v < 2^(e_v + 1). W_v = (2^54 - 2 k_v - 1) 2^-54 is an integer times a power of
 * two, so e_v comes exactly from its leading zeros. This function lists the tokens with
 * e_v ln 2 <= d_v + margin: every token whose key can reach K, and a few more; the caller computes
 * their exact keys as before. Only integer arithmetic and one comparison a token: no value of the
 * sampler depends on this file, only which tokens get their exact key computed.
 */
#include <math.h>
#include <stdint.h>

/* The exported function, described once: specdec.kernels declares it to ctypes from the prototype
 * that gumbel_interface() returns, the text of its row; the compiler checks the definition
 * against the row (the declaration below). */
#define GUMBEL_EXPORTS(X)                                                                                           \
    X(int64_t, gumbel_candidates, (const double *scores, int64_t n, uint64_t key, double bar, double margin,        \
                                   int64_t *out, int64_t cap))

#define GUMBEL_DECLARE(result, name, params) result name params;
GUMBEL_EXPORTS(GUMBEL_DECLARE)
#undef GUMBEL_DECLARE

#define GUMBEL_PROTOTYPE(result, name, params) #result " " #name #params ";\n"
static const char g_interface[] = GUMBEL_EXPORTS(GUMBEL_PROTOTYPE);
#undef GUMBEL_PROTOTYPE

const char *gumbel_interface(void) { return g_interface; }

#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* scores: float64 [n] (-inf outside the support); key: the position's key (specdec.sampling._noise);
 * bar: the key K to reach; margin: slack on d_v for rounding. Writes the candidates' ids,
 * ascending, into out (room for cap) and returns their number, or -1 when more than cap. */
int64_t gumbel_candidates(const double *scores, int64_t n, uint64_t key, double bar, double margin,
                          int64_t *out, int64_t cap) {
    const double ln2 = 0.6931471805599453;
    int64_t m = 0;
    for (int64_t v = 0; v < n; v++) {
        const double d = scores[v] - bar + margin;
        if (!(d > -2000.0)) continue; /* -inf (outside the support), or far below any W's bound */
        if (d < 0.0) {
            const uint64_t k = mix((uint64_t)(v + 1) * GAMMA + key) >> 11; /* 53 bits */
            const uint64_t w = (1ULL << 54) - 2 * k - 1;                   /* W = w 2^-54, w odd */
            const int e = 63 - __builtin_clzll(w) - 54;                    /* 2^e <= W < 2^(e+1) */
            if ((double)e * ln2 > d) continue;
        }
        if (m >= cap) return -1;
        out[m++] = v;
    }
    return m;
}
