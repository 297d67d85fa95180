/* One-read statistics of CPU float tensors, for tensorlens (see tensorlens/native/__init__.py).
 *
 * Eager PyTorch needs about six passes over a tensor for exact sum, min, max and centred second
 * moment (sum, aminmax, x - mean, sum, square, sum). This reads each value from memory once: a
 * tensor is cut into blocks of BLOCK values (16 KiB of float32 with AVX-512) that stay in L1;
 * each block is summed, then read again from L1 for its deviations from its own mean (the
 * corrected two-pass algorithm), |x|, zeros, min and max. Blocks are merged in double precision
 * with Chan's parallel update: an error of about 5e-10 of sum(|x|) on 3M N(0,1) float32 values,
 * the order of PyTorch's pairwise float32 sum, and a large offset does not cancel (each block is
 * centred on its own mean).
 *
 * Lanes: a block is accumulated in ACC independent vectors of each quantity (GCC/clang generic
 * vectors, lowered to the widest SIMD registers -march=native allows), enough to hide the add
 * latency; they were arrays of 64 float lanes that the compiler kept on the stack, at a third of
 * the speed. Each lane sums 64 values of a block, at any vector width. Nothing is reassociated
 * (no -ffast-math): IEEE semantics are kept and min/max are exact. A block whose float sum is not
 * finite (NaN, Inf, or an overflow of float32) is done again in double precision, value by value,
 * counting NaN and Inf exactly. |x| and zeros are computed only for a tensor that needs them.
 * While a block is read from L1 the second time, the next one is prefetched, so the memory read
 * overlaps the arithmetic (8 -> 12 GB/s on one core here).
 *
 * Work is split into chunks of at most CHUNK values that threads take in turn; the partial rows
 * of a tensor's chunks are merged the same way.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK (1 << 16)
#define ACC 4 /* independent vector accumulators per quantity: enough to hide the add latency */

/* The widest vectors the compiler was told it may use (-march=native); GCC and clang lower the
 * generic vector types below to them, or split them where the target has narrower ones. */
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
/* Values per block: each float lane sums 64 of them before the block is merged in double, so the
 * rounding error does not depend on the vector width (4096 values, 16 KiB of float32, with AVX-512). */
#define BLOCK (64 * ACC * (VBYTES / 4))
typedef float vf32 __attribute__((vector_size(VBYTES)));
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef double vf64 __attribute__((vector_size(VBYTES)));
typedef int64_t vi64 __attribute__((vector_size(VBYTES)));

/* Lane-wise min and max of finite values (a block holding NaN or Inf is redone value by value):
 * one instruction each on x86; elsewhere a compare and a select. */
#if VBYTES == 64
#define MIN_F32(a, b) ((vf32)_mm512_min_ps((__m512)(a), (__m512)(b)))
#define MAX_F32(a, b) ((vf32)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define MIN_F64(a, b) ((vf64)_mm512_min_pd((__m512d)(a), (__m512d)(b)))
#define MAX_F64(a, b) ((vf64)_mm512_max_pd((__m512d)(a), (__m512d)(b)))
#elif VBYTES == 32
#define MIN_F32(a, b) ((vf32)_mm256_min_ps((__m256)(a), (__m256)(b)))
#define MAX_F32(a, b) ((vf32)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define MIN_F64(a, b) ((vf64)_mm256_min_pd((__m256d)(a), (__m256d)(b)))
#define MAX_F64(a, b) ((vf64)_mm256_max_pd((__m256d)(a), (__m256d)(b)))
#elif defined(__SSE2__)
#define MIN_F32(a, b) ((vf32)_mm_min_ps((__m128)(a), (__m128)(b)))
#define MAX_F32(a, b) ((vf32)_mm_max_ps((__m128)(a), (__m128)(b)))
#define MIN_F64(a, b) ((vf64)_mm_min_pd((__m128d)(a), (__m128d)(b)))
#define MAX_F64(a, b) ((vf64)_mm_max_pd((__m128d)(a), (__m128d)(b)))
#else
#define SELECT(m, a, b, VI, V) ((V)(((VI)(a) & (m)) | ((VI)(b) & ~(m))))
#define MIN_F32(a, b) SELECT((a) < (b), a, b, vi32, vf32)
#define MAX_F32(a, b) SELECT((a) > (b), a, b, vi32, vf32)
#define MIN_F64(a, b) SELECT((a) < (b), a, b, vi64, vf64)
#define MAX_F64(a, b) SELECT((a) > (b), a, b, vi64, vf64)
#endif

