/* One-read statistics of CPU float tensors, for tensorlens (see tensorlens/native/__init__.py).
 *
 * Eager PyTorch needs about six passes over a tensor for exact sum, min, max and centred second
 * moment (sum, aminmax, x - mean, sum, square, sum). This reads each value from memory once: a
 * tensor is cut into blocks of BLOCK values (16 KiB of float32) that stay in L1; each block is
 * summed, then read again from L1 for its deviations from its own mean (the corrected two-pass
 * algorithm), |x|, zeros, min and max. Blocks are merged in double precision with Chan's parallel
 * update, so the result is more accurate than PyTorch's float32 cascade sum (1e-10 relative on
 * 3M N(0,1) values).
 *
 * Lanes: a block is accumulated in LANES independent float lanes (64 values in each), which the
 * compiler turns into several SIMD accumulators, enough to hide the add latency (16 lanes, one
 * AVX-512 register, ran at a third of the speed). Nothing is reassociated (no -ffast-math): IEEE
 * semantics are kept and min/max are exact. A block whose float sum is not finite (NaN, Inf, or
 * an overflow of float32) is done again in double precision, value by value, counting NaN and
 * Inf exactly.
 *
 * Work is split into chunks of at most CHUNK values that threads take in turn; the partial rows
 * of a tensor's chunks are merged the same way.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 64
#define BLOCK 4096
#define CHUNK (1 << 16)

/* A partial row: the order of OUT_* below is the order of the output columns. */
enum { OUT_COUNT, OUT_SUM, OUT_M2, OUT_MIN, OUT_MAX, OUT_L1, OUT_ZEROS, OUT_NANS, OUT_INFS, OUT_WIDTH };

typedef struct {
    double count, mean, m2, sum, l1, zeros, nans, infs, min, max;
} partial;

static void merge(partial *into, const partial *p) {
    if (p->count == 0) return;
    if (into->count == 0) { *into = *p; return; }
    double n = into->count + p->count, delta = p->mean - into->mean;
    into->m2 += p->m2 + delta * delta * into->count * p->count / n;
    into->mean += delta * p->count / n;
    into->count = n;
    into->sum += p->sum;
    into->l1 += p->l1;
    into->zeros += p->zeros;
    into->nans += p->nans;
    into->infs += p->infs;
    into->min = p->min < into->min || isnan(p->min) ? p->min : into->min;
    into->max = p->max > into->max || isnan(p->max) ? p->max : into->max;
    if (isnan(into->min) || isnan(into->max)) into->min = into->max = NAN;
}

