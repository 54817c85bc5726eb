// The small ops of a CPU decode / verification step, fused (fp32; AVX-512F or AVX2 + FMA, kernels/simd.h):
//
//   attention(proj, cos, sin_signed, q_norm, k_norm, eps, k_cache, v_cache, write_slots, pad_index, read_slots,
//             mask, H, Hkv)
//       proj [n, (H + 2 Hkv) hd] (the fused QKV projection of the n packed tokens of B requests) -> out [n, H hd]:
//       per-head RMSNorm of q and k (qk-norm "head", optional), RoPE on the first rd dims (HF rotate-half with the
//       sign-folded sin table of engine.models.layers.apply_rope_signed), the n new keys / values written into the
//       cache slots write_slots [n], then for request b's query cells pad_index [B, Tq] (n: padding)
//       softmax(q k^T / sqrt(hd)) v over its cache slots read_slots [B, S] (mask [B, Tq, S] bool: which of them
//       each query sees; none: all), GQA head g = h / (H / Hkv).
//   add_rms_norm(h, delta, w, eps) -> (h + delta, rms_norm(h + delta) * w)   (delta optional: rms_norm alone)
//   moe_decode(x, gu, down, ids, weights, shared_in, shared_down, gated[, gu_packed, down_packed, shared_down_packed])
//       -> [T, D]: T tokens' routed SwiGLU experts, each read in place (either weight layout, engine.models.layout;
//       or its strip-packed copy when given, sweep.h: same bits) once for all its tokens, and the shared expert from
//       its fused input projection, weighted and summed (MoEBlock.forward after routing).
//
// What the torch path (Attention.forward_cached, RMSNorm) computes, in one call instead of ~15 (attention) and ~8
// (F.rms_norm) ATen ops, each of which costs several microseconds between weight reads that evict the caches.
// Sums run in float32 in a fixed order, so results differ from ATen's by rounding only (~1e-6; tested).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "sweep.h"