/* What a caller may leave out of the second pass (each costs two vector operations per vector). */
enum { WANT_L1 = 1, WANT_ZEROS = 2 };

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

/* The exact fallback for a block whose float sum overflows float32 although every value is finite
 * (values near the largest float): value by value in double. Blocks holding NaN or Inf take the
 * vectorised NONFINITE_BLOCK below instead. */
#define DEFINE_EXACT_BLOCK(NAME, T)                                                          \
    static void NAME(const T *b, int64_t len, partial *p) {                                  \
        double exact = 0;                                                                    \
        for (int64_t j = 0; j < len; j++) {                                                  \
            T v = b[j];                                                                      \
            exact += (double)v;                                                              \
            p->nans += isnan(v) ? 1 : 0;                                                     \
            p->infs += isinf(v) ? 1 : 0;                                                     \
            p->zeros += v == 0 ? 1 : 0;                                                      \
            p->l1 += fabs((double)v);                                                        \
            if (v < p->min) p->min = v;                                                      \
            if (v > p->max) p->max = v;                                                      \
        }                                                                                    \
        p->sum = exact;                                                                      \
        p->mean = exact / len;                                                               \
        p->m2 = 0;                                                                           \
        for (int64_t j = 0; j < len; j++) {                                                  \
            double d = (double)b[j] - p->mean;                                               \
            p->m2 += d * d; /* NaN when the block holds NaN or Inf, as in numpy */           \
        }                                                                                    \
        if (p->nans > 0) p->min = p->max = NAN;                                              \
    }

DEFINE_EXACT_BLOCK(exact_block_f32, float)
DEFINE_EXACT_BLOCK(exact_block_f64, double)

/* A block holding NaN or Inf (its float sum is not finite), in the same vectors as a finite block:
 * one read from L1 that counts NaN, Inf and zeros and takes min, max and sum |x| (NaN is ignored by
 * the lane-wise min/max, which then become NaN for the whole block below, as numpy's do). The sum
 * and second moment of such a block are not finite whatever the other values are (NaN with a NaN;
 * +-Inf, or NaN for both signs, with an Inf), so they need no arithmetic. Returns 0 when the block
 * holds neither (a float32 overflow of finite values), which the caller then sums exactly in
 * double. A diverging run, where every tensor holds NaN, thereby costs what a finite one does
 * instead of a scalar pass in double over every value. */
