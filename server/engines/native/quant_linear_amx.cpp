// y = x @ W.T (+ b), then an activation or an elementwise op with `other`, in bf16, where W stays
// in the GGUF block format it was stored in and AMX tiles do the multiply-adds (quant_linear_amx.py).
//
// Why: on an AMX CPU a bf16 decode step of a small model costs the same at 1 row as at 16 (a tile is
// 16 rows), so its linears cost what reading their weights costs: 2 bytes a weight as bf16, 0.625
// (Q4_1) or 1.06 (Q8_0) as stored. Each 32 x 16 piece of W (32 inputs of 16 output columns) is
// dequantised into one AMX tile in bf16, with the loader's float32 rounding (w = fma(q, d, m): d * q
// is exact in float32) and then round-to-nearest-even to bf16, which is how the bf16 model's weights
// were made from the float32 ones: the tile holds exactly the bf16 model's weights.
//
// The blocks are laid out by quant_linear_amx.py for the tile (VNNI order: row p of a tile holds, for
// each of its 16 columns, inputs 2p and 2p + 1), so a tile row is one 16-byte (Q4_1) or 32-byte (Q8_0)
// load, its conversion and one 64-byte store; no transposition. Per 16 columns and 32 inputs (a
// panel of 32 columns holds, block after block, its two halves' records side by side):
//     Q4_1: 16 rows x 16 bytes of codes (byte i: code i in the low nibble, code i + 16 in the high),
//           then 16 fp16 d, then 16 fp16 m (320 bytes, 0.625 a weight)
//     Q8_0: 16 rows x 32 int8 codes, then 16 fp16 d (544 bytes)
//
// x's rows are the A tile (up to 16 rows of 32 inputs, read in place); each output is summed in one
// fixed order over the inputs, whatever the number of rows or the row's place: a row's result does
// not depend on what else is in the step. The panels are shared out over the calling thread's OpenMP
// team (torch's libgomp), as quant_linear.cpp's are.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "quant_linear_amx needs AMX-BF16 and AVX512_BF16"
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
// every record once from memory; the hardware prefetcher alone left the kernel ~7% slower)
constexpr int64_t PREFETCH = 4;
constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

int record_bytes(int fmt) { return fmt == FMT_Q4_1 ? 16 * 16 + 64 : 16 * 32 + 32; }

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

}  // namespace

extern "C" {

// Asks the kernel for the AMX tile state (Linux grants it per process); 0 when granted.
int polyserve_amx_init() {
    return static_cast<int>(syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
}

// x: (M, K) bf16 rows `x_stride` apart; w: N / 16 x K / 32 records (above); bias: N floats or null;
// out: (M, N) bf16 rows `out_stride` apart; other: (M, N) bf16 rows `other_stride` apart, read for
// add / mul. K and N must be multiples of 32. Returns 0, or -1 for arguments it does not take.
int polyserve_quant_linear_amx(int fmt, int64_t M, int64_t K, const uint16_t* x, int64_t x_stride,
                               const uint8_t* w, int64_t N, const float* bias, uint16_t* out, int64_t out_stride,
                               int op, const uint16_t* other, int64_t other_stride) {
    if ((fmt != FMT_Q4_1 && fmt != FMT_Q8_0) || K % BLOCK != 0 || N % PANEL != 0 || M < 0 || K <= 0 ||
        op < OP_NONE || op > OP_MUL || ((op == OP_ADD || op == OP_MUL) && other == nullptr))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / BLOCK, rec = record_bytes(fmt), panels = N / PANEL;
#pragma omp parallel if (M * K * N >= PARALLEL_MIN_WORK)
    {
        // a panel's B tiles for every block of its inputs, per thread, reused across calls
        static thread_local std::vector<uint16_t> storage;
        const size_t need = static_cast<size_t>(nb) * 2 * TILE_BYTES / 2 + 32;
        if (storage.size() < need) storage.resize(need);
        uint16_t* tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
        alignas(64) float res[16 * PANEL];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            // the panel's records, block by block, its two tiles' side by side: one stream
            const uint8_t* recs = w + (2 * p * nb) * rec;
            if (M <= 16) {
                // one group of rows: each block's two tiles are dequantised right before their use,
                // into one of two small buffers that stay in L1 (the other may still be loading)
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
                for (int r = 0; r < M; ++r)
                    for (int h = 0; h < 2; ++h) {
                        const int64_t c = p * PANEL + h * COLS;
                        finish(_mm512_load_ps(res + r * PANEL + h * COLS), bias ? bias + c : nullptr, op,
                               other ? other + r * other_stride + c : nullptr, out + r * out_stride + c);
                    }
                continue;
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
                const int64_t n0 = p * PANEL;
                for (int r = 0; r < rows; ++r) {
                    const int64_t row = m0 + r;
                    for (int h = 0; h < 2; ++h) {
                        const int64_t c = n0 + h * COLS;
                        finish(_mm512_load_ps(res + r * PANEL + h * COLS), bias ? bias + c : nullptr, op,
                               other ? other + row * other_stride + c : nullptr, out + row * out_stride + c);
                    }
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    return 0;
}

}  // extern "C"
