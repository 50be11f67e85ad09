// Per-row LoRA of a fused linear, one call for a step's decode rows and short prompt chunks (lora_kernel.py).
//
//   for each i < n, with row t = row[i] (or i when row is null) and s = slot[i] (or i):
//       u           = x[t] @ A[s]                         A[s] (d_in, k), k = members * r
//       out[t, c]  += u[j*r : (j+1)*r] @ B[s][j*r : (j+1)*r, c]   for c in member j's columns
//
// B[s] is (k, d_out) block diagonal (member j's rows j*r.. hold its B in its own columns, zeros
// elsewhere); only the members' blocks are read, so a row reads d_in*k + r*d_out table entries.
// Sums run in float32 whatever the storage (float32 or bfloat16, per tensor); a bfloat16 `out`
// is rounded to nearest even once, after its LoRA sum is added. Each row is computed on its own,
// in the same order, whatever the other rows: a row's result does not depend on its batch.
// The rows are shared out over the calling thread's OpenMP team. Built with -fopenmp, the library
// needs libgomp.so.1, which the dynamic loader finds already loaded by torch: one runtime, one
// pool per thread, the threads torch's own ops use (server/openmp.py).

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

constexpr int64_t PARALLEL_MIN_ROWS = 4;  // fewer rows run on the calling thread alone

using polyserve_bf16::cvt;
using polyserve_bf16::to_bf16;

// RC: the rank when known at compile time (the loops unroll, sums stay in registers), 0: rank r.
// u[0..r) = x[0..d_in) @ A[:, off..off+r) of A (d_in, k): four partial sums, so consecutive
// multiply-adds do not wait on each other.
template <int RC, typename T>
void shrink(const float* x, const T* A, int64_t d_in, int64_t k, int64_t off, int64_t r_, float* u) {
    const int64_t r = RC ? RC : r_;
    constexpr int64_t CAP = RC ? RC : 64;
    float s0[CAP] = {}, s1[CAP] = {}, s2[CAP] = {}, s3[CAP] = {};
    int64_t t = 0;
    for (; t + 4 <= d_in; t += 4) {
        const T* a = A + t * k + off;
        const float x0 = x[t], x1 = x[t + 1], x2 = x[t + 2], x3 = x[t + 3];
        for (int64_t c = 0; c < r; ++c) {
            s0[c] += x0 * cvt(a[c]);
            s1[c] += x1 * cvt(a[k + c]);
            s2[c] += x2 * cvt(a[2 * k + c]);
            s3[c] += x3 * cvt(a[3 * k + c]);
        }
    }
    for (; t < d_in; ++t)
        for (int64_t c = 0; c < r; ++c) s0[c] += x[t] * cvt(A[t * k + off + c]);
    for (int64_t c = 0; c < r; ++c) u[c] = (s0[c] + s1[c]) + (s2[c] + s3[c]);
}

// out[0..w) += u[0..r) @ B[0..r, 0..w) (B's rows d_out apart), the sum rounded into out once
template <int RC, typename T, typename O>
void expand(const float* u, const T* B, int64_t r_, int64_t d_out, int64_t w, O* out) {
    const int64_t r = RC ? RC : r_;
    for (int64_t c = 0; c < w; ++c) {
        float s = 0.0f;
        for (int64_t i = 0; i < r; ++i) s += u[i] * cvt(B[i * d_out + c]);
        if constexpr (sizeof(O) == 4) {
            out[c] += s;
        } else {
            out[c] = to_bf16(cvt(out[c]) + s);
        }
    }
}

