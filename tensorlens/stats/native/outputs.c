/* One read of a module output for tensorlens's training dynamics (tensorlens/stats/derived.py:
 * unit_activity, sample_norms and saturated_count, which PyTorch computes in about ten small ops
 * per output; on small models those ops cost more than their arithmetic).
 *
 * The output is a contiguous [batch, m] array of float or double (a sample per row). Its units
 * (features, channels) repeat inside each row as runs: a unit's values are `inner` consecutive
 * values, the `units` units follow one another, and the pattern repeats along the row:
 *   channel-last  [..., F]:       inner = 1, unit of value i is i % F
 *   channel-first [B, F, rest]:   inner = prod(rest), unit of value i is (i / inner) % F
 *   one unit (0-d, 1-d):          units = inner = 1
 * Per call, any of:
 *   counts[f]  += values of unit f with |x| > threshold (NaN is not active), exact integers
 *   norms[b]    = sqrt(sum of x^2 over row b) / divisor, summed in double (x^2 of a float is exact)
 *   *saturated  = values with x >= high or x <= low (NaN is not saturated)
 * Comparisons are made in the tensor's own type, the bounds rounded to it first, as PyTorch
 * compares a float tensor with a Python number.
 *
 * Rows are independent: with OpenMP (PyTorch's own libgomp, see build.py) the rows of a large
 * output are shared among threads, each with its own counts, merged once (integers: the order
 * does not matter). Without OpenMP one thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* a row's sum of squares: the dot product of dots.c (double, in independent lanes), of the row with itself */
double tl_dot_f32(const float *a, const float *b, int64_t n);
double tl_dot_f64(const double *a, const double *b, int64_t n);

#define DEFINE_ROW(T, NAME, ABS, DOT)                                                                       \
    static void NAME(const T *row, int64_t m, int64_t units, int64_t inner, T threshold, int64_t *counts,  \
                     double *square, int32_t saturation, T low, T high, int64_t *saturated) {               \
        if (counts != NULL) {                                                                               \
            if (inner == 1) {                                                                               \
                for (int64_t p = 0; p + units <= m; p += units) {                                           \
                    const T *run = row + p;                                                                 \
                    for (int64_t f = 0; f < units; f++) counts[f] += ABS(run[f]) > threshold;              \
                }                                                                                           \
            } else {                                                                                        \
                for (int64_t p = 0, f = 0; p + inner <= m; p += inner, f = (f + 1 == units ? 0 : f + 1)) { \
                    const T *run = row + p;                                                                 \
                    int64_t active = 0;                                                                     \
                    for (int64_t r = 0; r < inner; r++) active += ABS(run[r]) > threshold;                 \
                    counts[f] += active;                                                                    \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        if (square != NULL) *square = DOT(row, row, m);                                                     \
        if (saturation) {                                                                                   \
            int64_t count = 0;                                                                              \
            for (int64_t i = 0; i < m; i++) count += (row[i] >= high) | (row[i] <= low);                   \
            *saturated += count;                                                                            \
        }                                                                                                   \
    }

DEFINE_ROW(float, row_f32, fabsf, tl_dot_f32)
DEFINE_ROW(double, row_f64, fabs, tl_dot_f64)

static void rows(const void *data, int32_t is_double, int64_t first, int64_t last, int64_t m, int64_t units,
                 int64_t inner, double threshold, int64_t *counts, double *squares, int32_t saturation, double low,
                 double high, int64_t *saturated) {
    for (int64_t b = first; b < last; b++) {
        double *square = squares != NULL ? squares + b : NULL;
        if (is_double)
            row_f64((const double *)data + b * m, m, units, inner, threshold, counts, square, saturation, low, high,
                    saturated);
        else
            row_f32((const float *)data + b * m, m, units, inner, (float)threshold, counts, square, saturation,
                    (float)low, (float)high, saturated);
    }
}

/* counts: [units] doubles or NULL; norms: [batch] doubles or NULL; saturated: one int64 or NULL.
 * Returns 0, or -1 when memory for the counts could not be had (nothing is written then). */
int tl_output_stats(const void *data, int32_t is_double, int64_t batch, int64_t m, int64_t units, int64_t inner,
                    double threshold, double *counts, double *norms, double divisor, double low, double high,
                    int64_t *saturated, int32_t threads) {
    int64_t *total = counts != NULL ? calloc(units > 0 ? units : 1, sizeof(int64_t)) : NULL;
    if (counts != NULL && total == NULL) return -1;
    int32_t saturation = saturated != NULL;
    int64_t saturated_total = 0;
    int failed = 0;
    if (units <= 0 || inner <= 0) m = 0; /* no unit: nothing to count, every row is empty */
#ifdef _OPENMP
    if (threads > 1 && batch > 1) {
#pragma omp parallel num_threads(threads) reduction(+ : saturated_total) reduction(| : failed)
        {
            int64_t *mine = counts != NULL ? calloc(units > 0 ? units : 1, sizeof(int64_t)) : NULL;
            int ok = counts == NULL || mine != NULL;
            failed |= !ok;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++)
                if (ok) rows(data, is_double, b, b + 1, m, units, inner, threshold, mine, norms, saturation, low,
                             high, &saturated_total);
            if (mine != NULL) {
#pragma omp critical
                for (int64_t f = 0; f < units; f++) total[f] += mine[f];
                free(mine);
            }
        }
    } else
#endif
    {
        (void)threads;
        rows(data, is_double, 0, batch, m, units, inner, threshold, total, norms, saturation, low, high,
             &saturated_total);
    }
    if (failed) {
        free(total);
        return -1;
    }
    if (counts != NULL)
        for (int64_t f = 0; f < units; f++) counts[f] = (double)total[f];
    free(total);
    if (norms != NULL)
        for (int64_t b = 0; b < batch; b++) norms[b] = sqrt(norms[b]) / divisor;
    if (saturated != NULL) *saturated = saturated_total;
    return 0;
}
