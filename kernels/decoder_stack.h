// A whole cached forward of a MoE decoder in one call (`DecoderStack`, bound into cpu_decode.cpp's module):
//
//   for each layer:  h, x = h + delta, rms_norm(h + delta)        (delta: the last layer's MoE output)
//                    proj = x Wqkv^T (+ b); attention (qk-norm, RoPE, K/V write, softmax) -> o = attn Wo^T (+ b)
//                    h, x = h + o, rms_norm(h + o)
//                    [router | shared gate, up (| gate logit)] = x Win^T; softmax top-r; delta = experts + shared
//   h, hidden = h + delta, rms_norm(h + delta);  logits = hidden Wlm^T
//
// the ops of engine.models.transformer.Model.forward_batch's per-op path (decode_ops.h: the same functions, so the
// same bits, tested), without the ~100 µs per layer of Python between them: module attribute lookups, the fused and
// packed weights' validity checks, argument checks and ~12 calls (README, issue 12). The stack holds the weights it
// reads (strip-packed copies, or input-major ones) and the parameters they were made from; `valid()` says whether
// every parameter still has the storage and in-place version it had (the Python side rebuilds the stack when not).
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace expertspec::stack {

namespace d = expertspec::decode;
namespace py = pybind11;

constexpr int64_t kMaxTokens = 32;  // kernels.cpu_decode.MAX_MOE_TOKENS: more tokens take the grouped GEMMs

// W [N, K] of one matmul, read as kernels.small_m.linear(x, W, b, pack=True) reads it: from its strip-packed copy
// P [ceil(N / S), K, S] when there is one; else with the small-M sweep from wt = W^T [K, N] (W input-major) for
// <= 16 token rows; else with at::linear (F.linear's BLAS and bits).
struct Linear {
  torch::Tensor W, P, wt;
  c10::optional<torch::Tensor> bias;
  int64_t N = 0, K = 0;

  // y [M, N] = x [M, K] W^T (+ b); x: a tensor (rows contiguous), as BLAS would be handed it
  void run(const torch::Tensor& x, float* y) const {
    const int64_t M = x.size(0);
    const float* b = bias ? bias->data_ptr<float>() : nullptr;
    if (P.defined() || (wt.defined() && M <= kMaxBlock)) {
      d::linear_rows(x.data_ptr<float>(), M, K, x.stride(0), P.defined() ? P.data_ptr<float>() : nullptr,
                     wt.defined() ? wt.data_ptr<float>() : nullptr, wt.defined() ? wt.stride(0) : 0, N, b, y);
      return;
    }
    const torch::Tensor out = at::linear(x, W, bias);
    std::copy_n(out.data_ptr<float>(), M * N, y);
  }
};

inline c10::optional<torch::Tensor> opt(const py::handle& o) {
  if (o.is_none()) return c10::nullopt;
  return o.cast<torch::Tensor>();
}

inline void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "cpu_decode.DecoderStack: ", what); }

inline torch::Tensor fp32(const py::handle& o, const char* name) {
  auto t = o.cast<torch::Tensor>();
  check(t.scalar_type() == torch::kFloat && t.device().is_cpu(), std::string(name) + " must be CPU fp32");
  return t;
}

// {"weight": W [N, K], "packed": P or None, "sweep": whether the small-M sweep reads W (input-major), "bias": [N]
// or None}
inline Linear make_linear(const py::dict& spec, const char* name) {
  Linear lin;
  lin.W = fp32(spec["weight"], name);
  check(lin.W.dim() == 2, std::string(name) + ": weight [N, K]");
  lin.N = lin.W.size(0);
  lin.K = lin.W.size(1);
  lin.bias = opt(spec["bias"]);
  const py::object packed = spec["packed"];
  if (!packed.is_none()) {
    lin.P = fp32(packed, name);
    check(d::is_packed(lin.P, {}, lin.N, lin.K), std::string(name) + ": packed [ceil(N / S), K, S] contiguous");
  }
  if (spec["sweep"].cast<bool>()) {
    check(lin.W.stride(0) == 1, std::string(name) + ": the sweep reads an input-major weight");
    lin.wt = lin.W.t();
  }
  check(!lin.bias || (lin.bias->scalar_type() == torch::kFloat && lin.bias->is_contiguous() &&
                      lin.bias->numel() == lin.N),
        std::string(name) + ": bias [N] contiguous fp32");
  return lin;
}

