// The small-M sweep shared by small_m.cpp and cpu_decode.cpp (AVX-512F or AVX2 + FMA: kernels/simd.h):
//
//   sweep<M>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1):  y[m, n0:n1] = bias[n0:n1] (or 0) + sum_k x[m, k] wt[k, n0:n1]
//
// for M <= 16 token rows x [M, K] (row stride ldx) and an input-major weight wt [K, N] (row stride ldw): the weight
// rows are swept in memory order, U at a time, once for all M rows, and every output accumulates over k in order
// with one FMA each, so a row's result has the same bits whatever M and U are (batch-invariant). U weight vectors
// stay in registers while each row's accumulator is loaded, updated U times and stored: the accumulator traffic
// through the cache is 1/U of the FMAs. U (measured, cold weights of the benchmark shapes, README): 1 for one or two
// rows whose accumulators fit in 10 KB (M N <= 2560 floats) — each weight row then streams whole, in address order,
// 1.1-1.9x faster than U = 8 / 16 there —, else 8 (one row: a wide LM head; more rows: see kWideU, kWideC).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace expertspec {

constexpr int64_t kLanes = simd::kLanes;
// U and C (adjacent columns per pass) for M >= 2 beyond the row-streaming case: AVX-512 8 x 2 (16 weight vectors
// live, each broadcast of x feeding two FMAs: 1.0-1.2x the 16 x 1 sweep per matrix, forward 1.00-1.035x at n >= 8,
// README), AVX2 8 x 1 (16 registers)
constexpr int kWideU = 8;
constexpr int kWideC = simd::kRegisters >= 32 ? 2 : 1;
constexpr int kOneRowU = 8;  // U for one row
constexpr int64_t kMaxBlock = 16;  // rows per sweep

constexpr int64_t kRowStreamFloats = 2560;  // M N at most for U = 1 (M <= 2)

// C adjacent columns from n (C whole vectors, or one partial last vector when P): y[:, n...] += x[:, k:k+U]
// wt[k:k+U, n...]. The C U weight vectors stay in registers while each row's C accumulators are loaded, updated U
// times and stored; each x[m, k + u] is broadcast once for the C columns.
template <int M, int U, int C, bool P>
inline void sweep_column(const float* __restrict x, int64_t ldx, const float* __restrict w0, int64_t ldw, int64_t k,
                         float* __restrict y, int64_t ldy, int64_t n, simd::vmask tail) {
  simd::vf wv[C][U];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) wv[c][u] = simd::load_part<P>(tail, w0 + u * ldw + n + c * kLanes);
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    simd::vf acc[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] = simd::load_part<P>(tail, y + m * ldy + n + c * kLanes);
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const simd::vf b = simd::set1(x[m * ldx + k + u]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[c] = simd::fmadd(b, wv[c][u], acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) simd::store_part<P>(tail, y + m * ldy + n + c * kLanes, acc[c]);
  }
}

// U weight rows from k over columns [n0, n1): C whole columns at a time, then single ones, then the partial last
template <int M, int U, int C>
inline void sweep_rows_k(const float* __restrict x, int64_t ldx, const float* __restrict w0, int64_t ldw, int64_t k,
                         float* __restrict y, int64_t ldy, int64_t n0, int64_t full, int64_t n1, simd::vmask tail) {
  int64_t n = n0;
  if constexpr (C > 1) {
    for (; n + C * kLanes <= full; n += C * kLanes) sweep_column<M, U, C, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
  }
  for (; n < full; n += kLanes) sweep_column<M, U, 1, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
  if (full < n1) sweep_column<M, U, 1, true>(x, ldx, w0, ldw, k, y, ldy, full, tail);
}

template <int M, int U, int C = 1>
inline void sweep_u(const float* __restrict x, int64_t ldx, const float* __restrict wt, int64_t ldw, int64_t K,
                    const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t full = n0 + (n1 - n0) / kLanes * kLanes;  // [n0, full) whole vectors, [full, n1) one partial
  const simd::vmask tail = simd::first(n1 - full);
  for (int64_t n = n0; n < n1; n += kLanes) {  // start from the bias
    const simd::vmask mk = n < full ? simd::all() : tail;
    const simd::vf b = bias ? simd::load(mk, bias + n) : simd::zero();
    for (int m = 0; m < M; ++m) simd::store(mk, y + m * ldy + n, b);
  }
  int64_t k = 0;
  for (; k + U <= K; k += U) sweep_rows_k<M, U, C>(x, ldx, wt + k * ldw, ldw, k, y, ldy, n0, full, n1, tail);
  for (; k < K; ++k) sweep_rows_k<M, 1, 1>(x, ldx, wt + k * ldw, ldw, k, y, ldy, n0, full, n1, tail);  // K's rest
}