namespace {

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

// RoPE on x [hd] in place over its first rd dims: x[i] cos[i] + x[i -/+ rd/2] sin_signed[i]
inline void rope_row(float* x, const float* cos, const float* ss, int64_t rd, float* tmp) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) tmp[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * ss[i];
  for (int64_t i = 0; i < rd; ++i) x[i] = tmp[i];
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cpu_decode.attention: ", what); }

torch::Tensor attention(const torch::Tensor& proj, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                        const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                        double eps, torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& write_slots,
                        const torch::Tensor& pad_index, const torch::Tensor& read_slots,
                        const c10::optional<torch::Tensor>& mask, int64_t H, int64_t Hkv) {
  const int64_t n = proj.size(0), hd = k_cache.size(2), rd = cos.size(1), S = read_slots.size(1);
  const int64_t B = pad_index.size(0), Tq = pad_index.size(1);
  check(proj.dim() == 2 && proj.is_contiguous() && proj.scalar_type() == torch::kFloat, "proj [n, (H+2Hkv)hd] fp32");
  check(proj.size(1) == (H + 2 * Hkv) * hd && H % Hkv == 0, "proj width != (H + 2 Hkv) hd, or H % Hkv != 0");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
            k_cache.size(1) == Hkv && k_cache.scalar_type() == torch::kFloat,
        "k_cache, v_cache [slots, Hkv, hd] contiguous fp32");
  check(cos.is_contiguous() && sin_signed.is_contiguous() && cos.size(0) == n && sin_signed.sizes() == cos.sizes() &&
            rd <= hd && rd % 2 == 0,
        "cos, sin_signed [n, rd <= hd] contiguous");
  check(write_slots.numel() == n && write_slots.scalar_type() == torch::kLong && read_slots.dim() == 2 &&
            read_slots.size(0) == B && read_slots.is_contiguous() && read_slots.scalar_type() == torch::kLong &&
            pad_index.dim() == 2 && pad_index.is_contiguous() && pad_index.scalar_type() == torch::kLong,
        "write_slots [n], pad_index [B, Tq], read_slots [B, S] int64");
  check(!mask || (mask->dim() == 3 && mask->size(0) == B && mask->size(1) == Tq && mask->size(2) == S &&
                  mask->is_contiguous() && mask->scalar_type() == torch::kBool),
        "mask [B, Tq, S] contiguous bool");
  check(!q_norm || (q_norm->numel() == hd && k_norm && k_norm->numel() == hd), "q_norm, k_norm [hd] together");
  const int64_t width = proj.size(1), slots = k_cache.size(0), group = H / Hkv;
  const float* P = proj.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* SS = sin_signed.data_ptr<float>();
  const float* QN = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* KN = k_norm ? k_norm->data_ptr<float>() : nullptr;
  float* K = k_cache.data_ptr<float>();
  float* V = v_cache.data_ptr<float>();
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  const int64_t* RS = read_slots.data_ptr<int64_t>();
  const int64_t* PI = pad_index.data_ptr<int64_t>();
  const bool* M = mask ? mask->data_ptr<bool>() : nullptr;
  for (int64_t j = 0; j < B * S; ++j) TORCH_CHECK(RS[j] >= 0 && RS[j] < slots, "cpu_decode.attention: read slot out of range");
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(ws[t] >= 0 && ws[t] < slots, "cpu_decode.attention: write slot out of range");

  std::vector<float> q(n * H * hd), tmp(hd);
  for (int64_t t = 0; t < n; ++t) {  // q: norm + RoPE; k: norm + RoPE, then k, v into the cache
    const float* row = P + t * width;
    for (int64_t h = 0; h < H; ++h) {
      float* qh = q.data() + (t * H + h) * hd;
      if (QN) rms_norm_row(row + h * hd, QN, static_cast<float>(eps), hd, qh);
      else std::copy(row + h * hd, row + (h + 1) * hd, qh);
      rope_row(qh, C + t * rd, SS + t * rd, rd, tmp.data());
    }
    for (int64_t g = 0; g < Hkv; ++g) {
      float* kg = K + (ws[t] * Hkv + g) * hd;
      const float* src = row + (H + g) * hd;
      if (KN) rms_norm_row(src, KN, static_cast<float>(eps), hd, kg);
      else std::copy(src, src + hd, kg);
      rope_row(kg, C + t * rd, SS + t * rd, rd, tmp.data());
      const float* vs = row + (H + Hkv + g) * hd;
      std::copy(vs, vs + hd, V + (ws[t] * Hkv + g) * hd);
    }
  }
  auto out = torch::zeros({n, H * hd}, proj.options());
  float* O = out.data_ptr<float>();
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
      for (int64_t j = 0; j < S; ++j) {
        if (mt && !mt[j]) continue;
        axpy(p[j], V + (rs[j] * Hkv + g) * hd, oh, hd);
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < hd; ++d) oh[d] *= inv;
    }
  }
  return out;
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const c10::optional<torch::Tensor>& delta,
                                        const torch::Tensor& w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat && w.is_contiguous() &&
                  w.numel() == h.size(1) && w.scalar_type() == torch::kFloat,
              "cpu_decode.add_rms_norm: h [n, D] contiguous fp32, w [D]");
  TORCH_CHECK(!delta || (delta->sizes() == h.sizes() && delta->is_contiguous() && delta->scalar_type() == torch::kFloat),
              "cpu_decode.add_rms_norm: delta like h");
  const int64_t n = h.size(0), D = h.size(1);
  auto sum = delta ? torch::empty_like(h) : h;
  auto out = torch::empty_like(h);
  const float* a = h.data_ptr<float>();
  const float* b = delta ? delta->data_ptr<float>() : nullptr;
  float* s = sum.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    if (b)
      for (int64_t i = 0; i < D; ++i) s[t * D + i] = a[t * D + i] + b[t * D + i];
    rms_norm_row(s + t * D, w.data_ptr<float>(), static_cast<float>(eps), D, out.data_ptr<float>() + t * D);
  }
  return {sum, out};
}