struct Layer {
  torch::Tensor in_norm, post_norm;
  float in_eps = 0, post_eps = 0;
  double qk_eps = 0;  // the full qk-norm's F.rms_norm takes it as a double; the per-head one in attention_core, a float
  Linear qkv, o, fused_in;  // fused_in: [router E | shared gate Fs | shared up Fs | (shared gate logit 1)]
  c10::optional<torch::Tensor> q_norm, k_norm;            // per head [hd] (qk-norm "head"), in the attention
  c10::optional<torch::Tensor> q_norm_full, k_norm_full;  // [H hd], [Hkv hd] (OLMoE's "full"), F.rms_norm's op
  torch::Tensor gu, down;  // [E, 2F, D], [E, D, F] (either layout per matrix)
  c10::optional<torch::Tensor> gu_p, down_p, shared_down, shared_down_p;
  int64_t E = 0, r = 0;
  bool norm_topk = false, gated = false;
};

class DecoderStack {
 public:
  // layers: one dict per layer (keys below), head: {"norm", "eps", "lm_head": linear spec}, sources: the parameters
  // the weights were made from, H / Hkv / hd: attention heads
  DecoderStack(const py::list& layers, const py::dict& head, const std::vector<torch::Tensor>& sources, int64_t H,
               int64_t Hkv, int64_t hd)
      : H_(H), Hkv_(Hkv), hd_(hd), sources_(sources) {
    check(H > 0 && Hkv > 0 && H % Hkv == 0 && hd > 0, "H % Hkv == 0 and hd > 0");
    for (const auto& t : sources_) keys_.push_back(key(t));
    for (const py::handle& item : layers) {
      const py::dict s = item.cast<py::dict>();
      Layer l;
      l.in_norm = fp32(s["in_norm"], "in_norm");
      l.post_norm = fp32(s["post_norm"], "post_norm");
      l.in_eps = s["in_eps"].cast<float>();
      l.post_eps = s["post_eps"].cast<float>();
      l.qkv = make_linear(s["qkv"].cast<py::dict>(), "qkv");
      l.o = make_linear(s["o"].cast<py::dict>(), "o_proj");
      l.fused_in = make_linear(s["fused_in"].cast<py::dict>(), "fused input");
      l.q_norm = opt(s["q_norm"]);
      l.k_norm = opt(s["k_norm"]);
      l.q_norm_full = opt(s["q_norm_full"]);
      l.k_norm_full = opt(s["k_norm_full"]);
      l.qk_eps = s["qk_eps"].cast<double>();
      l.gu = fp32(s["gu"], "gate_up_proj");
      l.down = fp32(s["down"], "down_proj");
      l.gu_p = opt(s["gu_packed"]);
      l.down_p = opt(s["down_packed"]);
      l.shared_down = opt(s["shared_down"]);
      l.shared_down_p = opt(s["shared_down_packed"]);
      l.E = s["num_experts"].cast<int64_t>();
      l.r = s["top_r"].cast<int64_t>();
      l.norm_topk = s["norm_topk"].cast<bool>();
      l.gated = s["shared_gated"].cast<bool>();
      validate(l);
      layers_.push_back(std::move(l));
    }
    check(!layers_.empty(), "no layers");
    D_ = layers_[0].in_norm.numel();
    norm_ = fp32(head["norm"], "final norm");
    norm_eps_ = head["eps"].cast<float>();
    lm_head_ = make_linear(head["lm_head"].cast<py::dict>(), "lm_head");
    check(norm_.numel() == D_ && lm_head_.K == D_, "final norm [D] and lm_head [V, D]");
  }

  // Every source parameter still has the storage and in-place version it had when the stack was built.
  bool valid() const {
    for (size_t i = 0; i < sources_.size(); ++i)
      if (key(sources_[i]) != keys_[i]) return false;
    return true;
  }

