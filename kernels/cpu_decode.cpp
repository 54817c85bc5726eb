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
//   routing_footprint(ids, start, n, E, prev)
//       ids L x [N, r] int64 (a forward's routing), rows start .. start + n - 1 (one request's verified tokens, root
//       first) -> (counts [L, E] int64, pairs [L, E] bool, U_l per layer, pairs used, the root's own pairs, pairs
//       also in prev [L, E] bool (-1 without prev)): engine.runtime.footprint's numbers without the ~30 numpy and
//       torch calls that cost ~100 µs per round with the caches cold after a forward.
//
// What the torch path (Attention.forward_cached, RMSNorm) computes, in one call instead of ~15 (attention) and ~8
// (F.rms_norm) ATen ops, each of which costs several microseconds between weight reads that evict the caches.
// Sums run in float32 in a fixed order, so results differ from ATen's by rounding only (~1e-6; tested). The raw
// ops are decode_ops.h's, which decoder_stack.h's DecoderStack (a whole forward in one call, bound here too) also
// runs: the same bits either way.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "decode_ops.h"
#include "decoder_stack.h"

namespace {

namespace d = expertspec::decode;

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
  check(!q_norm || (q_norm->numel() == hd && k_norm && k_norm->numel() == hd), "q_norm, k_norm [hd] together");
  d::check_batch("cpu_decode.attention", n, k_cache.size(0), write_slots, pad_index, read_slots, mask);
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  const int64_t* RS = read_slots.data_ptr<int64_t>();
  auto out = torch::zeros({n, H * hd}, proj.options());
  d::attention_core(proj.data_ptr<float>(), n, proj.size(1), cos.data_ptr<float>(), sin_signed.data_ptr<float>(), rd,
                    rd, q_norm ? q_norm->data_ptr<float>() : nullptr, k_norm ? k_norm->data_ptr<float>() : nullptr,
                    static_cast<float>(eps), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), hd, ws, RS, B, S,
                    pad_index.data_ptr<int64_t>(), Tq, mask ? mask->data_ptr<bool>() : nullptr, H, Hkv,
                    out.data_ptr<float>());
  return out;
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const c10::optional<torch::Tensor>& delta,
                                        const torch::Tensor& w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat && w.is_contiguous() &&
                  w.numel() == h.size(1) && w.scalar_type() == torch::kFloat,
              "cpu_decode.add_rms_norm: h [n, D] contiguous fp32, w [D]");
  TORCH_CHECK(!delta || (delta->sizes() == h.sizes() && delta->is_contiguous() && delta->scalar_type() == torch::kFloat),
              "cpu_decode.add_rms_norm: delta like h");
  auto sum = delta ? torch::empty_like(h) : h;
  auto out = torch::empty_like(h);
  d::add_rms_norm_rows(h.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, w.data_ptr<float>(),
                       static_cast<float>(eps), h.size(0), h.size(1), sum.data_ptr<float>(), out.data_ptr<float>());
  return {sum, out};
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
  d::SharedExpert se;
  if (shared_in) {
    check_moe(shared_down && shared_down->dim() == 2 && shared_down->size(0) == D &&
                  shared_down->scalar_type() == torch::kFloat &&
                  (shared_down->stride(0) == 1 || shared_down->stride(1) == 1),
              "shared_down [D, Fs] fp32");
    se.Fs = shared_down->size(1);
    check_moe(shared_in->dim() == 2 && shared_in->size(0) == T && shared_in->stride(1) == 1 &&
                  shared_in->size(1) == 2 * se.Fs + (shared_gated ? 1 : 0),
              "shared_in [T, 2Fs (+1)]");
  }
  auto packed_of = [&](const c10::optional<torch::Tensor>& p, std::vector<int64_t> lead, int64_t out,
                       int64_t in) -> const float* {
    if (!p || !p->defined()) return static_cast<const float*>(nullptr);
    check_moe(d::is_packed(*p, std::move(lead), out, in),
              "packed weights [..., ceil(out / S), in, S] contiguous fp32 (kernels.small_m.pack)");
    return p->data_ptr<float>();
  };
  d::ExpertWeights w{gu.data_ptr<float>(), gu.stride(0), gu.stride(1), gu.stride(2),
                     down.data_ptr<float>(), down.stride(0), down.stride(1), down.stride(2),
                     packed_of(gu_packed, {E}, 2 * F, D), 0, packed_of(down_packed, {E}, D, F), 0, E, F};
  if (w.gu_p) w.gu_ps = gu_packed->stride(0);  // per expert
  if (w.down_p) w.down_ps = down_packed->stride(0);
  if (shared_in) {
    se.si = shared_in->data_ptr<float>();
    se.ld = shared_in->stride(0);
    se.sd = shared_down->data_ptr<float>();
    se.sd_s0 = shared_down->stride(0);
    se.sd_s1 = shared_down->stride(1);
    se.sd_p = packed_of(shared_down_packed, {}, D, se.Fs);
    se.gated = shared_gated;
  }
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t c = 0; c < T * r; ++c) TORCH_CHECK(id[c] < E, "cpu_decode.moe_decode: expert id ", id[c], " >= ", E);
  auto out = torch::zeros({T, D}, x.options());
  d::moe_core(x.data_ptr<float>(), T, D, w, id, weights.data_ptr<float>(), r, se, out.data_ptr<float>());
  return out;
}