#define DEFINE_CHUNK(NAME, T, FABS)                                                          \
    static void NAME(const T *x, int64_t n, int64_t offset, int64_t stride, T *sample,      \
                     partial *out) {                                                         \
        partial acc = {0, 0, 0, 0, 0, 0, 0, 0, INFINITY, -INFINITY};                         \
        for (int64_t start = 0; start < n; start += BLOCK) {                                 \
            int64_t len = n - start < BLOCK ? n - start : BLOCK;                             \
            int64_t full = len - len % LANES;                                                \
            const T *b = x + start;                                                          \
            if (sample) { /* copy every stride-th value (of the whole tensor) while in L1 */  \
                int64_t at = offset + start, index = (at + stride - 1) / stride;             \
                for (int64_t j = index * stride - at; j < len; j += stride) sample[index++] = b[j]; \
            }                                                                                \
            T s[LANES] = {0};                                                                \
            for (int64_t j = 0; j < full; j += LANES)                                        \
                for (int l = 0; l < LANES; l++) s[l] += b[j + l];                            \
            double block_sum = 0;                                                            \
            for (int l = 0; l < LANES; l++) block_sum += s[l];                               \
            for (int64_t j = full; j < len; j++) block_sum += b[j];                          \
            partial p = {(double)len, 0, 0, 0, 0, 0, 0, 0, INFINITY, -INFINITY};             \
            if (!isfinite(block_sum)) { /* NaN, Inf or a float overflow: redo it in double */ \
                double exact = 0;                                                            \
                for (int64_t j = 0; j < len; j++) {                                          \
                    T v = b[j];                                                              \
                    exact += (double)v;                                                      \
                    p.nans += isnan(v) ? 1 : 0;                                              \
                    p.infs += isinf(v) ? 1 : 0;                                              \
                    p.zeros += v == 0 ? 1 : 0;                                               \
                    p.l1 += fabs((double)v);                                                  \
                    if (v < p.min) p.min = v;                                                \
                    if (v > p.max) p.max = v;                                                \
                }                                                                            \
                p.sum = exact;                                                               \
                p.mean = exact / len;                                                        \
                p.m2 = 0;                                                                    \
                for (int64_t j = 0; j < len; j++) {                                          \
                    double d = (double)b[j] - p.mean;                                        \
                    p.m2 += d * d; /* NaN when the block holds NaN or Inf, as in numpy */     \
                }                                                                            \
                if (p.nans > 0) p.min = p.max = NAN;                                         \
                merge(&acc, &p);                                                             \
                continue;                                                                    \
            }                                                                                \
            T centre = (T)(block_sum / len);                                                 \
            T d1[LANES] = {0}, d2[LANES] = {0}, a[LANES] = {0}, z[LANES] = {0};              \
            T lo[LANES], hi[LANES];                                                          \
            for (int l = 0; l < LANES; l++) { lo[l] = INFINITY; hi[l] = -INFINITY; }        \
            for (int64_t j = 0; j < full; j += LANES)                                        \
                for (int l = 0; l < LANES; l++) {                                            \
                    T v = b[j + l], d = v - centre;                                          \
                    d1[l] += d;                                                              \
                    d2[l] += d * d;                                                          \
                    a[l] += FABS(v);                                                         \
                    z[l] += v == 0 ? (T)1 : (T)0;                                            \
                    lo[l] = v < lo[l] ? v : lo[l];                                           \
                    hi[l] = v > hi[l] ? v : hi[l];                                           \
                }                                                                            \
            double sd1 = 0, sd2 = 0;                                                         \
            for (int l = 0; l < LANES; l++) {                                                \
                sd1 += d1[l];                                                                \
                sd2 += d2[l];                                                                \
                p.l1 += a[l];                                                                \
                p.zeros += z[l];                                                             \
                if (lo[l] < p.min) p.min = lo[l];                                            \
                if (hi[l] > p.max) p.max = hi[l];                                            \
            }                                                                                \
            for (int64_t j = full; j < len; j++) {                                           \
                T v = b[j];                                                                  \
                double d = (double)v - (double)centre;                                       \
                sd1 += d;                                                                    \
                sd2 += d * d;                                                                \
                p.l1 += FABS(v);                                                             \
                p.zeros += v == 0 ? 1 : 0;                                                   \
                if (v < p.min) p.min = v;                                                    \
                if (v > p.max) p.max = v;                                                    \
            }                                                                                \
            /* the corrected two-pass: sd1 cancels the rounding of the block's mean */        \
            p.mean = (double)centre + sd1 / len;                                             \
            p.sum = (double)centre * len + sd1;                                              \
            p.m2 = sd2 - sd1 * sd1 / len;                                                    \
            if (p.m2 < 0) p.m2 = 0;                                                          \
            merge(&acc, &p);                                                                 \
        }                                                                                    \
        *out = acc;                                                                          \
    }

DEFINE_CHUNK(chunk_f32, float, fabsf)
DEFINE_CHUNK(chunk_f64, double, fabs)

typedef struct {
    int64_t k;
    const void *const *data;
    const int64_t *numel;
    const int32_t *is_double;
    const int64_t *sample_stride;
    void *const *sample;
    int64_t n_items;
    const int64_t *item_tensor, *item_start; /* chunk i: tensor and first value */
    partial *items;
    int64_t next; /* the next chunk to take (atomic) */
} job;

static void *work(void *arg) {
    job *w = (job *)arg;
    for (;;) {
        int64_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->n_items) return NULL;
        int64_t t = w->item_tensor[i], start = w->item_start[i];
        int64_t len = w->numel[t] - start < CHUNK ? w->numel[t] - start : CHUNK;
        int64_t stride = w->sample_stride[t];
        if (w->is_double[t])
            chunk_f64((const double *)w->data[t] + start, len, start, stride, (double *)w->sample[t], &w->items[i]);
        else
            chunk_f32((const float *)w->data[t] + start, len, start, stride, (float *)w->sample[t], &w->items[i]);
    }
}

