// Attention of a step's decode rows over their own KV slots, one call per layer (attention_kernel.py).
//
//   for each row i < n, kv head g < kvh, query head r < rep (query head h = g * rep + r):
//       s[j]          = scale * q[i, h] . K[slot[i], g, j]        for j < len[i]
//       out[i, h, :]  = sum_j softmax(s)[j] * V[slot[i], g, j, :]
//
// Each row's new key and value can be written at its last position by the same call (one pass
// instead of two indexed copies). Each row reads only its own slot's first len[i] positions, in place: no gather of the slots
// into a batch, no padding to the longest row, no mask. The rep query heads that share a kv head
// are done together, so K and V are read once per kv head. Scores, softmax and sums run in
// float32 whatever the storage (float32 or bfloat16, per tensor); a bfloat16 `out` is rounded to
// nearest even once. A row's result does not depend on the other rows of the batch.
// The (row, kv head) pairs are shared out over the calling thread's OpenMP team (torch's libgomp,
// as in lora_rows.cpp): one parallel region per layer.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_REP = 16;
constexpr int64_t MAX_HD = 256;

using polyserve_bf16::cvt;

inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float f) { *p = polyserve_bf16::to_bf16(f); }

// e^x for x <= 0 (a score less the row's best) without a libm call: x = n ln2 + f with |f| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^f by Cephes'
// expf polynomial (relative error ~1e-7), 2^n through the exponent bits. Below -87, e^x is
// under float's smallest normal: 1.6e-38 instead, nothing against a total of at least 1.
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    const float y = p * f * f + f + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// HD: the head dim when known at compile time (the inner loops unroll and vectorise), 0: hd_.
template <int HD, typename KV, typename Q, typename O>
void one_head(const Q* q, const KV* K, const KV* V, int64_t len, int64_t stride_pos, int64_t rep,
              int64_t hd_, float scale, O* out, std::vector<float>& scores) {
    const int64_t hd = HD ? HD : hd_;
    float qf[MAX_REP][MAX_HD];
    for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < hd; ++d) qf[r][d] = cvt(q[r * hd + d]) * scale;
    scores.resize(static_cast<size_t>(len * rep));
    float* s = scores.data();  // s[r * len + j]
    float best[MAX_REP];
    for (int64_t r = 0; r < rep; ++r) best[r] = -INFINITY;
    for (int64_t j = 0; j < len; ++j) {
        const KV* k = K + j * stride_pos;
        float kf[MAX_HD];
        for (int64_t d = 0; d < hd; ++d) kf[d] = cvt(k[d]);
        for (int64_t r = 0; r < rep; ++r) {
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < hd; ++d) acc += qf[r][d] * kf[d];
            s[r * len + j] = acc;
            best[r] = acc > best[r] ? acc : best[r];
        }
    }
    float total[MAX_REP] = {};
    for (int64_t r = 0; r < rep; ++r) {
        float* sr = s + r * len;
        const float m = best[r];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) {
            const float e = exp_nonpositive(sr[j] - m);
            sr[j] = e;
            sum += e;
        }
        total[r] = sum;
    }
    float acc[MAX_REP][MAX_HD] = {};
    for (int64_t j = 0; j < len; ++j) {
        const KV* v = V + j * stride_pos;
        float vf[MAX_HD];
        for (int64_t d = 0; d < hd; ++d) vf[d] = cvt(v[d]);
        for (int64_t r = 0; r < rep; ++r) {
            const float p = s[r * len + j];
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) acc[r][d] += p * vf[d];
        }
    }
    for (int64_t r = 0; r < rep; ++r) {
        const float inv = 1.f / total[r];  // total >= 1: the best position contributes exp(0)
        for (int64_t d = 0; d < hd; ++d) store(out + r * hd + d, acc[r][d] * inv);
    }
}

