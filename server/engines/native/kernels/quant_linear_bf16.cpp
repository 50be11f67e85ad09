// y = x @ W.T (+ b), then an activation or an elementwise op with `other`, in bf16, where W stays
// in the GGUF block format it was stored in (quant_linear_bf16.py): the weight kernel's bf16 build.
//
// Why: a decode step of a small model is mostly its linears reading their weights: 2 bytes a weight
// as bf16, 0.625 (Q4_1) or 1.06 (Q8_0) as stored. Each 32 x 16 piece of W (32 inputs of 16 output
// columns) is dequantised into a tile of bf16, with the loader's float32 rounding (w = fma(q, d, m):
// d * q is exact in float32) and then round-to-nearest-even to bf16, which is how the bf16 model's
// weights were made from the float32 ones: the tile holds exactly the bf16 model's weights.
//
// The blocks are laid out by quant_linear_bf16.py in the tile's VNNI order (row p of a tile holds, for
// each of its 16 columns, inputs 2p and 2p + 1), so a tile row is one 16-byte (Q4_1) or 32-byte (Q8_0)
// load, its conversion and one 64-byte store; no transposition. Per 16 columns and 32 inputs (a
// panel of 32 columns holds, block after block, its two halves' records side by side):
//     Q4_1: 16 rows x 16 bytes of codes (byte i: code i in the low nibble, code i + 16 in the high),
//           then 16 fp16 d, then 16 fp16 m (320 bytes, 0.625 a weight)
//     Q8_0: 16 rows x 32 int8 codes, then 16 fp16 d (544 bytes)
//
// Two ways to multiply, chosen by what the compiler may use (-march=native, or a build with AMX
// turned off):
//   - AMX: the tile is an AMX B tile, x's rows the A tile (up to 16 rows of 32 inputs, read in place);
//     tdpbf16ps does the multiply-adds, which cost next to nothing beside the dequantising.
//   - AVX512_BF16 without AMX: the tile stays in L1 and vdpbf16ps adds one input pair of one row to
//     the row's 16 sums of a tile, in pair order. A block's sums start from zero and are then added
//     to the row's running sums, block after block.
// Either way each output is summed in one fixed order over the inputs whatever the number of rows
// or the row's place: a row's result does not depend on what else is in the step. The two ways
// differ in that order, so in the last bits of a float32 sum before its rounding to bf16. The panels
// are shared out over the calling thread's OpenMP team (torch's libgomp), as quant_linear.cpp's are.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_helper.h"

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "quant_linear_bf16 needs AVX512_BF16"
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define POLYSERVE_AMX 1
#endif

namespace {

constexpr int FMT_Q4_1 = 0;
constexpr int FMT_Q8_0 = 1;
constexpr int BLOCK = 32;
constexpr int COLS = 16;                  // output columns of one tile
constexpr int PANEL = 2 * COLS;           // output columns a thread dequantises together (two C tiles)
constexpr int TILE_BYTES = 16 * 64;       // one B tile: 16 rows of 64 bytes
constexpr int OP_NONE = 0, OP_SILU = 1, OP_ADD = 2, OP_MUL = 3;
constexpr int64_t PARALLEL_MIN_WORK = 1 << 18;
// blocks ahead whose records are fetched into L1 while a block is multiplied (a decode step streams
// every record once from memory; fetching ahead helped a little over the hardware prefetcher alone:
// docs/history/weight-kernel.md, "A bf16 build on AMX")
constexpr int64_t PREFETCH = 4;

int record_bytes(int fmt) { return fmt == FMT_Q4_1 ? 16 * 16 + 64 : 16 * 32 + 32; }

// a 64-byte aligned view of at least `n` T in a thread's reusable scratch bytes
template <class T>
T* scratch(std::vector<uint8_t>& bytes, size_t n) {
    if (bytes.size() < n * sizeof(T) + 64) bytes.resize(n * sizeof(T) + 64);
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t(63));
}

#ifdef POLYSERVE_AMX
constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0, 1: C (rows x 16 float32); 2: A (rows of x, 32 bf16); 3, 4: B (one per 16 columns)
void configure(int rows) {
    TileConfig cfg;
    for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = static_cast<uint8_t>(rows);
    cfg.rows[3] = cfg.rows[4] = 16;
    _tile_loadconfig(&cfg);
}
#endif