  // h [n, D] (embedded tokens), positions [n] into cos / sin_signed tables [P, rd], k_all / v_all [L, slots, Hkv, hd]
  // (the cache storage), write_slots [n], pad_index [B, Tq], read_slots [B, S], mask [B, Tq, S] bool or None; capture:
  // layers whose input residual to return; routing / logits: return each layer's expert ids, weights (and router
  // logits) -> (logits [n, V], hidden [n, D], h [n, D] before the final norm, [captured], [ids], [weights], [router
  // logits]).
  using Tensors = std::vector<torch::Tensor>;
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, Tensors, Tensors, Tensors, Tensors> forward(
      const torch::Tensor& h_in, const torch::Tensor& positions, const torch::Tensor& cos_table,
      const torch::Tensor& sin_table, torch::Tensor k_all, torch::Tensor v_all, const torch::Tensor& write_slots,
      const torch::Tensor& pad_index, const torch::Tensor& read_slots, const c10::optional<torch::Tensor>& mask,
      const std::vector<int64_t>& capture, bool routing, bool keep_logits) const {
    const int64_t n = h_in.size(0), D = D_, nl = static_cast<int64_t>(layers_.size());
    check(h_in.dim() == 2 && h_in.size(1) == D && h_in.is_contiguous() && h_in.scalar_type() == torch::kFloat,
          "h [n, D] contiguous fp32");
    check(n >= 1 && n <= kMaxTokens, "1 <= n <= 32 tokens");
    const int64_t rd = cos_table.size(1), P = cos_table.size(0);
    check(cos_table.dim() == 2 && cos_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
              sin_table.is_contiguous() && cos_table.scalar_type() == torch::kFloat &&
              sin_table.scalar_type() == torch::kFloat && rd <= hd_ && rd % 2 == 0,
          "cos / sin tables [P, rd <= hd] contiguous fp32");
    check(positions.numel() == n && positions.is_contiguous() && positions.scalar_type() == torch::kLong,
          "positions [n] int64");
    check(k_all.dim() == 4 && k_all.size(0) == nl && k_all.size(2) == Hkv_ && k_all.size(3) == hd_ &&
              k_all.is_contiguous() && v_all.sizes() == k_all.sizes() && v_all.is_contiguous() &&
              k_all.scalar_type() == torch::kFloat && v_all.scalar_type() == torch::kFloat,
          "k / v cache storage [L, slots, Hkv, hd] contiguous fp32");
    const int64_t B = pad_index.size(0), Tq = pad_index.size(1), S = read_slots.size(1), slots = k_all.size(1);
    d::check_batch("cpu_decode.DecoderStack", n, slots, write_slots, pad_index, read_slots, mask);
    const int64_t* ws = write_slots.data_ptr<int64_t>();
    const int64_t* RS = read_slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t) check(pos[t] >= 0 && pos[t] < P, "position out of the RoPE table");
    for (int64_t c : capture) check(c >= 0 && c <= nl, "capture layer out of range");