/* Partial rows of k contiguous tensors into out[k * OUT_WIDTH], using up to `threads` threads.
 * Where sample[t] is not NULL, every sample_stride[t]-th value of tensor t is also copied there
 * (for its histogram: a strided sample gathered while the values are in cache anyway).
 * Returns 0, or -1 when memory could not be had (the caller falls back). */
int tl_moments(int64_t k, const void *const *data, const int64_t *numel, const int32_t *is_double,
               const int64_t *sample_stride, void *const *sample, double *out, int32_t threads) {
    int64_t n_items = 0;
    for (int64_t t = 0; t < k; t++) n_items += numel[t] > 0 ? (numel[t] + CHUNK - 1) / CHUNK : 0;
    int64_t *item_tensor = malloc(sizeof(int64_t) * (n_items + 1));
    int64_t *item_start = malloc(sizeof(int64_t) * (n_items + 1));
    partial *items = malloc(sizeof(partial) * (n_items + 1));
    if (!item_tensor || !item_start || !items) {
        free(item_tensor); free(item_start); free(items);
        return -1;
    }
    int64_t i = 0;
    for (int64_t t = 0; t < k; t++)
        for (int64_t start = 0; start < numel[t]; start += CHUNK) {
            item_tensor[i] = t;
            item_start[i] = start;
            i++;
        }
    job w = {k, data, numel, is_double, sample_stride, sample, n_items, item_tensor, item_start, items, 0};
    /* a thread costs ~30 us to start, and right after a PyTorch op it competes with OpenMP
     * workers still spinning: only worth it with a million values or more for each thread */
    int64_t total = 0;
    for (int64_t t = 0; t < k; t++) total += numel[t];
    if (threads > total / (1 << 20)) threads = (int32_t)(total / (1 << 20));
    if (threads > n_items) threads = (int32_t)n_items;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    pthread_t helpers[64];
    int started = 0;
    for (int h = 1; h < threads; h++)
        if (pthread_create(&helpers[started], NULL, work, &w) == 0) started++;
    work(&w);
    for (int h = 0; h < started; h++) pthread_join(helpers[h], NULL);

    for (int64_t t = 0; t < k; t++) {
        partial acc = {0, 0, 0, 0, 0, 0, 0, 0, NAN, NAN};
        for (int64_t j = 0; j < n_items; j++)
            if (item_tensor[j] == t) merge(&acc, &items[j]);
        double *row = out + t * OUT_WIDTH;
        row[OUT_COUNT] = acc.count;
        row[OUT_SUM] = acc.sum;
        row[OUT_M2] = acc.m2;
        row[OUT_MIN] = acc.min;
        row[OUT_MAX] = acc.max;
        row[OUT_L1] = acc.l1;
        row[OUT_ZEROS] = acc.zeros;
        row[OUT_NANS] = acc.nans;
        row[OUT_INFS] = acc.infs;
    }
    free(item_tensor);
    free(item_start);
    free(items);
    return 0;
}

/* Histograms of strided samples: value i*stride[g] of tensor g, for i*stride[g] < numel[g], goes
 * to bin min(floor((x - lo[g]) * scale[g]), bins - 1) computed in the tensor's own precision,
 * exactly as tensorlens.reductions.histogram_counts does with PyTorch ops (a subtraction and a
 * multiplication, each correctly rounded, so both give the same bin; the exact edges are derived
 * from the same arithmetic). NaN and Inf are not binned. With clip, values outside [lo, hi] are
 * counted in below/above instead. counts is [g, bins], zeroed here. */
#define DEFINE_BINNING(NAME, T, FLOOR)                                                       \
    static void NAME(const T *x, int64_t n, int64_t stride, T lo, T hi, T scale, int64_t bins, \
                     int32_t clip, int64_t *counts, int64_t *below, int64_t *above) {        \
        T top = (T)(bins - 1);                                                               \
        for (int64_t i = 0; i < n; i += stride) {                                            \
            T v = x[i];                                                                      \
            if (!isfinite(v)) continue;                                                      \
            if (clip && v < lo) { (*below)++; continue; }                                    \
            if (clip && v > hi) { (*above)++; continue; }                                    \
            T position = (v - lo) * scale;                                                   \
            position = position < 0 ? 0 : position > top ? top : position;                   \
            counts[(int64_t)FLOOR(position)]++;                                              \
        }                                                                                    \
    }

DEFINE_BINNING(bin_f32, float, floorf)
DEFINE_BINNING(bin_f64, double, floor)