inline __m512 halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// one 32-input x 16-column piece of W into a B tile (16 rows of 32 bf16)
void dequant_tile(int fmt, const uint8_t* rec, uint16_t* tile) {
    // the columns' scales in pair order: element 2c + j is column c's, for each half of the columns
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    if (fmt == FMT_Q4_1) {
        const __m512 d = halves(rec + 256), m = halves(rec + 288);
        const __m512 dlo = _mm512_permutexvar_ps(lo_idx, d), dhi = _mm512_permutexvar_ps(hi_idx, d);
        const __m512 mlo = _mm512_permutexvar_ps(lo_idx, m), mhi = _mm512_permutexvar_ps(hi_idx, m);
        const __m128i mask = _mm_set1_epi8(0x0F);
        for (int p = 0; p < 16; ++p) {
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * p));
            const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            const __m512 wlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), dlo, mlo);
            const __m512 whi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), dhi, mhi);
            _mm512_store_si512(tile + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
        }
    } else {
        const __m512 d = halves(rec + 512);
        const __m512 dlo = _mm512_permutexvar_ps(lo_idx, d), dhi = _mm512_permutexvar_ps(hi_idx, d);
        for (int p = 0; p < 16; ++p) {
            const uint8_t* q = rec + 32 * p;
            const __m512 wlo = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), dlo);
            const __m512 whi = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), dhi);
            _mm512_store_si512(tile + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
        }
    }
}

inline __m512 bf16_to_float(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// e^v for float32, |relative error| < 2 ulp over the range silu needs (Cody-Waite reduction by ln 2,
// a degree-6 polynomial, scaled by 2^n); inputs below -87 give 0, above 88 give +inf
inline __m512 exp_ps(__m512 v) {
    v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

// 16 float32 results of one row: + bias, the op, rounded to bf16 into out
inline void finish(__m512 v, const float* bias, int op, const uint16_t* other, uint16_t* out) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    if (op == OP_SILU) v = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    else if (op == OP_ADD) v = _mm512_add_ps(v, bf16_to_float(other));
    else if (op == OP_MUL) v = _mm512_mul_ps(v, bf16_to_float(other));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}

// what happens to a row's PANEL float32 sums: bias, the op, rounded to bf16 into out
struct Epilogue {
    const float* bias;
    int op;
    const uint16_t* other;
    int64_t other_stride;
    uint16_t* out;
    int64_t out_stride;
    float* raw;  // instead: the row's raw sums, PANEL floats a row (the panel helper's results)

    void row(int64_t r, const float* sums, int64_t c0) const {
        if (raw) {
            if (raw + r * PANEL != sums) std::memcpy(raw + r * PANEL, sums, sizeof(float) * PANEL);
            return;
        }
        for (int h = 0; h < 2; ++h) {
            const int64_t c = c0 + h * COLS;
            finish(_mm512_load_ps(sums + h * COLS), bias ? bias + c : nullptr, op,
                   other ? other + r * other_stride + c : nullptr, out + r * out_stride + c);
        }
    }
};

#ifndef POLYSERVE_AMX
// rows whose sums stay in registers over a block: 2 tiles x 8 rows, beside the weights and x
constexpr int GROUP = 8;

// R rows of x against one block's two tiles t (32 inputs x 32 columns), added to their running sums
// (R rows of PANEL floats)
template <int R>
inline void block_rows(const uint16_t* t, const uint16_t* x, int64_t x_stride, float* sums) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_load_si512(t + 32 * p);
        const __m512bh w1 = (__m512bh)_mm512_load_si512(t + TILE_BYTES / 2 + 32 * p);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * x_stride + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
            float* s = sums + r * PANEL + h * COLS;
            _mm512_store_ps(s, _mm512_add_ps(_mm512_load_ps(s), acc[r][h]));
        }
}

using BlockRows = void (*)(const uint16_t*, const uint16_t*, int64_t, float*);
constexpr BlockRows BLOCK_ROWS[GROUP + 1] = {nullptr, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                            block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};