// out[f] = silu(g[f]) * u[f] = g / (1 + e^-g) * u for f < F (out may alias g)
inline void silu_mul(const float* g, const float* u, float* out, int64_t F) {
  const vmask tail = v::first(F % L);
  auto at = [&](int64_t f, auto part) {  // whole vectors unmasked, the partial last one masked
    constexpr bool P = decltype(part)::value;
    const vf gv = v::load_part<P>(tail, g + f);
    const vf act = v::div(gv, v::add(v::set1(1.0f), vexp(v::sub(v::zero(), gv))));
    v::store_part<P>(tail, out + f, v::mul(act, v::load_part<P>(tail, u + f)));
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
void matvecs(int64_t rows, const float* x, int64_t ldx, const float* W, int64_t out, int64_t in, int64_t s_out,
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

void check_moe(bool ok, const char* what) { TORCH_CHECK(ok, "cpu_decode.moe_decode: ", what); }

// T tokens' routed experts (ids [T, r], weights [T, r]; id < 0 contributes 0), each expert's weights read once
// for all the tokens routed to it, and, when given, the shared expert from its input projection shared_in
// [T, 2Fs (+1 gate logit)] with down [D, Fs]: the MoE block's output [T, D].
torch::Tensor moe_decode(const torch::Tensor& x, const torch::Tensor& gu, const torch::Tensor& down,
                         const torch::Tensor& ids, const torch::Tensor& weights,
                         const c10::optional<torch::Tensor>& shared_in, const c10::optional<torch::Tensor>& shared_down,
                         bool shared_gated, const c10::optional<torch::Tensor>& gu_packed,
                         const c10::optional<torch::Tensor>& down_packed,
                         const c10::optional<torch::Tensor>& shared_down_packed) {
  check_moe(x.dim() == 2 && x.size(0) >= 1 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
            "x [T, D] contiguous fp32");
  const int64_t T = x.size(0), D = x.size(1), E = gu.size(0), F = down.size(2), r = ids.size(1);
  check_moe(gu.dim() == 3 && gu.size(1) == 2 * F && gu.size(2) == D && down.dim() == 3 && down.size(0) == E &&
                down.size(1) == D && gu.scalar_type() == torch::kFloat && down.scalar_type() == torch::kFloat,
            "gu [E, 2F, D], down [E, D, F] fp32");
  check_moe((gu.stride(1) == 1 || gu.stride(2) == 1) && (down.stride(1) == 1 || down.stride(2) == 1),
            "expert weights row-major or input-major");
  check_moe(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == torch::kLong && ids.is_contiguous() &&
                weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat && weights.is_contiguous(),
            "ids int64 and weights fp32 [T, r]");
  int64_t Fs = 0;
  if (shared_in) {
    check_moe(shared_down && shared_down->dim() == 2 && shared_down->size(0) == D &&
                  shared_down->scalar_type() == torch::kFloat &&
                  (shared_down->stride(0) == 1 || shared_down->stride(1) == 1),
              "shared_down [D, Fs] fp32");
    Fs = shared_down->size(1);
    check_moe(shared_in->dim() == 2 && shared_in->size(0) == T && shared_in->stride(1) == 1 &&
                  shared_in->size(1) == 2 * Fs + (shared_gated ? 1 : 0),
              "shared_in [T, 2Fs (+1)]");
  }
  const int64_t S = expertspec::kStrip;
  auto packed_of = [&](const c10::optional<torch::Tensor>& p, std::vector<int64_t> lead, int64_t out,
                       int64_t in) -> const float* {
    if (!p || !p->defined()) return static_cast<const float*>(nullptr);
    lead.insert(lead.end(), {(out + S - 1) / S, in, S});
    check_moe(p->sizes() == c10::IntArrayRef(lead) && p->is_contiguous() && p->scalar_type() == torch::kFloat,
              "packed weights [..., ceil(out / S), in, S] contiguous fp32 (kernels.small_m.pack)");
    return p->data_ptr<float>();
  };
  const float* gu_p = packed_of(gu_packed, {E}, 2 * F, D);
  const float* down_p = packed_of(down_packed, {E}, D, F);
  const float* sd_p = shared_in ? packed_of(shared_down_packed, {}, D, Fs) : nullptr;
  const int64_t gu_ps = gu_p ? gu_packed->stride(0) : 0, down_ps = down_p ? down_packed->stride(0) : 0;  // per expert
  const float* xp = x.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  std::vector<std::vector<int64_t>> cells(E);  // expert -> its (token * r + slot) cells, in token order
  for (int64_t c = 0; c < T * r; ++c) {
    if (id[c] < 0) continue;
    TORCH_CHECK(id[c] < E, "cpu_decode.moe_decode: expert id ", id[c], " >= ", E);
    cells[id[c]].push_back(c);
  }
  auto out = torch::zeros({T, D}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t H = 2 * std::max(F, Fs);
  std::vector<float> xs(kBlock * D), h(kBlock * H), y(kBlock * D);
  for (int64_t e = 0; e < E; ++e) {
    const float* g = gu.data_ptr<float>() + e * gu.stride(0);
    const float* dn = down.data_ptr<float>() + e * down.stride(0);
    for (size_t b = 0; b < cells[e].size(); b += kBlock) {  // blocks of <= kBlock tokens: one read of the expert each
      const int64_t rows = std::min<int64_t>(kBlock, cells[e].size() - b);
      for (int64_t i = 0; i < rows; ++i) std::copy_n(xp + cells[e][b + i] / r * D, D, xs.data() + i * D);
      matvecs(rows, xs.data(), D, g, 2 * F, D, gu.stride(1), gu.stride(2), h.data(), H,
              gu_p ? gu_p + e * gu_ps : nullptr);
      for (int64_t i = 0; i < rows; ++i) silu_mul(h.data() + i * H, h.data() + i * H + F, h.data() + i * H, F);
      matvecs(rows, h.data(), H, dn, D, F, down.stride(1), down.stride(2), y.data(), D,
              down_p ? down_p + e * down_ps : nullptr);
      for (int64_t i = 0; i < rows; ++i) axpy(wt[cells[e][b + i]], y.data() + i * D, op + cells[e][b + i] / r * D, D);
    }
  }
  if (shared_in) {
    const float* si = shared_in->data_ptr<float>();
    const int64_t ld = shared_in->stride(0);
    const float* sd = shared_down->data_ptr<float>();
    for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
      const int64_t rows = std::min<int64_t>(kBlock, T - t0);
      for (int64_t i = 0; i < rows; ++i) silu_mul(si + (t0 + i) * ld, si + (t0 + i) * ld + Fs, h.data() + i * H, Fs);
      matvecs(rows, h.data(), H, sd, D, Fs, shared_down->stride(0), shared_down->stride(1), y.data(), D, sd_p);
      for (int64_t i = 0; i < rows; ++i) {
        const float gate = shared_gated ? 1.0f / (1.0f + std::exp(-si[(t0 + i) * ld + 2 * Fs])) : 1.0f;
        axpy(gate, y.data() + i * D, op + (t0 + i) * D, D);
      }
    }
  }
  return out;
}

// Softmax top-r routing of T tokens: logits [T, E] (rows may be strided: a slice of the fused input projection) ->
// (weights [T, r] fp32, ids [T, r] int64): the r largest logits of each row in descending order (ties: the lower
// expert id first; the softmax is monotonic, so these are the r largest probabilities), each weighted by its softmax
// probability e^(l - max) / sum, renormalised over the r when `norm` (MoEBlock.route's torch ops, in one call).
std::vector<torch::Tensor> route_softmax(const torch::Tensor& logits, int64_t r, bool norm) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == torch::kFloat,
              "cpu_decode.route_softmax: logits [T, E] fp32 with contiguous rows");
  const int64_t T = logits.size(0), E = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(r >= 1 && r <= E, "cpu_decode.route_softmax: 1 <= r <= E");
  auto w = torch::empty({T, r}, logits.options());
  auto ids = torch::empty({T, r}, logits.options().dtype(torch::kLong));
  const float* L = logits.data_ptr<float>();
  float* W = w.data_ptr<float>();
  int64_t* I = ids.data_ptr<int64_t>();
  std::vector<int64_t> order(E);
  std::vector<float> ex(E);  // e^(l - max) of one row
  for (int64_t t = 0; t < T; ++t) {
    const float* l = L + t * ld;
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
  return {w, ids};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "qk-norm, RoPE, K/V write and attention of one request's n tokens (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta) * w), fp32 rows");
  m.def("moe_decode", &moe_decode, "T tokens' routed experts and shared expert (fp32)");
  m.def("route_softmax", &route_softmax, "softmax top-r routing weights and ids of T tokens (fp32)");
}