// AVX2 builds: accumulator rows whose stride is a multiple of 1 KB share a few L1 sets (4 KB aliasing) and evict
// each other from 4 rows on; they are swept in a scratch whose rows are a cache line apart, then copied out (Zen 3,
// [512, 2048] weight cold: 12 / 16 rows 1.1 -> 3.8-5.0 GB/s). AVX-512 builds keep sweeping in place (measured
// there without this; not re-measured with it).
constexpr bool kPadAliasedRows = simd::kRegisters < 32;

template <int M>
inline void sweep(const float* __restrict x, int64_t ldx, const float* __restrict wt, int64_t ldw, int64_t K,
                  const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t n0, int64_t n1) {
  if (M <= 2 && M * (n1 - n0) <= kRowStreamFloats) {
    sweep_u<M, 1>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1);
    return;
  }
  constexpr int U = M == 1 ? kOneRowU : kWideU;
  constexpr int C = M == 1 ? 1 : kWideC;
  if (!(kPadAliasedRows && M >= 4 && ldy % 256 == 0)) {
    sweep_u<M, U, C>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1);
    return;
  }
  thread_local std::vector<float> scratch;
  const int64_t width = n1 - n0, lds = (width + 15) / 16 * 16 + 16;  // rows 64 B off the 1 KB grid
  if (static_cast<int64_t>(scratch.size()) < M * lds) scratch.resize(M * lds);
  sweep_u<M, U, C>(x, ldx, wt, ldw, K, bias ? bias + n0 : nullptr, scratch.data(), lds, 0, width);
  for (int m = 0; m < M; ++m) std::copy_n(scratch.data() + m * lds, width, y + m * ldy + n0);
}

// ---- the strip-packed weight ("strips": kernels/small_m.pack) -------------------------------------------------
//
//   W [N, K] (out, in)  ->  P [ceil(N / S), K, S]:   P[s, k, j] = W[s S + j, k]  (0 past N),   S = kStrip
//
//      strip 0           strip 1                    each strip: K rows of S floats, contiguous, so a pass over
//   k=0 |W[0:S, 0]  |  k=0 |W[S:2S, 0]|  ...         all k reads memory in address order (the hardware prefetcher
//   k=1 |W[0:S, 1]  |  k=1 |W[S:2S, 1]|               streams it), while the strip's outputs stay in registers:
//   ...                                               no accumulator traffic through the cache at all.
//
// Input-major [K, N] weights swept U rows at a time (above) read U short streams per pass (a 2 KB row for N = 512)
// and load / store each accumulator once per U FMAs; on the benchmark shapes (cold, one thread, Zen 4) the strips
// read 1.4-2.2x faster for 1 <= M <= 16 (README, issue 12). Each output still starts at bias (or 0) and takes
// x[m, k] * W[n, k] over k in order, one FMA each, the same operand order as `sweep`: the same bits.
constexpr int64_t kStrip = 2 * kLanes;                      // columns per strip: two vectors
constexpr int kStripRows = simd::kRegisters >= 32 ? 8 : 4;  // token rows per pass (2 accumulators each)
// Software prefetch distance of a strip pass over >= 3 token rows, in floats (8 KB): there the FMAs are enough work
// per byte that the hardware prefetcher alone falls behind DRAM (cold [256 -> 2065], 8 rows: 95 -> 71 us; 4 rows
// 77 -> 72; 1-2 rows streamed as fast or faster without it; README, issue 12). A later pass over a strip (rows 9-16)
// prefetches the next strip instead: 1.05-1.7x at 16 rows.
constexpr int64_t kPrefetchAhead = 2048;

