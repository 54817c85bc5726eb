// The raw ops of a CPU decode / verification step (fp32; AVX-512F or AVX2 + FMA, kernels/simd.h), on pointers:
// what cpu_decode.cpp's torch entry points and decoder_stack.h's whole-forward call both run, so the two give the
// same bits. Each op's contract is in cpu_decode.cpp's header; callers check shapes and slot ranges first.
//
//   attention_core   qk-norm, RoPE, K/V write and softmax attention of n packed tokens of B requests
//   moe_core         T tokens' routed SwiGLU experts (each read once for its tokens) and the shared expert
//   route_core       softmax top-r routing
//   add_rms_norm_rows, linear_rows (strip-packed or input-major weight, kernels/sweep.h)
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "sweep.h"

namespace expertspec::decode {

namespace v = expertspec::simd;
using v::vf;
using v::vmask;
constexpr int64_t L = v::kLanes;  // fp32 lanes per vector

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = v::zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = v::fmadd(v::load(a + i), v::load(b + i), acc);
  if (i < n) {
    const vmask m = v::first(n - i);
    acc = v::fmadd(v::load(m, a + i), v::load(m, b + i), acc);
  }
  return v::reduce_add(acc);
}

// e^x per lane (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial, then p 2^n, which also
// underflows to exactly 0 below e^-110 and saturates): within 2 ulp of std::exp, which as a scalar call was most of
// the time of the SwiGLU activations and the softmax at a few tokens (a forward's ~10^5 exponentials).
inline vf vexp(vf x) {
  x = v::min(v::max(x, v::set1(-110.0f)), v::set1(88.3762626647949f));
  const vf n = v::round(v::mul(x, v::set1(1.44269504088896341f)));
  vf r = v::fnmadd(n, v::set1(0.693359375f), x);
  r = v::fnmadd(n, v::set1(-2.12194440e-4f), r);
  vf p = v::set1(1.9875691500e-4f);
  p = v::fmadd(p, r, v::set1(1.3981999507e-3f));
  p = v::fmadd(p, r, v::set1(8.3334519073e-3f));
  p = v::fmadd(p, r, v::set1(4.1665795894e-2f));
  p = v::fmadd(p, r, v::set1(1.6666665459e-1f));
  p = v::fmadd(p, r, v::set1(5.0000001201e-1f));
  p = v::fmadd(v::mul(p, r), r, v::add(r, v::set1(1.0f)));
  return v::scale2(p, n);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  const vf va = v::set1(a);
  int64_t i = 0;
  for (; i + L <= n; i += L) v::store(y + i, v::fmadd(va, v::load(x + i), v::load(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// x [n] <- x * rsqrt(mean(x^2) + eps) * w   (F.rms_norm's formula)
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// rows [n, D]: s = a + b (b null: s = a, which may alias it), out = rms_norm(s) * w
inline void add_rms_norm_rows(const float* a, const float* b, const float* w, float eps, int64_t n, int64_t D, float* s,
                              float* out) {
  for (int64_t t = 0; t < n; ++t) {
    if (b)
      for (int64_t i = 0; i < D; ++i) s[t * D + i] = a[t * D + i] + b[t * D + i];
    rms_norm_row(s + t * D, w, eps, D, out + t * D);
  }
}

// RoPE on x [hd] in place over its first rd dims: x[i] cos[i] + x[i -/+ rd/2] sin_signed[i]
inline void rope_row(float* x, const float* cos, const float* ss, int64_t rd, float* tmp) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) tmp[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * ss[i];
  for (int64_t i = 0; i < rd; ++i) x[i] = tmp[i];
}

// o [C L] += Σ_j p[j] V[rs[j]] over the keys j < S the mask row mt (or null) lets through, V rows of stride ldv: the
// output row kept in C vector registers across the keys, each lane one FMA per key in key order (what `axpy` per key
// computes, without its load and store of o through the cache per key).
template <int C>
void pv_rows(const float* p, const float* V, int64_t ldv, const int64_t* rs, const bool* mt, int64_t S, float* o) {
  vf acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v::load(o + c * L);
  for (int64_t j = 0; j < S; ++j) {
    if (mt && !mt[j]) continue;
    const vf pj = v::set1(p[j]);
    const float* vj = V + rs[j] * ldv;
    for (int c = 0; c < C; ++c) acc[c] = v::fmadd(pj, v::load(vj + c * L), acc[c]);
  }
  for (int c = 0; c < C; ++c) v::store(o + c * L, acc[c]);
}

using PvFn = void (*)(const float*, const float*, int64_t, const int64_t*, const bool*, int64_t, float*);
constexpr PvFn kPv[] = {pv_rows<1>, pv_rows<2>, pv_rows<3>, pv_rows<4>, pv_rows<5>, pv_rows<6>, pv_rows<7>, pv_rows<8>};
constexpr int64_t kPvRegisters = 8;  // head dims up to 8 vectors (128 with AVX-512, 64 with AVX2)

// One layer's attention of n packed tokens: P [n, width = (H + 2 Hkv) hd] (fused QKV output), C / SS [n, rd] (row
// stride ldr), QN / KN [hd] or null, K / V this layer's cache storage [slots, Hkv, hd] (the new keys / values are
// written into slots ws [n]), PI [B, Tq] packed token of each query cell (>= n: padding), RS [B, S] read slots,
// M [B, Tq, S] or null -> O [n, H hd], which the caller zero-fills. Slots are in range (the caller checks).
inline void attention_core(const float* P, int64_t n, int64_t width, const float* C, const float* SS, int64_t ldr,
                           int64_t rd, const float* QN, const float* KN, float eps, float* K, float* V, int64_t hd,
                           const int64_t* ws, const int64_t* RS, int64_t B, int64_t S, const int64_t* PI, int64_t Tq,
                           const bool* M, int64_t H, int64_t Hkv, float* O) {
  const int64_t group = H / Hkv;
  std::vector<float> q(n * H * hd), tmp(hd);
  for (int64_t t = 0; t < n; ++t) {  // q: norm + RoPE; k: norm + RoPE, then k, v into the cache
    const float* row = P + t * width;
    for (int64_t h = 0; h < H; ++h) {
      float* qh = q.data() + (t * H + h) * hd;
      if (QN) rms_norm_row(row + h * hd, QN, eps, hd, qh);
      else std::copy(row + h * hd, row + (h + 1) * hd, qh);
      rope_row(qh, C + t * ldr, SS + t * ldr, rd, tmp.data());
    }
    for (int64_t g = 0; g < Hkv; ++g) {
      float* kg = K + (ws[t] * Hkv + g) * hd;
      const float* src = row + (H + g) * hd;
      if (KN) rms_norm_row(src, KN, eps, hd, kg);
      else std::copy(src, src + hd, kg);
      rope_row(kg, C + t * ldr, SS + t * ldr, rd, tmp.data());
      const float* vs = row + (H + Hkv + g) * hd;
      std::copy(vs, vs + hd, V + (ws[t] * Hkv + g) * hd);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> p(S);
  for (int64_t c = 0; c < B * Tq; ++c) {  // (request b, query cell) -> packed token t, over b's read slots
    const int64_t t = PI[c], b = c / Tq;
    if (t < 0 || t >= n) continue;  // padding cell
    const int64_t* rs = RS + b * S;
    const bool* mt = M ? M + c * S : nullptr;
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q.data() + (t * H + h) * hd;
      const int64_t g = h / group;
      float top = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        if (mt && !mt[j]) {
          p[j] = -INFINITY;  // e^-inf = 0 below
          continue;
        }
        p[j] = dot(qh, K + (rs[j] * Hkv + g) * hd, hd) * scale;
        top = std::max(top, p[j]);
      }
      if (top == -INFINITY) continue;  // sees no key: zeros (SDPA would give NaN; padding rows only)
      vf acc = v::zero();
      const vf vtop = v::set1(top);
      int64_t j = 0;
      for (; j + L <= S; j += L) {  // whole vectors unmasked (simd::load_part: AVX2's masked store is slow)
        const vf e = vexp(v::sub(v::load(p.data() + j), vtop));
        v::store(p.data() + j, e);
        acc = v::add(acc, e);
      }
      if (j < S) {
        const vmask m = v::first(S - j);
        const vf e = v::keep(m, vexp(v::sub(v::load(m, p.data() + j), vtop)));
        v::store(m, p.data() + j, e);
        acc = v::add(acc, e);
      }
      const float sum = v::reduce_add(acc);
      float* oh = O + t * H * hd + h * hd;
      const int64_t vectors = hd / L;
      if (hd % L == 0 && vectors <= kPvRegisters) {  // the output row in registers across the keys (axpy's bits)
        kPv[vectors - 1](p.data(), V + g * hd, Hkv * hd, rs, mt, S, oh);
      } else {
        for (int64_t j = 0; j < S; ++j) {
          if (mt && !mt[j]) continue;
          axpy(p[j], V + (rs[j] * Hkv + g) * hd, oh, hd);
        }
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < hd; ++d) oh[d] *= inv;
    }
  }
}

// out[f] = silu(g[f]) * u[f] = g / (1 + e^-g) * u for f < F (out may alias g)
inline void silu_mul(const float* g, const float* u, float* out, int64_t F) {
  const vmask tail = v::first(F % L);
  auto at = [&](int64_t f, auto part) {  // whole vectors unmasked, the partial last one masked
    constexpr bool Pt = decltype(part)::value;
    const vf gv = v::load_part<Pt>(tail, g + f);
    const vf act = v::div(gv, v::add(v::set1(1.0f), vexp(v::sub(v::zero(), gv))));
    v::store_part<Pt>(tail, out + f, v::mul(act, v::load_part<Pt>(tail, u + f)));
  };
  int64_t f = 0;
  for (; f + L <= F; f += L) at(f, v::Whole{});
  if (f < F) at(f, v::Partial{});
}

// y[m, :out] = W x[m] for M <= 8 rows and a row-major W [out, in] (row stride s_out): each weight row read once for
// the M rows, one dot product per (row, output).
template <int M>
void dots(const float* x, int64_t ldx, const float* W, int64_t s_out, int64_t out, int64_t in, float* y, int64_t ldy) {
  const int64_t full = in / L * L;
  const vmask tail = v::first(in - full);
  for (int64_t j = 0; j < out; ++j) {
    const float* w = W + j * s_out;
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = v::zero();
    for (int64_t k = 0; k < full; k += L) {
      const vf wv = v::load(w + k);
      for (int m = 0; m < M; ++m) acc[m] = v::fmadd(v::load(x + m * ldx + k), wv, acc[m]);
    }
    if (full < in) {
      const vf wv = v::load(tail, w + full);
      for (int m = 0; m < M; ++m) acc[m] = v::fmadd(v::load(tail, x + m * ldx + full), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) y[m * ldy + j] = v::reduce_add(acc[m]);
  }
}

using DotsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
constexpr DotsFn kDots[] = {dots<1>, dots<2>, dots<3>, dots<4>, dots<5>, dots<6>, dots<7>, dots<8>};

// y[m, :out] = W x[m] (m < rows <= kBlock) for W [out, in] given by its strides: input-major (s_out == 1, memory
// [in, out] with row stride s_in: the small-M sweep, one read for all rows) or row-major (s_in == 1: `dots`, one read
// per 8 rows); or from its strip-packed copy when given (one read for all rows).
constexpr int64_t kBlock = expertspec::kMaxBlock;  // tokens per read of an expert's weights
inline void matvecs(int64_t rows, const float* x, int64_t ldx, const float* W, int64_t out, int64_t in, int64_t s_out,
                    int64_t s_in, float* y, int64_t ldy, const float* packed = nullptr) {
  if (packed) {  // W's strip-packed copy [ceil(out / S), in, S] (sweep.h): the sweep's bits, read in address order
    const int64_t strips = (out + expertspec::kStrip - 1) / expertspec::kStrip;
    expertspec::kStripSweeps[rows - 1](x, ldx, packed, in, out, nullptr, y, ldy, 0, strips);
    return;
  }
  if (s_out == 1) {
    expertspec::kSweeps[rows - 1](x, ldx, W, s_in, in, nullptr, y, ldy, 0, out);
    return;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += 8)
    kDots[std::min<int64_t>(8, rows - m0) - 1](x + m0 * ldx, ldx, W, s_out, out, in, y + m0 * ldy, ldy);
}

// Where moe_core reads the routed experts: gu [E, 2F, D] and down [E, D, F] by their strides (input-major or
// row-major per matrix), and their strip-packed copies (null: none) with their per-expert strides.
struct ExpertWeights {
  const float* gu;
  int64_t gu_e, gu_s1, gu_s2;
  const float* down;
  int64_t down_e, down_s1, down_s2;
  const float* gu_p;
  int64_t gu_ps;
  const float* down_p;
  int64_t down_ps;
  int64_t E, F;
};

// The shared expert of moe_core: si [T, 2Fs (+1 gate logit)] (row stride ld) its fused input projection, sd its
// down projection [D, Fs] by strides (or packed sd_p); si null: no shared expert.
struct SharedExpert {
  const float* si = nullptr;
  int64_t ld = 0;
  const float* sd = nullptr;
  int64_t sd_s0 = 0, sd_s1 = 0;
  const float* sd_p = nullptr;
  int64_t Fs = 0;
  bool gated = false;
};

// T tokens xp [T, D]: Σ_s w_s down_e(silu(gate_e x) * up_e x) over id [T, r] (< 0: contributes 0; < E, the caller
// checks), each expert's weights read once per block of <= kBlock of its tokens, plus the shared expert -> op [T, D],
// which the caller zero-fills.
inline void moe_core(const float* xp, int64_t T, int64_t D, const ExpertWeights& w, const int64_t* id, const float* wt,
                     int64_t r, const SharedExpert& se, float* op) {
  const int64_t E = w.E, F = w.F;
  std::vector<std::vector<int64_t>> cells(E);  // expert -> its (token * r + slot) cells, in token order
  for (int64_t c = 0; c < T * r; ++c)
    if (id[c] >= 0) cells[id[c]].push_back(c);
  const int64_t H = 2 * std::max(F, se.Fs);
  std::vector<float> xs(kBlock * D), h(kBlock * H), y(kBlock * D);
  for (int64_t e = 0; e < E; ++e) {
    const float* g = w.gu + e * w.gu_e;
    const float* dn = w.down + e * w.down_e;
    for (size_t b = 0; b < cells[e].size(); b += kBlock) {  // blocks of <= kBlock tokens: one read of the expert each
      const int64_t rows = std::min<int64_t>(kBlock, cells[e].size() - b);
      for (int64_t i = 0; i < rows; ++i) std::copy_n(xp + cells[e][b + i] / r * D, D, xs.data() + i * D);
      matvecs(rows, xs.data(), D, g, 2 * F, D, w.gu_s1, w.gu_s2, h.data(), H, w.gu_p ? w.gu_p + e * w.gu_ps : nullptr);
      for (int64_t i = 0; i < rows; ++i) silu_mul(h.data() + i * H, h.data() + i * H + F, h.data() + i * H, F);
      matvecs(rows, h.data(), H, dn, D, F, w.down_s1, w.down_s2, y.data(), D,
              w.down_p ? w.down_p + e * w.down_ps : nullptr);
      for (int64_t i = 0; i < rows; ++i) axpy(wt[cells[e][b + i]], y.data() + i * D, op + cells[e][b + i] / r * D, D);
    }
  }
  if (se.si) {
    const int64_t Fs = se.Fs, ld = se.ld;
    for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
      const int64_t rows = std::min<int64_t>(kBlock, T - t0);
      for (int64_t i = 0; i < rows; ++i)
        silu_mul(se.si + (t0 + i) * ld, se.si + (t0 + i) * ld + Fs, h.data() + i * H, Fs);
      matvecs(rows, h.data(), H, se.sd, D, Fs, se.sd_s0, se.sd_s1, y.data(), D, se.sd_p);
      for (int64_t i = 0; i < rows; ++i) {
        const float gate = se.gated ? 1.0f / (1.0f + std::exp(-se.si[(t0 + i) * ld + 2 * Fs])) : 1.0f;
        axpy(gate, y.data() + i * D, op + (t0 + i) * D, D);
      }
    }
  }
}

// Softmax top-r routing of T tokens: logits lg [T, E] (row stride ld) -> W [T, r] weights, I [T, r] ids: the r largest
// logits of each row in descending order (ties: the lower expert id first), each weighted by its softmax probability
// e^(l - max) / sum, renormalised over the r when `norm`.
inline void route_core(const float* lg, int64_t T, int64_t E, int64_t ld, int64_t r, bool norm, float* W, int64_t* I) {
  std::vector<int64_t> order(E);
  std::vector<float> ex(E);  // e^(l - max) of one row
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lg + t * ld;
    float top = -INFINITY;
    for (int64_t e = 0; e < E; ++e) top = std::max(top, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += ex[e] = std::exp(l[e] - top);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + r, order.end(),
                      [l](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    float picked = 0.0f;
    for (int64_t k = 0; k < r; ++k) {
      I[t * r + k] = order[k];
      W[t * r + k] = ex[order[k]] / sum;
      picked += W[t * r + k];
    }
    if (norm)
      for (int64_t k = 0; k < r; ++k) W[t * r + k] /= picked;
  }
}

// Whether p is the strip-packed copy (kernels.small_m.pack) of a weight [lead..., out, in]: [lead..., ceil(out / S),
// in, S] contiguous fp32.
inline bool is_packed(const torch::Tensor& p, std::vector<int64_t> lead, int64_t out, int64_t in) {
  lead.insert(lead.end(), {(out + kStrip - 1) / kStrip, in, kStrip});
  return p.sizes() == c10::IntArrayRef(lead) && p.is_contiguous() && p.scalar_type() == torch::kFloat;
}

// The index tensors of n packed tokens over a cache of `slots` slots, what attention_core reads: write_slots [n],
// pad_index [B, Tq], read_slots [B, S] contiguous int64 with every slot in range, mask [B, Tq, S] contiguous bool or
// none. `who` opens each error message.
inline void check_batch(const char* who, int64_t n, int64_t slots, const torch::Tensor& write_slots,
                        const torch::Tensor& pad_index, const torch::Tensor& read_slots,
                        const c10::optional<torch::Tensor>& mask) {
  const int64_t B = pad_index.size(0), Tq = pad_index.size(1), S = read_slots.size(1);
  TORCH_CHECK(write_slots.numel() == n && write_slots.is_contiguous() && write_slots.scalar_type() == torch::kLong &&
                  pad_index.dim() == 2 && pad_index.is_contiguous() && pad_index.scalar_type() == torch::kLong &&
                  read_slots.dim() == 2 && read_slots.size(0) == B && read_slots.is_contiguous() &&
                  read_slots.scalar_type() == torch::kLong,
              who, ": write_slots [n], pad_index [B, Tq], read_slots [B, S] contiguous int64");
  TORCH_CHECK(!mask || (mask->dim() == 3 && mask->size(0) == B && mask->size(1) == Tq && mask->size(2) == S &&
                        mask->is_contiguous() && mask->scalar_type() == torch::kBool),
              who, ": mask [B, Tq, S] contiguous bool");
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  const int64_t* rs = read_slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < B * S; ++j) TORCH_CHECK(rs[j] >= 0 && rs[j] < slots, who, ": read slot out of range");
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(ws[t] >= 0 && ws[t] < slots, who, ": write slot out of range");
}

// y [M, N] (row stride N) = x [M, K] (row stride ldx) W^T (+ bias): from W's strip-packed copy P [ceil(N / S), K, S]
// for M <= 64 (blocks of 16 rows per strip), or from the input-major wt [K, N] (row stride ldw) for M <= 16 — what
// kernels/small_m.cpp's two entry points compute, the same bits.
inline void linear_rows(const float* x, int64_t M, int64_t K, int64_t ldx, const float* P, const float* wt, int64_t ldw,
                        int64_t N, const float* bias, float* y) {
  if (P) {
    const int64_t strips = (N + kStrip - 1) / kStrip;
    at::parallel_for(0, strips, 16, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {  // blocks of <= 16 rows per strip, the strip in L1 / L2 after the first
        for (int64_t m0 = 0; m0 < M; m0 += kMaxBlock) {
          const int64_t rows = std::min(kMaxBlock, M - m0);
          kStripSweeps[rows - 1](x + m0 * ldx, ldx, P, K, N, bias, y + m0 * N, N, s, s + 1);
        }
      }
    });
    return;
  }
  const int64_t vectors = (N + kLanes - 1) / kLanes;
  const SweepFn fn = kSweeps[M - 1];  // one sweep of the weight for all M rows
  at::parallel_for(0, vectors, 32, [&](int64_t v0, int64_t v1) {
    fn(x, ldx, wt, ldw, K, bias, y, N, v0 * kLanes, std::min(N, v1 * kLanes));
  });
}

}  // namespace expertspec::decode