#define DEFINE_NONFINITE_BLOCK(NAME, T, V, VI, W, SIGN_BIT, MIN, MAX, EXP_BITS)               \
    static int NAME(const T *b, int64_t len, partial *p) {                                   \
        const V zero = {0};                                                                  \
        const VI magnitude = (VI){0} | ~(SIGN_BIT);                                          \
        const VI inf_bits = (VI){0} | (EXP_BITS);                                            \
        V a[ACC], lo[ACC], hi[ACC];                                                          \
        VI nan[ACC], inf[ACC], z[ACC];                                                       \
        for (int q = 0; q < ACC; q++) {                                                      \
            a[q] = zero;                                                                     \
            nan[q] = inf[q] = z[q] = (VI){0};                                                \
            lo[q] = zero + (T)INFINITY;                                                      \
            hi[q] = zero - (T)INFINITY;                                                      \
        }                                                                                    \
        int64_t full = len - len % (ACC * W);                                                \
        for (int64_t j = 0; j < full; j += ACC * W)                                          \
            for (int q = 0; q < ACC; q++) {                                                  \
                V v;                                                                         \
                __builtin_memcpy(&v, b + j + q * W, sizeof v);                               \
                VI m = (VI)v & magnitude;                                                    \
                nan[q] -= m > inf_bits; /* NaN: exponent all ones, mantissa not zero */      \
                inf[q] -= m == inf_bits;                                                     \
                z[q] -= v == zero;                                                           \
                a[q] += (V)m;                                                                \
                lo[q] = MIN(v, lo[q]); /* a NaN lane keeps the previous value */             \
                hi[q] = MAX(v, hi[q]);                                                       \
            }                                                                                \
        double nans = 0, infs = 0, zeros = 0, l1 = 0, mn = INFINITY, mx = -INFINITY;         \
        for (int q = 0; q < ACC; q++)                                                        \
            for (int l = 0; l < W; l++) {                                                    \
                nans += (double)nan[q][l];                                                   \
                infs += (double)inf[q][l];                                                   \
                zeros += (double)z[q][l];                                                    \
                l1 += a[q][l];                                                               \
                if (lo[q][l] < mn) mn = lo[q][l];                                            \
                if (hi[q][l] > mx) mx = hi[q][l];                                            \
            }                                                                                \
        for (int64_t j = full; j < len; j++) {                                               \
            T v = b[j];                                                                      \
            nans += isnan(v) ? 1 : 0;                                                        \
            infs += isinf(v) ? 1 : 0;                                                        \
            zeros += v == 0 ? 1 : 0;                                                         \
            l1 += fabs((double)v);                                                           \
            if (v < mn) mn = v;                                                              \
            if (v > mx) mx = v;                                                              \
        }                                                                                    \
        if (nans == 0 && infs == 0) return 0;                                                \
        p->nans = nans;                                                                      \
        p->infs = infs;                                                                      \
        p->zeros = zeros;                                                                    \
        p->l1 = nans > 0 ? NAN : l1;                                                         \
        p->sum = nans > 0 || (mn == -INFINITY && mx == INFINITY) ? NAN : mx == INFINITY ? INFINITY : -INFINITY; \
        p->mean = p->sum;                                                                    \
        p->m2 = NAN; /* numpy: the variance of values holding NaN or Inf is NaN */           \
        p->min = nans > 0 ? NAN : mn;                                                        \
        p->max = nans > 0 ? NAN : mx;                                                        \
        return 1;                                                                            \
    }

/* One chunk of a tensor, block by block (see the top of this file). V/VI are the value and the
 * same-width integer vector types, W the values per vector; a block is accumulated in ACC * W
 * lanes of T. WANTS is a compile-time constant in each instance, so a column the caller does not
 * need costs nothing. While a block is read from L1 the second time, the next one is prefetched,
 * so the memory read overlaps the arithmetic instead of alternating with it. */
