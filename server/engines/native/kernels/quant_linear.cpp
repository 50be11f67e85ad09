// y = x @ W.T (+ b), then an activation or an elementwise op with `other`, where W stays in the
// GGUF block format it was stored in (quant_linear.py): Q4_1 (32 weights in 20 bytes: fp16 d and m,
// 4-bit codes, w = d * q + m) or Q8_0 (32 weights in 34 bytes: fp16 d, int8 codes, w = d * q), the
// same bytes regrouped per output column (quant_linear.columns: the blocks' codes, then their
// scales, so a column's scales convert to float32 a vector at a time).
//
// Why: a decode step of a small model on an AVX2 CPU reads every weight once from memory; float32
// weights are 4 bytes each, these 0.625 and 1.06. The weights are dequantised a panel of PANEL output
// columns at a time into a float32 buffer that stays in L1/L2, exactly as the GGUF reader does
// (w = fma(q, d, m) rounds once, as (d * q) + m does: d * q is exact in float32), and every row of x
// is then multiplied with that panel in float32 FMAs.
//
// Each output element is summed in one fixed order (V partial sums over k = lane mod V, V the vector
// width, then one fixed tree), whatever the number of rows, the row's place in the batch, or the
// threads: a row's result does not depend on what else is in the step. (A CPU with AVX-512 sums in 16
// lanes, one with AVX2 only in 8: the last bits of a result differ between the two kinds of CPU, as
// they do between oneDNN's kernels for each.)
//
// Built by cpp_kernel.py with -march=native; without AVX2, FMA and F16C it does not compile and the
// caller keeps the float32 GEMMs. With AVX-512 the panels are dequantised and multiplied 16 floats
// an instruction in 32 registers (twice the work of an AVX2 instruction, and a larger tile). The
// panels are shared out over the calling thread's OpenMP team (torch's libgomp): one thread when
// torch runs on one (one-thread steps), no team at all; a caller without a team shares them
// with the panel helper where it runs (panel_helper.h).

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_helper.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_linear needs AVX2, FMA and F16C"
#endif

namespace {

constexpr int FMT_Q4_1 = 0;
constexpr int FMT_Q8_0 = 1;
constexpr int BLOCK = 32;
constexpr int PANEL = 12;  // output columns dequantised together
constexpr int OP_NONE = 0, OP_SILU = 1, OP_ADD = 2, OP_MUL = 3;
// below this many multiply-adds the call runs on the calling thread (a team's wake-up costs more)
constexpr int64_t PARALLEL_MIN_WORK = 1 << 18;

int block_bytes(int fmt) { return fmt == FMT_Q4_1 ? 20 : 34; }

inline float hsum4(__m128 s4) {
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#if defined(__AVX512F__)
using vec = __m512;
constexpr int V = 16;  // floats a vector
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_load_ps(p); }
inline vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstoreu(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vhalves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline float hsum(vec v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    return hsum4(_mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)));
}
// tiles (rows x panel columns) for 4, 3, 2 and 1 rows: the accumulators, one register per column's
// weights and one for x fit in the 32 vector registers
constexpr int C4 = 6, C3 = 6, C2 = 6, C1 = 12;
#else
using vec = __m256;
constexpr int V = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_load_ps(p); }
inline vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstoreu(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vhalves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum(vec v) { return hsum4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }
// the same in 16 registers: 4 x 3 uses all of them (12 accumulators, 3 weights, x)
constexpr int C4 = 3, C3 = 3, C2 = 4, C1 = 6;
#endif
constexpr int ALIGN = V * 4;  // bytes: the panel is read with aligned vector loads

inline float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// a Q4_1 block's 4-bit codes, a byte each: weights 0..15 (the low nibbles) and 16..31 (the high)
inline void q4_codes(const uint8_t* codes, __m128i* lo, __m128i* hi) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    *lo = _mm_and_si128(q, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
}

#if defined(__AVX512F__)
inline void dequant_q4_1(const uint8_t* codes, float d, float m, float* dst) {
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    __m128i lo, hi;
    q4_codes(codes, &lo, &hi);
    _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm));
    _mm512_store_ps(dst + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm));
}

inline void dequant_q8_0(const uint8_t* codes, float d, float* dst) {
    const __m512 vd = _mm512_set1_ps(d);
    for (int i = 0; i < 2; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
        _mm512_store_ps(dst + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vd));
    }
}
#else
inline void dequant_q4_1(const uint8_t* codes, float d, float m, float* dst) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    __m128i lo, hi;
    q4_codes(codes, &lo, &hi);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
        const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_store_ps(dst + 8 * i, _mm256_fmadd_ps(code, vd, vm));
    }
}

inline void dequant_q8_0(const uint8_t* codes, float d, float* dst) {
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
        _mm256_store_ps(dst + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd));
    }
}
#endif