// Softmax top-r routing of T tokens: logits [T, E] (rows may be strided: a slice of the fused input projection) ->
// (weights [T, r] fp32, ids [T, r] int64): the r largest logits of each row in descending order (ties: the lower
// expert id first; the softmax is monotonic, so these are the r largest probabilities), each weighted by its softmax
// probability e^(l - max) / sum, renormalised over the r when `norm` (MoEBlock.route's torch ops, in one call).
std::vector<torch::Tensor> route_softmax(const torch::Tensor& logits, int64_t r, bool norm) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == torch::kFloat,
              "cpu_decode.route_softmax: logits [T, E] fp32 with contiguous rows");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(r >= 1 && r <= E, "cpu_decode.route_softmax: 1 <= r <= E");
  auto w = torch::empty({T, r}, logits.options());
  auto ids = torch::empty({T, r}, logits.options().dtype(torch::kLong));
  d::route_core(logits.data_ptr<float>(), T, E, logits.stride(0), r, norm, w.data_ptr<float>(),
                ids.data_ptr<int64_t>());
  return {w, ids};
}

// A request's routing footprint of one verification (the header's routing_footprint); nullopt when the routing or
// prev is not laid out as taken here (another device, dtype or layout: the caller's numpy twin runs).
using Footprint = std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>, int64_t, int64_t, int64_t>;
c10::optional<Footprint> routing_footprint(const std::vector<torch::Tensor>& ids, int64_t start, int64_t n,
                                           int64_t E, const c10::optional<torch::Tensor>& prev) {
  const int64_t L = static_cast<int64_t>(ids.size());
  TORCH_CHECK_VALUE(L >= 1 && E >= 1 && n >= 1 && start >= 0, "routing_footprint: L, E, n >= 1 and start >= 0");
  for (const auto& t : ids) {
    if (!t.device().is_cpu() || t.scalar_type() != torch::kLong || t.dim() != 2 || !t.is_contiguous() ||
        t.size(1) != ids[0].size(1))
      return c10::nullopt;
    TORCH_CHECK_VALUE(t.size(0) >= start + n, "routing_footprint: rows ", start, " + ", n, " past the routing's ",
                      t.size(0));
  }
  const int64_t r = ids[0].size(1);
  const bool* pv = nullptr;
  if (prev && prev->defined()) {
    if (!prev->device().is_cpu() || prev->scalar_type() != torch::kBool || !prev->is_contiguous()) return c10::nullopt;
    TORCH_CHECK_VALUE(prev->numel() == L * E, "routing_footprint: prev has ", prev->numel(), " pairs, not L·E = ",
                      L * E);
    pv = prev->data_ptr<bool>();
  }
  auto counts = torch::zeros({L, E}, torch::kLong);
  auto pairs = torch::empty({L, E}, torch::kBool);
  int64_t* c = counts.data_ptr<int64_t>();
  bool* p = pairs.data_ptr<bool>();
  std::vector<int64_t> distinct(L, 0);
  int64_t used = 0, root = 0, overlap = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* a = ids[l].data_ptr<int64_t>() + start * r;
    int64_t* cl = c + l * E;
    for (int64_t k = 0; k < n * r; ++k) {
      const int64_t e = a[k];
      TORCH_CHECK_VALUE(e >= 0 && e < E, "round_footprint: expert id ", e, " outside [0, ", E,
                        ") (a -1 'not local' id has no expert: take global ids)");
      if (k < r) {  // the root's row: count its distinct experts (top-r ids are distinct, but do not assume it)
        bool seen = false;
        for (int64_t j = 0; j < k; ++j) seen = seen || a[j] == e;
        root += seen ? 0 : 1;
      }
      ++cl[e];
    }
    for (int64_t e = 0; e < E; ++e) {
      const bool on = cl[e] > 0;
      p[l * E + e] = on;
      distinct[l] += on;
      if (on && pv) overlap += pv[l * E + e];
    }
    used += distinct[l];
  }
  return Footprint{counts, pairs, distinct, used, root, pv ? overlap : -1};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "qk-norm, RoPE, K/V write and attention of one request's n tokens (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta) * w), fp32 rows");
  m.def("moe_decode", &moe_decode, "T tokens' routed experts and shared expert (fp32)");
  m.def("route_softmax", &route_softmax, "softmax top-r routing weights and ids of T tokens (fp32)");
  m.def("routing_footprint", &routing_footprint, "one request's routing footprint of a verification",
        py::arg("ids"), py::arg("start"), py::arg("n"), py::arg("E"), py::arg("prev") = py::none());
  expertspec::stack::bind(m);
}