// G token rows x one strip (valid columns `width` <= kStrip), over all K
template <int G>
inline void strip_rows(const float* __restrict x, int64_t ldx, const float* __restrict ws, int64_t K,
                       const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t width, int64_t pf) {
  const simd::vmask m0 = simd::first(width), m1 = simd::first(std::max<int64_t>(0, width - kLanes));
  const bool whole = width == kStrip;
  simd::vf acc[G][2];
  const simd::vf b0 = bias ? simd::load(m0, bias) : simd::zero();
  const simd::vf b1 = bias && width > kLanes ? simd::load(m1, bias + kLanes) : simd::zero();
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) acc[g][0] = b0, acc[g][1] = b1;
  for (int64_t k = 0; k < K; ++k) {
    if (pf) {  // pf floats ahead (a prefetch never faults, past the weight's end too; it changes no result)
      const char* line = reinterpret_cast<const char*>(ws + k * kStrip + pf);
      _mm_prefetch(line, _MM_HINT_T0);
      if constexpr (kStrip * 4 > 64) _mm_prefetch(line + 64, _MM_HINT_T0);  // the strip row's second cache line
    }
    const simd::vf w0 = simd::load(ws + k * kStrip), w1 = simd::load(ws + k * kStrip + kLanes);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const simd::vf b = simd::set1(x[g * ldx + k]);
      acc[g][0] = simd::fmadd(b, w0, acc[g][0]);
      acc[g][1] = simd::fmadd(b, w1, acc[g][1]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
    if (whole) {
      simd::store(y + g * ldy, acc[g][0]);
      simd::store(y + g * ldy + kLanes, acc[g][1]);
    } else {
      simd::store(m0, y + g * ldy, acc[g][0]);
      if (width > kLanes) simd::store(m1, y + g * ldy + kLanes, acc[g][1]);
    }
  }
}

// M rows of one strip: passes of kStripRows rows (the strip, K S floats, is in L1 / L2 again for the later passes);
// first: this is the strip's first pass
template <int M>
inline void strip_block(const float* x, int64_t ldx, const float* ws, int64_t K, const float* bias, float* y,
                        int64_t ldy, int64_t width, bool first = true) {
  if constexpr (M > kStripRows) {
    strip_rows<kStripRows>(x, ldx, ws, K, bias, y, ldy, width, first ? kPrefetchAhead : 0);
    strip_block<M - kStripRows>(x + kStripRows * ldx, ldx, ws, K, bias, y + kStripRows * ldy, ldy, width, false);
  } else {  // a later pass prefetches the next strip; a first one over >= 3 rows, kPrefetchAhead ahead
    strip_rows<M>(x, ldx, ws, K, bias, y, ldy, width, !first ? K * kStrip : M >= 3 ? kPrefetchAhead : 0);
  }
}

// y[m, s0 S : min(N, s1 S)] = bias (or 0) + x[m] @ W^T for the strips [s0, s1) of P [ceil(N / S), K, S]
template <int M>
inline void strip_sweep(const float* __restrict x, int64_t ldx, const float* __restrict packed, int64_t K, int64_t N,
                        const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t n = s * kStrip;
    strip_block<M>(x, ldx, packed + s * K * kStrip, K, bias ? bias + n : nullptr, y + n, ldy,
                   std::min(kStrip, N - n));
  }
}

using StripFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t,
                         int64_t, int64_t);
constexpr StripFn kStripSweeps[] = {
    strip_sweep<1>,  strip_sweep<2>,  strip_sweep<3>,  strip_sweep<4>,  strip_sweep<5>,  strip_sweep<6>,
    strip_sweep<7>,  strip_sweep<8>,  strip_sweep<9>,  strip_sweep<10>, strip_sweep<11>, strip_sweep<12>,
    strip_sweep<13>, strip_sweep<14>, strip_sweep<15>, strip_sweep<16>};

using SweepFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t,
                         int64_t, int64_t);
constexpr SweepFn kSweeps[] = {sweep<1>,  sweep<2>,  sweep<3>,  sweep<4>,  sweep<5>,  sweep<6>,  sweep<7>,  sweep<8>,
                                sweep<9>,  sweep<10>, sweep<11>, sweep<12>, sweep<13>, sweep<14>, sweep<15>, sweep<16>};

}  // namespace expertspec
