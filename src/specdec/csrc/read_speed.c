/* Memory read speed (specdec.bench.machine.read_speed): a STREAM-like read of a buffer far larger
 * than the CPU's caches by a given number of OpenMP threads, each its own contiguous share.
 *
 * The words are summed so that the compiler keeps every read; integer additions vectorize to one
 * instruction per 16 or 32 bytes, far below what memory delivers, so the time is the memory's.
 */
#include <stdint.h>

/* The exported functions, described once: specdec.kernels declares each to ctypes from the
 * prototypes that read_speed_interface() returns, the text of these rows; the compiler checks each
 * definition against its row (the declarations below). */
#define READ_EXPORTS(X)                                                                                             \
    X(void, specdec_fill_words, (uint64_t *words, int64_t n, int threads))                                          \
    X(uint64_t, specdec_read_words, (const uint64_t *words, int64_t n, int threads))

#define READ_DECLARE(result, name, params) result name params;
READ_EXPORTS(READ_DECLARE)
#undef READ_DECLARE

#define READ_PROTOTYPE(result, name, params) #result " " #name #params ";\n"
static const char g_interface[] = READ_EXPORTS(READ_PROTOTYPE);
#undef READ_PROTOTYPE

const char *read_speed_interface(void) { return g_interface; }

/* Writes words[i] = i with `threads` threads, each the share it will later read (pages placed near it). */
void specdec_fill_words(uint64_t *words, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) words[i] = (uint64_t)i;
}

/* The sum of words[0..n) (modulo 2^64), read by `threads` threads. */
uint64_t specdec_read_words(const uint64_t *words, int64_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += words[i];
    return total;
}