#if defined(__AVX512F__)
// The common case by hand with AVX-512: head dim 64, a bfloat16 cache. The generic loop above
// spends most of its time summing each score's 16 lanes (a shuffle chain per position and query
// head); here the 16 positions of a block are summed together by a transpose-and-add tree (a
// few shuffles per position), e^x runs 16 lanes at a time, and each K and V row is converted once
// for all the query heads that share it.
inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// v[k] holds the 16 partial sums of position TREE[k] of the block: lane i of the result is the sum
// of position i (the tree leaves lane 4a + b holding its input 4b + a; TREE is that transpose).
constexpr int TREE[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline __m512 sum16(const __m512* v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

inline __m512 exp16_nonpositive(__m512 x) {  // exp_nonpositive, 16 lanes
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                          _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, f), f, f), _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

template <typename Q, typename O>
void head64_bf16(const Q* q, const uint16_t* K, const uint16_t* V, int64_t len, int64_t stride_pos, int64_t rep,
                 float scale, O* out, std::vector<float>& scores) {
    const int64_t padded = (len + 15) / 16 * 16;
    scores.resize(static_cast<size_t>(rep * padded));
    float* s = scores.data();  // s[r * padded + j]
    __m512 qv[MAX_REP][4];
    for (int64_t r = 0; r < rep; ++r)
        for (int c = 0; c < 4; ++c) qv[r][c] = _mm512_mul_ps(load16(q + r * 64 + 16 * c), _mm512_set1_ps(scale));
    __m512 best[MAX_REP];
    for (int64_t r = 0; r < rep; ++r) best[r] = _mm512_set1_ps(-INFINITY);
    __m512 part[MAX_REP][16];
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t nb = len - j0 < 16 ? len - j0 : 16;
        for (int64_t jj = 0; jj < 16; ++jj) {
            const int slot = TREE[jj];
            if (jj >= nb) {
                for (int64_t r = 0; r < rep; ++r) part[r][slot] = _mm512_setzero_ps();
                continue;
            }
            const uint16_t* k = K + (j0 + jj) * stride_pos;
            const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
            for (int64_t r = 0; r < rep; ++r) {
                __m512 acc = _mm512_mul_ps(qv[r][0], k0);
                acc = _mm512_fmadd_ps(qv[r][1], k1, acc);
                acc = _mm512_fmadd_ps(qv[r][2], k2, acc);
                part[r][slot] = _mm512_fmadd_ps(qv[r][3], k3, acc);
            }
        }
        const __mmask16 valid = static_cast<__mmask16>(nb == 16 ? 0xFFFF : (1u << nb) - 1);
        for (int64_t r = 0; r < rep; ++r) {
            const __m512 sums = sum16(part[r]);
            _mm512_storeu_ps(s + r * padded + j0, sums);
            best[r] = _mm512_mask_max_ps(best[r], valid, best[r], sums);
        }
    }
    float total[MAX_REP];
    for (int64_t r = 0; r < rep; ++r) {
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(best[r]));
        __m512 sum = _mm512_setzero_ps();
        float* sr = s + r * padded;
        for (int64_t j0 = 0; j0 < len; j0 += 16) {
            const __mmask16 valid = static_cast<__mmask16>(len - j0 >= 16 ? 0xFFFF : (1u << (len - j0)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j0), m)));
            _mm512_storeu_ps(sr + j0, e);
            sum = _mm512_add_ps(sum, e);
        }
        total[r] = _mm512_reduce_add_ps(sum);
    }
    __m512 acc[MAX_REP][4];
    for (int64_t r = 0; r < rep; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
        const uint16_t* v = V + j * stride_pos;
        const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
        for (int64_t r = 0; r < rep; ++r) {
            const __m512 p = _mm512_set1_ps(s[r * padded + j]);
            acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
        }
    }
    for (int64_t r = 0; r < rep; ++r) {
        alignas(64) float row[64];
        const __m512 inv = _mm512_set1_ps(1.f / total[r]);
        for (int c = 0; c < 4; ++c) _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[r][c], inv));
        for (int d = 0; d < 64; ++d) store(out + r * 64 + d, row[d]);
    }
}
#endif