// out[:, columns of panel p] for every row: each block's two tiles dequantised once into L1, then
// every group of rows against them
void panel_dot(int fmt, int64_t M, const uint16_t* x, int64_t x_stride, const uint8_t* recs, int64_t nb,
               int64_t rec, uint16_t* tiles, float* sums, const Epilogue& e, int64_t c0) {
    std::memset(sums, 0, sizeof(float) * M * PANEL);
    for (int64_t b = 0; b < nb; ++b) {
        if (b + PREFETCH < nb)
            for (int64_t off = 0; off < 2 * rec; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(recs + 2 * (b + PREFETCH) * rec + off), _MM_HINT_T0);
        uint16_t* t = tiles + (b & 1) * TILE_BYTES;  // two buffers: the other may still be in use
        dequant_tile(fmt, recs + 2 * b * rec, t);
        dequant_tile(fmt, recs + (2 * b + 1) * rec, t + TILE_BYTES / 2);
        for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
            const int rows = static_cast<int>(M - m0 < GROUP ? M - m0 : GROUP);
            BLOCK_ROWS[rows](t, x + m0 * x_stride + b * BLOCK, x_stride, sums + m0 * PANEL);
        }
    }
    for (int64_t r = 0; r < M; ++r) e.row(r, sums + r * PANEL, c0);
}
#else
// out[:, columns of panel p] for every row, on AMX tiles. Up to 16 rows (one A tile): each block's
// two B tiles dequantised right before their use into one of two small buffers that stay in L1 (the
// other may still be loading). More: the whole panel's tiles first, then each group of 16 rows.
void panel_amx(int fmt, int64_t M, const uint16_t* x, int64_t x_stride, const uint8_t* recs, int64_t nb,
               int64_t rec, uint16_t* tiles, float* res, int& configured, const Epilogue& e, int64_t c0) {
    if (M <= 16) {
        if (static_cast<int>(M) != configured) {
            configure(static_cast<int>(M));
            configured = static_cast<int>(M);
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t b = 0; b < nb; ++b) {
            uint16_t* t = tiles + (b & 1) * TILE_BYTES;
            if (b + PREFETCH < nb)
                for (int64_t off = 0; off < 2 * rec; off += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(recs + 2 * (b + PREFETCH) * rec + off), _MM_HINT_T0);
            dequant_tile(fmt, recs + 2 * b * rec, t);
            dequant_tile(fmt, recs + (2 * b + 1) * rec, t + TILE_BYTES / 2);
            _tile_loadd(2, x + b * BLOCK, x_stride * 2);
            _tile_loadd(3, t, 64);
            _tile_loadd(4, t + TILE_BYTES / 2, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, res, PANEL * 4);
        _tile_stored(1, res + COLS, PANEL * 4);
        for (int64_t r = 0; r < M; ++r) e.row(r, res + r * PANEL, c0);
        return;
    }
    for (int64_t b = 0; b < nb; ++b) {
        dequant_tile(fmt, recs + 2 * b * rec, tiles + (2 * b) * (TILE_BYTES / 2));
        dequant_tile(fmt, recs + (2 * b + 1) * rec, tiles + (2 * b + 1) * (TILE_BYTES / 2));
    }
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int rows = static_cast<int>(M - m0 < 16 ? M - m0 : 16);
        if (rows != configured) {
            configure(rows);
            configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t* xr = x + m0 * x_stride;
        for (int64_t b = 0; b < nb; ++b) {
            _tile_loadd(2, xr + b * BLOCK, x_stride * 2);
            _tile_loadd(3, tiles + (2 * b) * (TILE_BYTES / 2), 64);
            _tile_loadd(4, tiles + (2 * b + 1) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, res, PANEL * 4);
        _tile_stored(1, res + COLS, PANEL * 4);
        for (int r = 0; r < rows; ++r) e.row(m0 + r, res + r * PANEL, c0);
    }
}
#endif
// one thread's reusable buffers for its panels
struct Scratch {
    uint16_t* tiles;
    float* sums;
    int configured;  // the AMX tile configuration's rows (-1: none yet)
};

Scratch thread_scratch(int64_t M, int64_t nb) {
    static thread_local std::vector<uint8_t> tile_bytes, sum_bytes;
#ifdef POLYSERVE_AMX
    // a panel's B tiles for every block of its inputs (more than 16 rows), or two blocks'
    return {scratch<uint16_t>(tile_bytes, static_cast<size_t>(nb > 2 ? nb : 2) * TILE_BYTES),
            scratch<float>(sum_bytes, 16 * PANEL), -1};
#else
    (void)nb;
    return {scratch<uint16_t>(tile_bytes, 2 * TILE_BYTES), scratch<float>(sum_bytes, static_cast<size_t>(M) * PANEL),
            -1};
#endif
}

// panel p of the call (its 32 columns for every row) through the epilogue; `sums`, where given,
// replaces the scratch's (the dot path sums in place)
void panel(int fmt, int64_t M, const uint16_t* x, int64_t x_stride, const uint8_t* w, int64_t nb, int64_t rec,
           int64_t p, const Epilogue& e, Scratch& s, float* sums = nullptr) {
    // the panel's records, block by block, its two tiles' side by side: one stream
    const uint8_t* recs = w + (2 * p * nb) * rec;
#ifdef POLYSERVE_AMX
    (void)sums;
    panel_amx(fmt, M, x, x_stride, recs, nb, rec, s.tiles, s.sums, s.configured, e, p * PANEL);
#else
    panel_dot(fmt, M, x, x_stride, recs, nb, rec, s.tiles, sums ? sums : s.sums, e, p * PANEL);
#endif
}

// what the panel helper needs of a call: its x is the helper's copy, rows K apart
struct Job {
    int fmt;
    int64_t M, nb, rec, panels;
    const uint8_t* w;

    void sums(int64_t p, const uint8_t* xb, float* res) const {
        static thread_local int configured = -1;  // the helper thread keeps its tile configuration
        Scratch s = thread_scratch(M, nb);
        s.configured = configured;
        const Epilogue raw{nullptr, OP_NONE, nullptr, 0, nullptr, 0, res};
        panel(fmt, M, reinterpret_cast<const uint16_t*>(xb), nb * BLOCK, w, nb, rec, p, raw, s, res);
        configured = s.configured;
    }
};

polyserve::PanelHelper<Job> helper;
}  // namespace

extern "C" {

// Asks Linux for the AMX tile state (granted per process) where this build uses AMX tiles; 0 when
// granted or not needed.
int polyserve_bf16_init() {
#ifdef POLYSERVE_AMX
    return static_cast<int>(syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
#else
    return 0;
#endif
}

// 1 where this build multiplies on AMX tiles, 0 where on AVX512_BF16 dot products.
int polyserve_bf16_uses_amx() {
#ifdef POLYSERVE_AMX
    return 1;
#else
    return 0;
#endif
}

// The panel helper (panel_helper.h) for calls made by a thread without an OpenMP team whose x
// holds up to `inputs` values (rows x K), whose outputs up to `results` (rows x N), of up to
// `outputs` columns: started where inputs > 0, stopped (joined) where 0. Returns 0, or -1 where
// the thread could not start.
int polyserve_bf16_helper(int64_t inputs, int64_t results, int64_t outputs) {
    return polyserve::start_or_stop(helper, inputs * 2, results, outputs / PANEL);
}

// Panels whose results callers took from the panel helper, since the process started.
int64_t polyserve_bf16_helper_taken() { return static_cast<int64_t>(helper.taken()); }

// Tests: the panel helper sleeps `ns` after claiming each panel, as if descheduled mid-panel.
int polyserve_bf16_helper_pause(int64_t ns) {
    helper.pause_after_claim(ns);
    return 0;
}

// x: (M, K) bf16 rows `x_stride` apart; w: N / 16 x K / 32 records (above); bias: N floats or null;
// out: (M, N) bf16 rows `out_stride` apart; other: (M, N) bf16 rows `other_stride` apart, read for
// add / mul. K and N must be multiples of 32. Returns 0, or -1 for arguments it does not take.
// A caller whose OpenMP team is one thread shares the panels with the panel helper where it runs.
int polyserve_quant_linear_bf16(int fmt, int64_t M, int64_t K, const uint16_t* x, int64_t x_stride,
                                const uint8_t* w, int64_t N, const float* bias, uint16_t* out, int64_t out_stride,
                                int op, const uint16_t* other, int64_t other_stride) {
    if ((fmt != FMT_Q4_1 && fmt != FMT_Q8_0) || K % BLOCK != 0 || N % PANEL != 0 || M < 0 || K <= 0 ||
        op < OP_NONE || op > OP_MUL || ((op == OP_ADD || op == OP_MUL) && other == nullptr))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / BLOCK, rec = record_bytes(fmt), panels = N / PANEL;
    const Epilogue e{bias, op, other, other_stride, out, out_stride, nullptr};
    const bool parallel = M * K * N >= PARALLEL_MIN_WORK;
    if (parallel && helper.running() && omp_get_max_threads() == 1 && !omp_in_parallel()) {
        Scratch s = thread_scratch(M, nb);
        const Job job{fmt, M, nb, rec, panels, w};
        const bool shared = helper.run(
            job, reinterpret_cast<const uint8_t*>(x), M, K * 2, x_stride * 2, M * PANEL,
            [&](int64_t p) { panel(fmt, M, x, x_stride, w, nb, rec, p, e, s); },
            [&](int64_t p, const float* sums) {
                for (int64_t r = 0; r < M; ++r) e.row(r, sums + r * PANEL, p * PANEL);
            });
#ifdef POLYSERVE_AMX
        if (s.configured >= 0) _tile_release();
#endif
        if (shared) return 0;
    }
#pragma omp parallel if (parallel)
    {
        Scratch s = thread_scratch(M, nb);  // per thread, reused across calls
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) panel(fmt, M, x, x_stride, w, nb, rec, p, e, s);
#ifdef POLYSERVE_AMX
        if (s.configured >= 0) _tile_release();
#endif
    }
    return 0;
}

}  // extern "C"
