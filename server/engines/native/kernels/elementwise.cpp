// A layer's elementwise ops as one native call each (elementwise_kernel.py): RMSNorm and rotary
// embedding. Each is a handful of torch ops (casts, pow, mean, rsqrt, muls; a complex view and
// back), and between GEMMs that stream megabytes of weights every one of them starts from cold
// caches: tens of microseconds a call for a few thousand numbers. Here each is one pass over the
// rows. Rows are independent: a row's result does not depend on the other rows of the call.
// No OpenMP: a call is microseconds, less than a team's barrier.

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

using polyserve_bf16::cvt;

using polyserve_bf16::to_bf16;

inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float f) { *p = to_bf16(f); }
inline float round_to(float, float v) { return v; }
inline float round_to(uint16_t, float v) { return cvt(to_bf16(v)); }

// As transformers' LlamaRMSNorm: normalise in float32, round to the storage dtype, then times the
// weight (both in the storage dtype, the product rounded once).
template <typename T>
void rms_norm(int64_t rows, int64_t d, const T* x, int64_t stride, const T* w, float eps, T* out) {
    for (int64_t i = 0; i < rows; ++i) {
        const T* xi = x + i * stride;
        T* oi = out + i * d;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; ++j) {
            const float v = cvt(xi[j]);
            ss += v * v;
        }
        const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
            const float h = round_to(T{}, cvt(xi[j]) * rstd);
            store(oi + j, cvt(w[j]) * h);
        }
    }
}

// In place on the first `heads` heads of each row (q and k, their dims in rotary-pair order: pair
// p is dims 2p, 2p + 1): (a + ib) * table[pos] in float32, rounded once to the storage dtype.
template <typename T>
void rope(int64_t rows, T* qk, int64_t stride, int64_t heads, int64_t hd, const int64_t* positions,
          const float* table) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < rows; ++i) {
        const float* cs = table + positions[i] * hd;  // (cos, sin) pairs of this position
        for (int64_t h = 0; h < heads; ++h) {
            T* x = qk + i * stride + h * hd;
#pragma omp simd
            for (int64_t p = 0; p < half; ++p) {
                const float a = cvt(x[2 * p]), b = cvt(x[2 * p + 1]);
                const float c = cs[2 * p], s = cs[2 * p + 1];
                store(x + 2 * p, a * c - b * s);
                store(x + 2 * p + 1, a * s + b * c);
            }
        }
    }
}

}  // namespace

extern "C" {

// x (rows, d) with row stride `stride` (elements), w (d), out (rows, d) contiguous; all float32 or all
// bfloat16 (bf16 != 0). Returns 0, or 1 for a shape it refuses.
int polyserve_rms_norm(int64_t rows, int64_t d, const void* x, int64_t stride, const void* w, float eps, void* out,
                       int bf16) {
    if (rows < 0 || d <= 0 || stride < d) return 1;
    if (bf16)
        rms_norm(rows, d, static_cast<const uint16_t*>(x), stride, static_cast<const uint16_t*>(w), eps,
                 static_cast<uint16_t*>(out));
    else
        rms_norm(rows, d, static_cast<const float*>(x), stride, static_cast<const float*>(w), eps,
                 static_cast<float*>(out));
    return 0;
}

// qk (rows, >= heads * hd) with row stride `stride`, rotated in place; positions (rows) index the
// table (table_rows, hd / 2) of complex64 = (cos, sin) float pairs. Returns 0, or 1 for a shape or a
// position it refuses (nothing written then).
int polyserve_rope(int64_t rows, void* qk, int64_t stride, int64_t heads, int64_t hd, const int64_t* positions,
                   const float* table, int64_t table_rows, int bf16) {
    if (rows < 0 || heads <= 0 || hd <= 0 || hd % 2 || stride < heads * hd) return 1;
    for (int64_t i = 0; i < rows; ++i)
        if (positions[i] < 0 || positions[i] >= table_rows) return 1;
    if (bf16)
        rope(rows, static_cast<uint16_t*>(qk), stride, heads, hd, positions, table);
    else
        rope(rows, static_cast<float*>(qk), stride, heads, hd, positions, table);
    return 0;
}

}  // extern "C"