#define DEFINE_CHUNK(NAME, T, V, VI, W, SIGN_BIT, MIN, MAX, EXACT, NONFINITE, WANTS)                    \
    static void NAME(const T *x, int64_t n, int64_t offset, int64_t stride, T *sample,      \
                     partial *out) {                                                         \
        partial acc = {0, 0, 0, 0, 0, 0, 0, 0, INFINITY, -INFINITY};                         \
        const V zero = {0};                                                                  \
        const VI magnitude = (VI){0} | ~(SIGN_BIT); /* clears the sign bit: |x| */         \
        for (int64_t start = 0; start < n; start += BLOCK) {                                 \
            int64_t len = n - start < BLOCK ? n - start : BLOCK;                             \
            int64_t full = len - len % (ACC * W);                                            \
            const T *b = x + start;                                                          \
            if (sample) { /* copy every stride-th value (of the whole tensor) while in L1 */  \
                int64_t at = offset + start, index = (at + stride - 1) / stride;             \
                for (int64_t j = index * stride - at; j < len; j += stride) sample[index++] = b[j]; \
            }                                                                                \
            V s[ACC];                                                                        \
            for (int q = 0; q < ACC; q++) s[q] = zero;                                       \
            for (int64_t j = 0; j < full; j += ACC * W)                                      \
                for (int q = 0; q < ACC; q++) {                                              \
                    V v;                                                                     \
                    __builtin_memcpy(&v, b + j + q * W, sizeof v);                           \
                    s[q] += v;                                                               \
                }                                                                            \
            for (int q = 1; q < ACC; q++) s[0] += s[q];                                      \
            double block_sum = 0;                                                            \
            for (int l = 0; l < W; l++) block_sum += s[0][l];                                \
            for (int64_t j = full; j < len; j++) block_sum += b[j];                          \
            partial p = {(double)len, 0, 0, 0, 0, 0, 0, 0, INFINITY, -INFINITY};             \
            if (!isfinite(block_sum)) {                                                      \
                if (!NONFINITE(b, len, &p)) EXACT(b, len, &p);                               \
                merge(&acc, &p);                                                             \
                continue;                                                                    \
            }                                                                                \
            T centre = (T)(block_sum / len);                                                 \
            V c = zero + centre;                                                             \
            V d1[ACC], d2[ACC], a[ACC], lo[ACC], hi[ACC];                                    \
            VI z[ACC];                                                                       \
            for (int q = 0; q < ACC; q++) {                                                  \
                d1[q] = d2[q] = a[q] = zero;                                                 \
                z[q] = (VI){0};                                                              \
                lo[q] = zero + (T)INFINITY;                                                  \
                hi[q] = zero - (T)INFINITY;                                                  \
            }                                                                                \
            const T *next = b + BLOCK < x + n ? b + BLOCK : b;                               \
            for (int64_t j = 0; j < full; j += ACC * W) {                                    \
                for (int64_t f = 0; f < ACC * W; f += 64 / (int64_t)sizeof(T))                \
                    __builtin_prefetch(next + j + f, 0, 3);                                  \
                for (int q = 0; q < ACC; q++) {                                              \
                    V v;                                                                     \
                    __builtin_memcpy(&v, b + j + q * W, sizeof v);                           \
                    V d = v - c;                                                             \
                    d1[q] += d;                                                              \
                    d2[q] += d * d;                                                          \
                    if ((WANTS) & WANT_L1) a[q] += (V)((VI)v & magnitude);                   \
                    if ((WANTS) & WANT_ZEROS) z[q] -= v == zero; /* true is -1 */            \
                    lo[q] = MIN(v, lo[q]);                                                   \
                    hi[q] = MAX(v, hi[q]);                                                   \
                }                                                                            \
            }                                                                                \
            for (int q = 1; q < ACC; q++) { /* one vector of each, then its lanes in double */ \
                d1[0] += d1[q];                                                              \
                d2[0] += d2[q];                                                              \
                a[0] += a[q];                                                                \
                z[0] += z[q];                                                                \
                lo[0] = MIN(lo[q], lo[0]);                                                   \
                hi[0] = MAX(hi[q], hi[0]);                                                   \
            }                                                                                \
            double sd1 = 0, sd2 = 0;                                                         \
            for (int l = 0; l < W; l++) {                                                    \
                sd1 += d1[0][l];                                                             \
                sd2 += d2[0][l];                                                             \
                p.l1 += a[0][l];                                                             \
                p.zeros += (double)z[0][l];                                                  \
                if (lo[0][l] < p.min) p.min = lo[0][l];                                      \
                if (hi[0][l] > p.max) p.max = hi[0][l];                                      \
            }                                                                                \
            for (int64_t j = full; j < len; j++) {                                           \
                T v = b[j];                                                                  \
                double d = (double)v - (double)centre;                                       \
                sd1 += d;                                                                    \
                sd2 += d * d;                                                                \
                p.l1 += fabs((double)v);                                                     \
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

#define W32 (VBYTES / 4)
#define W64 (VBYTES / 8)
#define SIGN32 ((int32_t)0x80000000)
#define SIGN64 ((int64_t)0x8000000000000000)
DEFINE_NONFINITE_BLOCK(nonfinite_block_f32, float, vf32, vi32, W32, SIGN32, MIN_F32, MAX_F32, (int32_t)0x7f800000)
DEFINE_NONFINITE_BLOCK(nonfinite_block_f64, double, vf64, vi64, W64, SIGN64, MIN_F64, MAX_F64, (int64_t)0x7ff0000000000000)
DEFINE_CHUNK(chunk_f32_0, float, vf32, vi32, W32, SIGN32, MIN_F32, MAX_F32, exact_block_f32, nonfinite_block_f32, 0)
DEFINE_CHUNK(chunk_f32_1, float, vf32, vi32, W32, SIGN32, MIN_F32, MAX_F32, exact_block_f32, nonfinite_block_f32, 1)
DEFINE_CHUNK(chunk_f32_2, float, vf32, vi32, W32, SIGN32, MIN_F32, MAX_F32, exact_block_f32, nonfinite_block_f32, 2)
DEFINE_CHUNK(chunk_f32_3, float, vf32, vi32, W32, SIGN32, MIN_F32, MAX_F32, exact_block_f32, nonfinite_block_f32, 3)
DEFINE_CHUNK(chunk_f64_0, double, vf64, vi64, W64, SIGN64, MIN_F64, MAX_F64, exact_block_f64, nonfinite_block_f64, 0)
DEFINE_CHUNK(chunk_f64_1, double, vf64, vi64, W64, SIGN64, MIN_F64, MAX_F64, exact_block_f64, nonfinite_block_f64, 1)
DEFINE_CHUNK(chunk_f64_2, double, vf64, vi64, W64, SIGN64, MIN_F64, MAX_F64, exact_block_f64, nonfinite_block_f64, 2)
DEFINE_CHUNK(chunk_f64_3, double, vf64, vi64, W64, SIGN64, MIN_F64, MAX_F64, exact_block_f64, nonfinite_block_f64, 3)

typedef void (*chunk_fn)(const void *, int64_t, int64_t, int64_t, void *, partial *);
/* [is_double][wants] */
static const chunk_fn CHUNKS[2][4] = {
    {(chunk_fn)chunk_f32_0, (chunk_fn)chunk_f32_1, (chunk_fn)chunk_f32_2, (chunk_fn)chunk_f32_3},
    {(chunk_fn)chunk_f64_0, (chunk_fn)chunk_f64_1, (chunk_fn)chunk_f64_2, (chunk_fn)chunk_f64_3},
};

typedef struct {
    int64_t k;
    const void *const *data;
    const int64_t *numel;
    const int32_t *is_double;
    const int32_t *wants;
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
        int32_t is_double = w->is_double[t] != 0;
        const char *data = (const char *)w->data[t] + start * (is_double ? 8 : 4);
        CHUNKS[is_double][w->wants[t] & 3](data, len, start, stride, w->sample[t], &w->items[i]);
    }
}

/* Partial rows of k contiguous tensors into out[k * OUT_WIDTH], using up to `threads` threads.
 * wants[t] (WANT_L1 | WANT_ZEROS) says which of those columns tensor t needs; the others are NaN.
 * Where sample[t] is not NULL, every sample_stride[t]-th value of tensor t is also copied there
 * (for its histogram: a strided sample gathered while the values are in cache anyway).
 * Returns 0, or -1 when memory could not be had (the caller falls back). */
#ifndef MIN_PER_THREAD
#define MIN_PER_THREAD CHUNK
#endif

/* 1 when the chunks of a call are shared with PyTorch's OpenMP workers (see tl_moments). */
int tl_shares_torch_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int tl_moments(int64_t k, const void *const *data, const int64_t *numel, const int32_t *is_double,
               const int32_t *wants, const int64_t *sample_stride, void *const *sample, double *out, int32_t threads) {
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
    job w = {k, data, numel, is_double, wants, sample_stride, sample, n_items, item_tensor, item_start, items, 0};
    int64_t total = 0;
    for (int64_t t = 0; t < k; t++) total += numel[t];
#ifdef _OPENMP
    /* Built with -fopenmp only where PyTorch's own libgomp is loaded: the same runtime, so its
     * workers, still spinning after the last op, take chunks at once (as an ATen op's would). */
    if (threads > total / MIN_PER_THREAD) threads = (int32_t)(total / MIN_PER_THREAD);
    if (threads > n_items) threads = (int32_t)n_items;
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        work(&w);
    } else {
        work(&w);
    }
#else
    /* a thread costs ~30 us to start, and right after a PyTorch op it competes with OpenMP
     * workers still spinning: only worth it with a million values or more for each thread */
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
#endif

    /* a tensor's chunks are consecutive items, merged in order (the same bits for any threads) */
    for (int64_t t = 0, j = 0; t < k; t++) {
        partial acc = {0, 0, 0, 0, 0, 0, 0, 0, NAN, NAN};
        for (; j < n_items && item_tensor[j] == t; j++) merge(&acc, &items[j]);
        double *row = out + t * OUT_WIDTH;
        row[OUT_COUNT] = acc.count;
        row[OUT_SUM] = acc.sum;
        row[OUT_M2] = acc.m2;
        row[OUT_MIN] = acc.min;
        row[OUT_MAX] = acc.max;
        row[OUT_L1] = wants[t] & WANT_L1 ? acc.l1 : NAN;
        row[OUT_ZEROS] = wants[t] & WANT_ZEROS ? acc.zeros : NAN;
        row[OUT_NANS] = acc.nans;
        row[OUT_INFS] = acc.infs;
    }
    free(item_tensor);
    free(item_start);
    free(items);
    return 0;
}

/* tl_moments of one tensor, with scalar arguments: called once per large activation, where
 * building ctypes arrays for a batch of one cost more than the rest of the call. */
int tl_moments_one(const void *data, int64_t numel, int32_t is_double, int32_t wants, int64_t sample_stride,
                   void *sample, double *out, int32_t threads) {
    return tl_moments(1, &data, &numel, &is_double, &wants, &sample_stride, &sample, out, threads);
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
            /* as nan_to_num + clamp on the PyTorch path: NaN (0 * inf, a range that rounds   \
             * to a point in the dtype) and -inf to bin 0, +inf to the last */                \
            if (!(position >= 0)) position = 0;                                              \
            else if (position > top) position = top;                                         \
            counts[(int64_t)FLOOR(position)]++;                                              \
        }                                                                                    \
    }