template <typename KV, typename Q, typename O>
void run(int64_t n, const Q* q, int64_t q_stride, KV* K, KV* V, const int64_t* slot, const int64_t* len,
         int64_t stride_slot, int64_t stride_head, int64_t stride_pos, int64_t kvh, int64_t rep, int64_t hd,
         float scale, O* out, const KV* k_new, const KV* v_new, int64_t k_stride, int64_t v_stride) {
    const int64_t tasks = n * kvh;
#pragma omp parallel if (tasks > 1)
    {
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t i = t / kvh, g = t % kvh;
            const int64_t head0 = (i * kvh + g) * rep * hd;  // out: (n, kvh, rep, hd) contiguous
            const int64_t base = slot[i] * stride_slot + g * stride_head;
            if (k_new != nullptr) {  // this row's new position first: its last
                const int64_t last = base + (len[i] - 1) * stride_pos;
                std::memcpy(K + last, k_new + i * k_stride + g * hd, static_cast<size_t>(hd) * sizeof(KV));
                std::memcpy(V + last, v_new + i * v_stride + g * hd, static_cast<size_t>(hd) * sizeof(KV));
            }
            const Q* qi = q + i * q_stride + g * rep * hd;
#if defined(__AVX512F__)
            if constexpr (std::is_same_v<KV, uint16_t>) {
                if (hd == 64) {
                    head64_bf16(qi, K + base, V + base, len[i], stride_pos, rep, scale, out + head0, scores);
                    continue;
                }
            }
#endif
            if (hd == 64)
                one_head<64>(qi, K + base, V + base, len[i], stride_pos, rep, hd, scale, out + head0, scores);
            else if (hd == 128)
                one_head<128>(qi, K + base, V + base, len[i], stride_pos, rep, hd, scale, out + head0, scores);
            else
                one_head<0>(qi, K + base, V + base, len[i], stride_pos, rep, hd, scale, out + head0, scores);
        }
    }
}

}  // namespace

// Returns 0, or 1 when a shape is outside what the kernel takes (the caller checks first).
// kv_bf16 / q_bf16 / out_bf16: 1 = bfloat16, 0 = float32. q: (n, heads, hd) rows `q_stride`
// elements apart. K and V share their strides (in elements; the last dim is contiguous). len[i] >= 1
// for every row. k_new, v_new (or null): each row's new key and value, (n, kvh, hd) rows `k_stride`,
// `v_stride` apart in the cache's dtype, written at the row's position len[i] - 1 before it is read.
extern "C" int polyserve_decode_attention(int64_t n, const void* q, int64_t q_stride, int q_bf16, void* K, void* V,
                                          int kv_bf16, const int64_t* slot, const int64_t* len,
                                          int64_t stride_slot, int64_t stride_head, int64_t stride_pos,
                                          int64_t kvh, int64_t rep, int64_t hd, float scale, void* out,
                                          int out_bf16, const void* k_new, const void* v_new, int64_t k_stride,
                                          int64_t v_stride) {
    if (rep < 1 || rep > MAX_REP || hd < 1 || hd > MAX_HD || q_bf16 != out_bf16 || q_stride < kvh * rep * hd
        || (k_new != nullptr) != (v_new != nullptr) || (k_new != nullptr && (k_stride < kvh * hd || v_stride < kvh * hd)))
        return 1;
    for (int64_t i = 0; i < n; ++i)
        if (len[i] < 1) return 1;
    if (kv_bf16 && q_bf16)
        run(n, static_cast<const uint16_t*>(q), q_stride, static_cast<uint16_t*>(K), static_cast<uint16_t*>(V),
            slot, len, stride_slot, stride_head, stride_pos, kvh, rep, hd, scale, static_cast<uint16_t*>(out),
            static_cast<const uint16_t*>(k_new), static_cast<const uint16_t*>(v_new), k_stride, v_stride);
    else if (kv_bf16)
        run(n, static_cast<const float*>(q), q_stride, static_cast<uint16_t*>(K), static_cast<uint16_t*>(V),
            slot, len, stride_slot, stride_head, stride_pos, kvh, rep, hd, scale, static_cast<float*>(out),
            static_cast<const uint16_t*>(k_new), static_cast<const uint16_t*>(v_new), k_stride, v_stride);
    else if (q_bf16)
        run(n, static_cast<const uint16_t*>(q), q_stride, static_cast<float*>(K), static_cast<float*>(V),
            slot, len, stride_slot, stride_head, stride_pos, kvh, rep, hd, scale, static_cast<uint16_t*>(out),
            static_cast<const float*>(k_new), static_cast<const float*>(v_new), k_stride, v_stride);
    else
        run(n, static_cast<const float*>(q), q_stride, static_cast<float*>(K), static_cast<float*>(V),
            slot, len, stride_slot, stride_head, stride_pos, kvh, rep, hd, scale, static_cast<float*>(out),
            static_cast<const float*>(k_new), static_cast<const float*>(v_new), k_stride, v_stride);
    return 0;
}
