/* Dot products of many pairs of CPU float tensors in one call, for tensorlens's training dynamics
 * (tensorlens/stats/derived.py dot_products: the squared norms of parameters, gradients and
 * updates and their dot products with the previous step's, several passes per saved step; with
 * PyTorch ops a few small ops per tensor, which on small models cost more than the arithmetic).
 *
 * Each product of two floats is exact in double; the products are summed in double in LANES
 * independent accumulators (vectorised without reassociating anything the compiler could not),
 * so the error is about n * 1e-16 of sum |a_i b_i| whatever the dtype: float32 pairs are more
 * accurate than torch.dot in float32, float64 pairs as accurate.
 *
 * Tensors are cut into chunks of CHUNK values; with OpenMP (PyTorch's own libgomp, see build.py)
 * threads take the chunks in turn, and each tensor's chunk sums are added in chunk order: the same
 * bits with any number of threads.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK (1 << 16)
#define LANES 8

/* sum(a[i] * b[i]) over n values in double, in LANES independent accumulators (vectorised, no
 * reassociation needed). Not static: outputs.c sums a row's squares with them, the same way. */
#define DEFINE_DOT(T, NAME)                                                                   \
    double NAME(const T *a, const T *b, int64_t n) {                                          \
        double lane[LANES] = {0};                                                             \
        int64_t i = 0;                                                                        \
        for (; i + LANES <= n; i += LANES)                                                    \
            for (int j = 0; j < LANES; j++) lane[j] += (double)a[i + j] * (double)b[i + j];   \
        double total = 0.0;                                                                   \
        for (; i < n; i++) total += (double)a[i] * (double)b[i];                              \
        for (int j = 0; j < LANES; j++) total += lane[j];                                     \
        return total;                                                                         \
    }

DEFINE_DOT(float, tl_dot_f32)
DEFINE_DOT(double, tl_dot_f64)

/* out[i] = sum(a[i] * b[i]) for k pairs of numel[i] values each, float (is_double[i] == 0) or
 * double. Returns 0, or -1 when memory for the chunk sums could not be had. */
int tl_dots(int64_t k, const void *const *a, const void *const *b, const int64_t *numel, const int32_t *is_double,
            double *out, int32_t threads) {
    int64_t *first = malloc((size_t)(k + 1) * sizeof(int64_t));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t i = 0; i < k; i++) first[i + 1] = first[i] + (numel[i] + CHUNK - 1) / CHUNK;
    int64_t items = first[k];
    double *part = malloc((size_t)(items > 0 ? items : 1) * sizeof(double));
    if (part == NULL) {
        free(first);
        return -1;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 1 ? threads : 1) if (threads > 1)
#endif
    for (int64_t item = 0; item < items; item++) {
        int64_t lo = 0, hi = k - 1; /* the tensor of this chunk: the last i with first[i] <= item */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= item) lo = mid; else hi = mid - 1;
        }
        int64_t start = (item - first[lo]) * CHUNK;
        int64_t n = numel[lo] - start < CHUNK ? numel[lo] - start : CHUNK;
        part[item] = is_double[lo] ? tl_dot_f64((const double *)a[lo] + start, (const double *)b[lo] + start, n)
                                   : tl_dot_f32((const float *)a[lo] + start, (const float *)b[lo] + start, n);
    }
    (void)threads;
    for (int64_t i = 0; i < k; i++) {
        double total = 0.0;
        for (int64_t item = first[i]; item < first[i + 1]; item++) total += part[item];
        out[i] = total;
    }
    free(part);
    free(first);
    return 0;
}