DEFINE_BINNING(bin_f32, float, floorf)
DEFINE_BINNING(bin_f64, double, floor)

int tl_histograms(int64_t g, const void *const *data, const int64_t *numel, const int64_t *stride,
                  const int32_t *is_double, const double *lo, const double *hi, const double *scale,
                  int64_t bins, int32_t clip, int64_t *counts, int64_t *below, int64_t *above) {
    int64_t total = 0; /* values binned */
    for (int64_t i = 0; i < g; i++) total += stride[i] > 0 ? (numel[i] + stride[i] - 1) / stride[i] : 0;
    (void)total;
    /* histograms are independent (each writes its own row): split them over PyTorch's OpenMP
     * workers once there is enough to bin (a step's 4096-value samples: ~1 ns a value) */
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) if (total >= MIN_PER_THREAD && g > 1)
#endif
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
            /* the edge is almost always within an ulp or two of lo + i / scale: step from   \
             * there, one ulp at a time, and bisect only when that does not settle it */      \
            T guess = (T)((double)lo + (double)i / (double)scale);                           \
            if (isfinite(guess)) {                                                           \
                int64_t g = KEY(guess);                                                      \
                if (g < l) g = l;                                                            \
                if (g > r) g = r;                                                            \
                int steps = 0;                                                               \
                if (FLOOR((VALUE(g) - lo) * scale) >= (T)i) {                                \
                    while (g > l && steps < 8 && FLOOR((VALUE(g - 1) - lo) * scale) >= (T)i) { g--; steps++; } \
                    if (steps < 8) { l = r = g; } else r = g;                                \
                } else {                                                                     \
                    while (g < r && steps < 8 && !(FLOOR((VALUE(g + 1) - lo) * scale) >= (T)i)) { g++; steps++; } \
                    if (steps < 8 && g < r) { l = r = g + 1; } else l = g + 1 < r ? g + 1 : r; \
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

/* The finite range of every stride[i]-th value of tensor i: lo[i] = the smallest finite value,
 * hi[i] = the largest (+inf and -inf when none is finite). A histogram of a tensor holding NaN or
 * Inf spans its sample's finite values (the histogram's own range, as on the PyTorch path). */
#define DEFINE_FINITE_RANGE(NAME, T)                                                         \
    static void NAME(const T *x, int64_t n, int64_t stride, double *lo, double *hi) {        \
        T mn = (T)INFINITY, mx = -(T)INFINITY;                                               \
        for (int64_t i = 0; i < n; i += stride) {                                            \
            T v = x[i];                                                                      \
            if (!isfinite(v)) continue;                                                      \
            if (v < mn) mn = v;                                                              \
            if (v > mx) mx = v;                                                              \
        }                                                                                    \
        *lo = mn;                                                                            \
        *hi = mx;                                                                            \
    }

DEFINE_FINITE_RANGE(finite_range_f32, float)
DEFINE_FINITE_RANGE(finite_range_f64, double)

int tl_finite_range(int64_t g, const void *const *data, const int64_t *numel, const int64_t *stride,
                    const int32_t *is_double, double *lo, double *hi) {
    for (int64_t i = 0; i < g; i++) {
        if (is_double[i])
            finite_range_f64((const double *)data[i], numel[i], stride[i], &lo[i], &hi[i]);
        else
            finite_range_f32((const float *)data[i], numel[i], stride[i], &lo[i], &hi[i]);
    }
    return 0;
}