int tl_histograms(int64_t g, const void *const *data, const int64_t *numel, const int64_t *stride,
                  const int32_t *is_double, const double *lo, const double *hi, const double *scale,
                  int64_t bins, int32_t clip, int64_t *counts, int64_t *below, int64_t *above) {
    for (int64_t i = 0; i < g; i++) {
        int64_t *row = counts + i * bins;
        for (int64_t b = 0; b < bins; b++) row[b] = 0;
        below[i] = above[i] = 0;
        if (is_double[i])
            bin_f64((const double *)data[i], numel[i], stride[i], lo[i], hi[i], scale[i], bins, clip, row,
                    &below[i], &above[i]);
        else
            bin_f32((const float *)data[i], numel[i], stride[i], (float)lo[i], (float)hi[i], (float)scale[i],
                    bins, clip, row, &below[i], &above[i]);
    }
    return 0;
}

/* Exact histogram edges, as tensorlens.reductions.exact_edges computes them with numpy: edge i of
 * histogram g is the smallest value x of the tensor's dtype in [lo, hi] with
 * floor((x - lo) * scale) >= i, found by bisection over the ordered bit patterns of the dtype
 * (the bin is a monotone function of x). out is [g, bins + 1]. */
static int64_t key_f32(float x) {
    int32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? (int64_t)(bits ^ INT32_MAX) : (int64_t)bits;
}
static float value_f32(int64_t key) {
    int32_t bits = key < 0 ? (int32_t)key ^ INT32_MAX : (int32_t)key;
    float x;
    __builtin_memcpy(&x, &bits, sizeof x);
    return x;
}
static int64_t key_f64(double x) {
    int64_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? bits ^ INT64_MAX : bits;
}
static double value_f64(int64_t key) {
    int64_t bits = key < 0 ? key ^ INT64_MAX : key;
    double x;
    __builtin_memcpy(&x, &bits, sizeof x);
    return x;
}

#define DEFINE_EDGES(NAME, T, KEY, VALUE, FLOOR)                                             \
    static void NAME(T lo, T hi, T scale, int64_t bins, double *out) {                       \
        int64_t low_key = KEY(lo), high_key = KEY(hi);                                       \
        out[0] = lo;                                                                         \
        out[bins] = hi;                                                                      \
        int64_t left = low_key;                                                              \
        for (int64_t i = 1; i < bins; i++) {                                                 \
            int64_t l = left, r = high_key; /* edges increase: start from the previous one */ \
            /* the edge is almost always within a few ulps of lo + i / scale */               \
            T guess = (T)((double)lo + (double)i / (double)scale);                           \
            if (isfinite(guess)) {                                                           \
                int64_t g = KEY(guess), gl = g - 8, gr = g + 8;                              \
                if (gl > l && gr < r && FLOOR((VALUE(gr) - lo) * scale) >= (T)i &&          \
                    !(FLOOR((VALUE(gl) - lo) * scale) >= (T)i)) {                            \
                    l = gl + 1;                                                              \
                    r = gr;                                                                  \
                }                                                                            \
            }                                                                                \
            while (l < r) {                                                                  \
                int64_t middle = (l >> 1) + (r >> 1) + (l & r & 1);                          \
                T x = VALUE(middle);                                                         \
                if (FLOOR((x - lo) * scale) >= (T)i) r = middle; else l = middle + 1;        \
            }                                                                                \
            out[i] = VALUE(r);                                                               \
            left = r;                                                                        \
        }                                                                                    \
        for (int64_t i = 1; i <= bins; i++) /* as numpy's maximum.accumulate */              \
            if (out[i] < out[i - 1]) out[i] = out[i - 1];                                    \
    }

DEFINE_EDGES(edges_f32, float, key_f32, value_f32, floorf)
DEFINE_EDGES(edges_f64, double, key_f64, value_f64, floor)

int tl_edges(int64_t g, const double *lo, const double *hi, const double *scale, int64_t bins,
             int32_t is_double, double *out) {
    for (int64_t i = 0; i < g; i++) {
        if (is_double)
            edges_f64(lo[i], hi[i], scale[i], bins, out + i * (bins + 1));
        else
            edges_f32((float)lo[i], (float)hi[i], (float)scale[i], bins, out + i * (bins + 1));
    }
    return 0;
}
