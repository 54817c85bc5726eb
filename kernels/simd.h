// The vector ops the CPU kernels (sweep.h, cpu_decode.cpp) are written in, for two instruction sets chosen at
// compile time: AVX-512F (16 fp32 lanes, mask registers) when the build has -mavx512f, else AVX2 + FMA (8 lanes,
// masks as integer vectors; -mavx2 -mfma). kernels/cpp_build.simd_cflags picks the flags from the CPU torch
// detects. Lane-wise results are the same bits on both (the same FMAs in the same order per lane; the exponential's
// 2^n scaling is exact or rounds once either way); horizontal sums (reduce_add) add in a different order.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace expertspec::simd {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;
using vf = __m512;
using vmask = __mmask16;
constexpr const char* kIsa = "AVX-512";

inline vmask first(int64_t n) { return n >= 16 ? (vmask)0xFFFF : (vmask)((1u << n) - 1u); }  // lanes [0, n)
inline vmask all() { return (vmask)0xFFFF; }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float a) { return _mm512_set1_ps(a); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // 0 in the masked-off lanes
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(vmask m, float* p, vf v) { _mm512_mask_storeu_ps(p, m, v); }
inline vf keep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }  // v, 0 in the masked-off lanes
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
#else
#if !defined(__AVX2__) || !defined(__FMA__)
#error "kernels/simd.h needs -mavx512f, or -mavx2 -mfma"
#endif
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
using vf = __m256;
using vmask = __m256i;
constexpr const char* kIsa = "AVX2";

inline vmask first(int64_t n) {  // lanes [0, n): all bits set where lane < n
  const int32_t k = static_cast<int32_t>(n >= 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vmask all() { return _mm256_set1_epi32(-1); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float a) { return _mm256_set1_ps(a); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(vmask m, const float* p) { return _mm256_maskload_ps(p, m); }  // masked-off lanes 0, never read
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void store(vmask m, float* p, vf v) { _mm256_maskstore_ps(p, m, v); }
inline vf keep(vmask m, vf v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n for integral n in [-254, 254] as two exact power-of-two factors, so at most the second product rounds (into
// the subnormals or to 0 / inf), as vscalefps's single rounding does
inline vf scale2(vf p, vf n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const vf b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
inline float reduce_add(vf v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// A whole vector (Part false: plain load / store) or the first lanes of a loop's last, partial one (mask m). Whole
// vectors never take the masked forms: AVX2's masked store is microcoded on AMD CPUs and a load of what it just
// stored waits for it to retire (measured on Zen 3: the sweep at ~1 GB/s with every store masked).
template <bool Part>
inline vf load_part(vmask m, const float* p) {
  if constexpr (Part) return load(m, p);
  else return load(p);
}
template <bool Part>
inline void store_part(vmask m, float* p, vf v) {
  if constexpr (Part) store(m, p, v);
  else store(p, v);
}
using Whole = std::false_type;  // tags for a generic lambda's `part` argument
using Partial = std::true_type;

}  // namespace expertspec::simd
