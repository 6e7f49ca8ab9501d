/* Two builds of specdec's GGUF kernel (src/specdec/csrc/linear_gguf.c) in one process, taking
 * turns: the fastest of the repeats for passes of 1, 2, 3, 4, 8 and 16 rows on one 8960 x 1536
 * tensor of each named type (random blocks with fp16 scales of a plausible size, in six copies
 * that overflow a 32 MiB last-level cache), each build on its own layout (a type it repacks eight
 * rows at a time is repacked). What a change to the kernel does to its row costs, measured side by
 * side on a shared machine:
 *
 *   git show REV:src/specdec/csrc/linear_gguf.c > /tmp/old.c
 *   cc -O3 -ffp-contract=off -fopenmp -shared -fPIC /tmp/old.c -o old.so -lm
 *   cc -O3 -ffp-contract=off -fopenmp -shared -fPIC src/specdec/csrc/linear_gguf.c -o new.so -lm
 *   cc -O2 benchmarks/gguf_kernel_ab.c -o ab -ldl -lm
 *   taskset -c 1 ./ab Q4_K,Q5_K 40 1     # types, repeats, threads
 *
 * Prints per type the largest difference between the builds' outputs of a 4-row pass (a changed
 * accumulation order differs by rounding) and each build's times in microseconds, with each
 * pass's ratio to the build's one-row pass. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*matmul_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int, int);
typedef int64_t (*row_bytes_fn)(int, int64_t);
typedef int (*repacked_type_fn)(int);
typedef int64_t (*repacked_bytes_fn)(int, int64_t, int64_t);
typedef int (*repack_fn)(int, const uint8_t *, int64_t, int64_t, uint8_t *);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static const char *NAMES[] = {"Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q8_0", "Q5_1", "Q4_0", "Q6_K"};
static const int TYPES[] = {12, 13, 11, 10, 23, 20, 8, 7, 2, 14};
/* block bytes, and where its fp16 scales sit (-1: none) */
static void geometry(int t, int *bytes, int at[2]) {
    at[0] = at[1] = -1;
    switch (t) {
    case 2: *bytes = 18, at[0] = 0; break;
    case 20: *bytes = 18, at[0] = 0; break;
    case 8: *bytes = 34, at[0] = 0; break;
    case 23: *bytes = 136, at[0] = 0; break;
    case 7: *bytes = 24, at[0] = 0, at[1] = 2; break;
    case 12: *bytes = 144, at[0] = 0, at[1] = 2; break;
    case 13: *bytes = 176, at[0] = 0, at[1] = 2; break;
    case 10: *bytes = 84, at[0] = 80, at[1] = 82; break;
    case 11: *bytes = 110, at[0] = 108; break;
    default: *bytes = 210, at[0] = 208; break; /* Q6_K */
    }
}

enum { COPIES = 6, N_ROWS = 6 };

int main(int argc, char **argv) {
    void *lib[2] = {dlopen("./old.so", RTLD_NOW | RTLD_LOCAL), dlopen("./new.so", RTLD_NOW | RTLD_LOCAL)};
    if (!lib[0] || !lib[1]) {
        fprintf(stderr, "needs ./old.so and ./new.so (see the comment at the top)\n");
        return 1;
    }
    const char *only = argc > 1 ? argv[1] : "";
    const int repeats = argc > 2 ? atoi(argv[2]) : 30, threads = argc > 3 ? atoi(argv[3]) : 1;
    const int64_t n_out = 8960, n_in = 1536;
    const int rows[N_ROWS] = {1, 2, 3, 4, 8, 16};
    float *x = malloc(16 * n_in * sizeof(float)), *y = malloc(16 * n_out * sizeof(float)),
          *y2 = malloc(16 * n_out * sizeof(float));
    srand(1);
    for (int i = 0; i < 16 * n_in; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 0 ? 20 : 1);
    for (int ti = 0; ti < (int)(sizeof TYPES / sizeof TYPES[0]); ti++) {
        if (*only && !strstr(only, NAMES[ti])) continue;
        const int t = TYPES[ti];
        const int64_t bytes = ((row_bytes_fn)dlsym(lib[0], "gguf_row_bytes"))(t, n_in) * n_out;
        int bb, at[2];
        geometry(t, &bb, at);
        uint8_t *raw[COPIES], *w[2][COPIES];
        for (int c = 0; c < COPIES; c++) {
            raw[c] = malloc(bytes);
            for (int64_t i = 0; i < bytes; i++) raw[c][i] = (uint8_t)rand();
            for (int64_t b = 0; b < bytes / bb; b++)
                for (int k = 0; k < 2; k++)
                    if (at[k] >= 0) {
                        const uint16_t h = 0x1000 + (rand() & 0x3ff) + ((rand() & 3) << 10); /* about 2^-11 .. 2^-8 */
                        memcpy(raw[c] + b * bb + at[k], &h, 2);
                    }
        }
        int type[2];
        for (int l = 0; l < 2; l++) {
            const int packed = ((repacked_type_fn)dlsym(lib[l], "gguf_repacked_type"))(t);
            type[l] = packed >= 0 ? packed : t;
            for (int c = 0; c < COPIES; c++) {
                if (packed < 0) {
                    w[l][c] = raw[c];
                    continue;
                }
                const int64_t n = ((repacked_bytes_fn)dlsym(lib[l], "gguf_repacked_bytes"))(t, n_out, n_in);
                w[l][c] = aligned_alloc(64, (n + 63) & ~63);
                ((repack_fn)dlsym(lib[l], "gguf_repack"))(t, raw[c], n_out, n_in, w[l][c]);
            }
        }
        const matmul_fn mm[2] = {(matmul_fn)dlsym(lib[0], "gguf_matmul"), (matmul_fn)dlsym(lib[1], "gguf_matmul")};
        mm[0](type[0], w[0][0], n_out, n_in, x, 4, y, 0, threads);
        mm[1](type[1], w[1][0], n_out, n_in, x, 4, y2, 0, threads);
        double diff = 0, mag = 0;
        for (int i = 0; i < 4 * n_out; i++) {
            diff = fmax(diff, fabs(y[i] - y2[i]));
            mag = fmax(mag, fabs(y[i]));
        }
        double best[2][N_ROWS];
        for (int l = 0; l < 2; l++)
            for (int i = 0; i < N_ROWS; i++) best[l][i] = 1e9;
        for (int k = 0; k < repeats; k++)
            for (int i = 0; i < N_ROWS; i++)
                for (int l = 0; l < 2; l++) {
                    const double t0 = now();
                    mm[l](type[l], w[l][(k * N_ROWS * 2 + i * 2 + l) % COPIES], n_out, n_in, x, rows[i], y, 0, threads);
                    best[l][i] = fmin(best[l][i], now() - t0);
                }
        printf("%-7s largest difference %.2g (outputs up to %.2g)\n", NAMES[ti], diff, mag);
        for (int l = 0; l < 2; l++) {
            printf("  %s", l ? "new" : "old");
            for (int i = 0; i < N_ROWS; i++) printf(" %d:%5.0f(%.2f)", rows[i], best[l][i] * 1e6, best[l][i] / best[l][0]);
            printf("\n");
        }
    }
    return 0;
}