template <int RC, typename T, typename X, typename O>
void rows(int64_t n, const X* x, int64_t x_stride, const T* A, const T* B, int64_t slot_stride_a,
          int64_t slot_stride_b, const int64_t* slot, const int64_t* row, O* out, int64_t out_stride, int64_t d_in, int64_t d_out,
          int64_t r, int64_t members, const int64_t* start, const int64_t* width) {
    const int64_t k = members * r;
    // rows are independent (each writes only its own output row, computed the same way whatever
    // the split): shared out over the calling thread's OpenMP team
#pragma omp parallel if (n >= PARALLEL_MIN_ROWS)
    {
        std::vector<float> xf(d_in), u(k);
#pragma omp for schedule(static)
        for (int64_t q = 0; q < n; ++q) {
            const int64_t s = slot ? slot[q] : q, i = row ? row[q] : q;
            for (int64_t t = 0; t < d_in; ++t) xf[t] = cvt(x[i * x_stride + t]);
            const T* a = A + s * slot_stride_a;
            for (int64_t j = 0; j < members; ++j) shrink<RC, T>(xf.data(), a, d_in, k, j * r, r, u.data() + j * r);
            for (int64_t j = 0; j < members; ++j) {
                const int64_t c0 = start[j];
                expand<RC, T, O>(u.data() + j * r, B + s * slot_stride_b + j * r * d_out + c0, r, d_out, width[j],
                                 out + i * out_stride + c0);
            }
        }
    }
}

template <int RC, typename T>
void by_io(int64_t n, const void* x, int x_bf16, int64_t x_stride, const void* A, const void* B,
           int64_t sa, int64_t sb, const int64_t* slot, const int64_t* row, void* out, int out_bf16, int64_t out_stride,
           int64_t d_in, int64_t d_out, int64_t r, int64_t members, const int64_t* start, const int64_t* width) {
    const T* a = static_cast<const T*>(A);
    const T* b = static_cast<const T*>(B);
#define POLYSERVE_ROWS(X, O)                                                                              \
    rows<RC, T, X, O>(n, static_cast<const X*>(x), x_stride, a, b, sa, sb, slot, row, static_cast<O*>(out),  \
                      out_stride, d_in, d_out, r, members, start, width)
    if (x_bf16 && out_bf16) POLYSERVE_ROWS(uint16_t, uint16_t);
    else if (x_bf16) POLYSERVE_ROWS(uint16_t, float);
    else if (out_bf16) POLYSERVE_ROWS(float, uint16_t);
    else POLYSERVE_ROWS(float, float);
#undef POLYSERVE_ROWS
}

template <typename T>
void by_rank(int64_t n, const void* x, int x_bf16, int64_t x_stride, const void* A, const void* B,
             int64_t sa, int64_t sb, const int64_t* slot, const int64_t* row, void* out, int out_bf16, int64_t out_stride,
             int64_t d_in, int64_t d_out, int64_t r, int64_t members, const int64_t* start, const int64_t* width) {
#define POLYSERVE_RANK(RC) \
    by_io<RC, T>(n, x, x_bf16, x_stride, A, B, sa, sb, slot, row, out, out_bf16, out_stride, d_in, d_out, r, members, start, width)
    switch (r) {
        case 4: POLYSERVE_RANK(4); break;
        case 8: POLYSERVE_RANK(8); break;
        case 16: POLYSERVE_RANK(16); break;
        case 32: POLYSERVE_RANK(32); break;
        default: POLYSERVE_RANK(0);
    }
#undef POLYSERVE_RANK
}

}  // namespace

extern "C" {

// tables_bf16: A and B are bfloat16 (else float32); strides in elements; r <= 64 (the caller checks).
void polyserve_lora_rows(int64_t n, const void* x, int x_bf16, int64_t x_stride, const void* A,
                         const void* B, int tables_bf16, int64_t slot_stride_a, int64_t slot_stride_b,
                         const int64_t* slot, const int64_t* row, void* out, int out_bf16, int64_t out_stride, int64_t d_in,
                         int64_t d_out, int64_t r, int64_t members, const int64_t* start,
                         const int64_t* width) {
    if (tables_bf16)
        by_rank<uint16_t>(n, x, x_bf16, x_stride, A, B, slot_stride_a, slot_stride_b, slot, row, out, out_bf16,
                          out_stride, d_in, d_out, r, members, start, width);
    else
        by_rank<float>(n, x, x_bf16, x_stride, A, B, slot_stride_a, slot_stride_b, slot, row, out, out_bf16,
                       out_stride, d_in, d_out, r, members, start, width);
}

}  // extern "C"