    std::vector<float> cos(n * rd), sin(n * rd);  // the tokens' RoPE rows
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(cos_table.data_ptr<float>() + pos[t] * rd, rd, cos.data() + t * rd);
      std::copy_n(sin_table.data_ptr<float>() + pos[t] * rd, rd, sin.data() + t * rd);
    }
    const auto opts = h_in.options();
    std::vector<float> h(h_in.data_ptr<float>(), h_in.data_ptr<float>() + n * D), delta(n * D), o(n * D), fin;
    const torch::Tensor x = torch::empty({n, D}, opts), attn = torch::empty({n, H_ * hd_}, opts);  // matmul inputs
    float* X = x.data_ptr<float>();
    float* A = attn.data_ptr<float>();
    Tensors captured, ids_out, weights_out, logits_out;
    const int64_t layer_slots = slots * Hkv_ * hd_;
    for (int64_t i = 0; i < nl; ++i) {
      const Layer& l = layers_[i];
      d::add_rms_norm_rows(h.data(), i ? delta.data() : nullptr, l.in_norm.data_ptr<float>(), l.in_eps, n, D,
                           h.data(), X);
      if (std::find(capture.begin(), capture.end(), i) != capture.end()) captured.push_back(copy(h, n, D, opts));
      const torch::Tensor proj = torch::empty({n, l.qkv.N}, opts);
      l.qkv.run(x, proj.data_ptr<float>());
      if (l.q_norm_full) {  // RMSNorm over the whole q and k projections, as the per-op path's F.rms_norm
        const int64_t q = H_ * hd_, k = Hkv_ * hd_;
        proj.narrow(1, 0, q).copy_(at::rms_norm(proj.narrow(1, 0, q), {q}, *l.q_norm_full, l.qk_eps));
        proj.narrow(1, q, k).copy_(at::rms_norm(proj.narrow(1, q, k), {k}, *l.k_norm_full, l.qk_eps));
      }
      std::fill_n(A, n * H_ * hd_, 0.0f);
      d::attention_core(proj.data_ptr<float>(), n, l.qkv.N, cos.data(), sin.data(), rd, rd,
                        l.q_norm ? l.q_norm->data_ptr<float>() : nullptr,
                        l.k_norm ? l.k_norm->data_ptr<float>() : nullptr, static_cast<float>(l.qk_eps),
                        k_all.data_ptr<float>() + i * layer_slots, v_all.data_ptr<float>() + i * layer_slots, hd_, ws,
                        RS, B, S, pad_index.data_ptr<int64_t>(), Tq, mask ? mask->data_ptr<bool>() : nullptr, H_,
                        Hkv_, A);
      l.o.run(attn, o.data());
      d::add_rms_norm_rows(h.data(), o.data(), l.post_norm.data_ptr<float>(), l.post_eps, n, D, h.data(), X);
      const int64_t width = l.fused_in.N;
      fin.resize(n * width);
      l.fused_in.run(x, fin.data());
      auto w = torch::empty({n, l.r}, opts);
      auto ids = torch::empty({n, l.r}, opts.dtype(torch::kLong));
      d::route_core(fin.data(), n, l.E, width, l.r, l.norm_topk, w.data_ptr<float>(), ids.data_ptr<int64_t>());
      d::ExpertWeights ew{l.gu.data_ptr<float>(), l.gu.stride(0), l.gu.stride(1), l.gu.stride(2),
                          l.down.data_ptr<float>(), l.down.stride(0), l.down.stride(1), l.down.stride(2),
                          l.gu_p ? l.gu_p->data_ptr<float>() : nullptr, l.gu_p ? l.gu_p->stride(0) : 0,
                          l.down_p ? l.down_p->data_ptr<float>() : nullptr, l.down_p ? l.down_p->stride(0) : 0,
                          l.E, l.down.size(2)};
      d::SharedExpert se;
      if (l.shared_down) {
        se.si = fin.data() + l.E;
        se.ld = width;
        se.sd = l.shared_down->data_ptr<float>();
        se.sd_s0 = l.shared_down->stride(0);
        se.sd_s1 = l.shared_down->stride(1);
        se.sd_p = l.shared_down_p ? l.shared_down_p->data_ptr<float>() : nullptr;
        se.Fs = l.shared_down->size(1);
        se.gated = l.gated;
      }
      std::fill(delta.begin(), delta.end(), 0.0f);
      d::moe_core(X, n, D, ew, ids.data_ptr<int64_t>(), w.data_ptr<float>(), l.r, se, delta.data());
      if (routing) {
        ids_out.push_back(ids);
        weights_out.push_back(w);
        if (keep_logits) {
          auto lg = torch::empty({n, l.E}, opts);
          for (int64_t t = 0; t < n; ++t) std::copy_n(fin.data() + t * width, l.E, lg.data_ptr<float>() + t * l.E);
          logits_out.push_back(lg);
        }
      }
    }
    auto h_out = torch::empty({n, D}, opts), hidden = torch::empty({n, D}, opts);
    d::add_rms_norm_rows(h.data(), delta.data(), norm_.data_ptr<float>(), norm_eps_, n, D, h_out.data_ptr<float>(),
                         hidden.data_ptr<float>());
    if (std::find(capture.begin(), capture.end(), nl) != capture.end()) captured.push_back(h_out);
    auto logits = torch::empty({n, lm_head_.N}, opts);
    lm_head_.run(hidden, logits.data_ptr<float>());
    return {logits, hidden, h_out, captured, ids_out, weights_out, logits_out};
  }

 private:
  static std::pair<const void*, int64_t> key(const torch::Tensor& t) {
    return {t.data_ptr(), t.is_inference() ? -1 : static_cast<int64_t>(t._version())};
  }
  static torch::Tensor copy(const std::vector<float>& a, int64_t n, int64_t D, const torch::TensorOptions& opts) {
    auto t = torch::empty({n, D}, opts);
    std::copy_n(a.data(), n * D, t.data_ptr<float>());
    return t;
  }
  void validate(const Layer& l) const {
    const int64_t D = l.in_norm.numel(), width = (H_ + 2 * Hkv_) * hd_;
    check(l.post_norm.numel() == D && l.qkv.K == D && l.qkv.N == width, "qkv [(H + 2 Hkv) hd, D]");
    check(l.o.K == H_ * hd_ && l.o.N == D, "o_proj [D, H hd]");
    check(!l.q_norm == !l.k_norm && (!l.q_norm || (l.q_norm->numel() == hd_ && l.k_norm->numel() == hd_)),
          "q_norm, k_norm [hd] together");
    check(!l.q_norm_full == !l.k_norm_full && !(l.q_norm && l.q_norm_full) &&
              (!l.q_norm_full || (l.q_norm_full->numel() == H_ * hd_ && l.k_norm_full->numel() == Hkv_ * hd_)),
          "q_norm_full [H hd], k_norm_full [Hkv hd] together, not with per-head ones");
    check(l.gu.dim() == 3 && l.down.dim() == 3 && l.gu.size(0) == l.E && l.down.size(0) == l.E &&
              l.gu.size(1) == 2 * l.down.size(2) && l.gu.size(2) == D && l.down.size(1) == D &&
              (l.gu.stride(1) == 1 || l.gu.stride(2) == 1) && (l.down.stride(1) == 1 || l.down.stride(2) == 1),
          "experts gu [E, 2F, D], down [E, D, F], row-major or input-major");
    const int64_t F = l.down.size(2);
    auto packed_ok = [](const c10::optional<torch::Tensor>& p, std::vector<int64_t> lead, int64_t out, int64_t in) {
      return !p || d::is_packed(*p, std::move(lead), out, in);
    };
    check(packed_ok(l.gu_p, {l.E}, 2 * F, D) && packed_ok(l.down_p, {l.E}, D, F), "packed experts");
    check(l.r >= 1 && l.r <= l.E, "1 <= top_r <= E");
    int64_t Fs = 0;
    if (l.shared_down) {
      check(l.shared_down->dim() == 2 && l.shared_down->size(0) == D &&
                l.shared_down->scalar_type() == torch::kFloat &&
                (l.shared_down->stride(0) == 1 || l.shared_down->stride(1) == 1),
            "shared_down [D, Fs] fp32");
      Fs = l.shared_down->size(1);
      check(packed_ok(l.shared_down_p, {}, D, Fs), "packed shared_down");
    }
    check(l.fused_in.K == D && l.fused_in.N == l.E + 2 * Fs + (l.shared_down && l.gated ? 1 : 0),
          "fused input [E + 2 Fs (+1), D]");
  }

  int64_t H_, Hkv_, hd_, D_ = 0;
  std::vector<Layer> layers_;
  torch::Tensor norm_;
  float norm_eps_ = 0;
  Linear lm_head_;
  std::vector<torch::Tensor> sources_;
  std::vector<std::pair<const void*, int64_t>> keys_;
};

inline void bind(py::module_& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<const py::list&, const py::dict&, const std::vector<torch::Tensor>&, int64_t, int64_t, int64_t>())
      .def("valid", &DecoderStack::valid, "whether every source parameter is unchanged since the stack was built")
      .def("forward", &DecoderStack::forward, "one cached forward of n packed tokens over every layer (fp32)",
           py::call_guard<py::gil_scoped_release>());  // no Python object is touched: other threads run meanwhile
}

}  // namespace expertspec::stack