// n fp16 values to float32, V an instruction
inline void halves_to_float(const uint8_t* src, int64_t n, float* dst) {
    int64_t i = 0;
    for (; i + V <= n; i += V) vstoreu(dst + i, vhalves(src + 2 * i));
    for (; i < n; ++i) dst[i] = half(src + 2 * i);
}

// columns [n0, n0 + cols) of W, each K weights, into panel[c * K + k]. A column's row of W is laid
// out by quant_linear.py as its blocks' codes, then their fp16 d, then (Q4_1) their fp16 m: the
// scales of a column convert to float32 V at a time into `scales` (2 * K / 32 floats)
void dequant_panel(int fmt, const uint8_t* w, int64_t K, int64_t n0, int cols, float* panel, float* scales) {
    const int64_t nb = K / BLOCK, bytes = block_bytes(fmt), code_bytes = fmt == FMT_Q4_1 ? 16 : 32;
    for (int c = 0; c < cols; ++c) {
        const uint8_t* codes = w + (n0 + c) * nb * bytes;
        const uint8_t* halves = codes + nb * code_bytes;
        float* dst = panel + c * K;
        if (fmt == FMT_Q4_1) {
            halves_to_float(halves, 2 * nb, scales);
            for (int64_t b = 0; b < nb; ++b) dequant_q4_1(codes + b * 16, scales[b], scales[nb + b], dst + b * BLOCK);
        } else {
            halves_to_float(halves, nb, scales);
            for (int64_t b = 0; b < nb; ++b) dequant_q8_0(codes + b * 32, scales[b], dst + b * BLOCK);
        }
    }
}

// R rows x C panel columns: R * C independent sums, each over k in the same order
template <int R, int C>
inline void tile(const float* x, int64_t xs, const float* panel, int64_t K, float* res, int64_t rs) {
    vec acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = vzero();
    for (int64_t k = 0; k < K; k += V) {
        // each operand loaded once into a register (the empty asm keeps the compiler from folding a
        // load into every FMA that uses it: R * C loads a step instead of R + C)
        vec wv[C];
        for (int c = 0; c < C; ++c) {
            wv[c] = vload(panel + c * K + k);
            __asm__("" : "+v"(wv[c]));
        }
        for (int r = 0; r < R; ++r) {
            vec xv = vloadu(x + r * xs + k);
            __asm__("" : "+v"(xv));
            for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) res[r * rs + c] = hsum(acc[r][c]);
}

// R rows against `cols` panel columns, C at a time (enough independent sums to keep the FMA pipes busy)
template <int R, int C>
void rows_against_panel(const float* x, int64_t xs, const float* panel, int64_t K, int cols, float* res) {
    int c = 0;
    for (; c + C <= cols; c += C) tile<R, C>(x, xs, panel + c * K, K, res + c, PANEL);
    for (; c < cols; ++c) tile<R, 1>(x, xs, panel + c * K, K, res + c, PANEL);
}

inline float finish(float v, int op, float other) {
    switch (op) {
        case OP_SILU: return v / (1.0f + std::exp(-v));
        case OP_ADD: return v + other;
        case OP_MUL: return v * other;
        default: return v;
    }
}

// a thread's buffers, reused across calls: the vector-aligned panel of PANEL x K floats, a column's
// scales, and the raw sums of a panel (rows PANEL floats apart)
struct Scratch {
    float* panel;
    float* scales;
    float* sums;
};

Scratch thread_scratch(int64_t M, int64_t K) {
    static thread_local std::vector<float> storage, scales, sums;
    if (storage.size() < static_cast<size_t>(PANEL * K + V)) storage.resize(PANEL * K + V);
    if (scales.size() < static_cast<size_t>(2 * (K / BLOCK))) scales.resize(2 * (K / BLOCK));
    if (sums.size() < static_cast<size_t>(M * PANEL)) sums.resize(M * PANEL);
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + ALIGN - 1) &
                                            ~uintptr_t(ALIGN - 1));
    return {panel, scales.data(), sums.data()};
}

inline int panel_cols(int64_t N, int64_t p) { return static_cast<int>(N - p * PANEL < PANEL ? N - p * PANEL : PANEL); }

// panel p's raw sums for the M rows of x (rows xs apart) into sums (rows PANEL floats apart)
void panel_sums(int fmt, int64_t M, int64_t K, const float* x, int64_t xs, const uint8_t* w, int64_t N, int64_t p,
                const Scratch& s, float* sums) {
    const int cols = panel_cols(N, p);
    dequant_panel(fmt, w, K, p * PANEL, cols, s.panel, s.scales);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int rows = static_cast<int>(M - m0 < 4 ? M - m0 : 4);
        const float* xr = x + m0 * xs;
        float* res = sums + m0 * PANEL;
        switch (rows) {
            case 4: rows_against_panel<4, C4>(xr, xs, s.panel, K, cols, res); break;
            case 3: rows_against_panel<3, C3>(xr, xs, s.panel, K, cols, res); break;
            case 2: rows_against_panel<2, C2>(xr, xs, s.panel, K, cols, res); break;
            default: rows_against_panel<1, C1>(xr, xs, s.panel, K, cols, res); break;
        }
    }
}

// what happens to a panel's raw sums: bias, the op, into out
struct Epilogue {
    const float* bias;
    int op;
    const float* other;
    int64_t other_stride;
    float* out;
    int64_t out_stride;
    int64_t M, N;

    void panel(int64_t p, const float* sums) const {
        const int64_t n0 = p * PANEL;
        const int cols = panel_cols(N, p);
        for (int64_t r = 0; r < M; ++r) {
            float* o = out + r * out_stride + n0;
            const float* oth = other ? other + r * other_stride + n0 : nullptr;
            for (int c = 0; c < cols; ++c) {
                const float v = sums[r * PANEL + c] + (bias ? bias[n0 + c] : 0.0f);
                o[c] = finish(v, op, oth ? oth[c] : 0.0f);
            }
        }
    }
};

// what the panel helper needs of a call: its x is the helper's copy, rows K apart
struct Job {
    int fmt;
    int64_t M, K, N, panels;
    const uint8_t* w;

    void sums(int64_t p, const uint8_t* xb, float* res) const {
        panel_sums(fmt, M, K, reinterpret_cast<const float*>(xb), K, w, N, p, thread_scratch(M, K), res);
    }
};

polyserve::PanelHelper<Job> helper;

}  // namespace

extern "C" {

// The panel helper (panel_helper.h) for calls made by a thread without an OpenMP team whose x
// holds up to `inputs` values (rows x K), whose panels' results up to `results` floats (rows x N,
// N rounded up to whole panels of PANEL columns), of up to `outputs` columns: started where
// inputs > 0, stopped (joined) where 0. Returns 0, or -1 where the thread could not start.
int polyserve_quant_linear_helper(int64_t inputs, int64_t results, int64_t outputs) {
    return polyserve::start_or_stop(helper, inputs * 4, results, (outputs + PANEL - 1) / PANEL);
}

// Panels whose results callers took from the panel helper, since the process started.
int64_t polyserve_quant_linear_helper_taken() { return static_cast<int64_t>(helper.taken()); }

// Tests: the panel helper sleeps `ns` after claiming each panel, as if descheduled mid-panel.
int polyserve_quant_linear_helper_pause(int64_t ns) {
    helper.pause_after_claim(ns);
    return 0;
}

// x: (M, K) float32 rows `x_stride` apart; w: N rows of K / 32 blocks; bias: N floats or null;
// out: (M, N) rows `out_stride` apart; other: (M, N) rows `other_stride` apart, read for add / mul.
// K must be a multiple of 32. Returns 0, or -1 for arguments it does not take.
// A caller whose OpenMP team is one thread shares the panels with the panel helper where it runs.
int polyserve_quant_linear(int fmt, int64_t M, int64_t K, const float* x, int64_t x_stride,
                           const uint8_t* w, int64_t N, const float* bias, float* out, int64_t out_stride,
                           int op, const float* other, int64_t other_stride) {
    if ((fmt != FMT_Q4_1 && fmt != FMT_Q8_0) || K % BLOCK != 0 || M < 0 || N < 0 ||
        op < OP_NONE || op > OP_MUL || ((op == OP_ADD || op == OP_MUL) && other == nullptr))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const Epilogue e{bias, op, other, other_stride, out, out_stride, M, N};
    const bool parallel = M * K * N >= PARALLEL_MIN_WORK;
    if (parallel && helper.running() && omp_get_max_threads() == 1 && !omp_in_parallel()) {
        const Scratch s = thread_scratch(M, K);
        const Job job{fmt, M, K, N, panels, w};
        const bool shared = helper.run(
            job, reinterpret_cast<const uint8_t*>(x), M, K * 4, x_stride * 4, M * PANEL,
            [&](int64_t p) {
                panel_sums(fmt, M, K, x, x_stride, w, N, p, s, s.sums);
                e.panel(p, s.sums);
            },
            [&](int64_t p, const float* sums) { e.panel(p, sums); });
        if (shared) return 0;
    }
#pragma omp parallel if (parallel)
    {
        const Scratch s = thread_scratch(M, K);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            panel_sums(fmt, M, K, x, x_stride, w, N, p, s, s.sums);
            e.panel(p, s.sums);
        }
    }
    return 0;
}

}  // extern "C"
