// SPDX-License-Identifier: Apache-2.0
// The synthetic trace model. docs/synth.md is its specification: the formulas, the coefficient
// derivations and the order of random draws below follow it line by line.
#include "synth_model.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "reference.hpp"
#include "rng.hpp"

namespace kvcli {

namespace {

// Stream tags of derive_seed(seed, {layer, kv_head, tag}).
enum : uint64_t { kStreamDirections = 1, kStreamKeys = 2, kStreamQueries = 3, kStreamTargets = 4 };

// Pairs (i, i + d/2) of rotate-half RoPE, fastest first, split into bands (docs/synth.md, "Bands"):
//   noise [0, q)  recency [q, 2q)  needles [2q, 3q)  topics [3q, half - ns)  sink [half - ns, half)
// with q = max(1, half/4) and ns = max(1, q/4). A rotation only mixes the two dims of a pair, so
// components on disjoint pairs stay orthogonal at every relative position: that is what keeps the
// cross-talk between the structured components, and with the token noise, small.
struct Bands {
  int half, rec_lo, needle_lo, topic_lo, topic_hi, sink_lo;
  explicit Bands(int d) : half(d / 2) {
    const int q = std::max(1, half / 4);
    const int ns = std::max(1, q / 4);
    rec_lo = q;
    needle_lo = 2 * q;
    topic_lo = 3 * q;
    sink_lo = half - ns;
    topic_hi = topic_lo < sink_lo ? sink_lo : half;  // tiny heads: topics share the sink pairs
  }
  // Relative amplitude of token noise in dim i: 1 in the noise band, `other` elsewhere.
  double noise_weight(int i, double other) const { return (i % half) < rec_lo ? 1.0 : other; }
};

// A unit vector with i.i.d. normal entries on the dims of pairs [lo, hi), zero elsewhere.
std::vector<double> unit_on(Rng& rng, int d, int lo, int hi) {
  std::vector<double> x(static_cast<size_t>(d), 0.0);
  const int half = d / 2;
  double norm2 = 0.0;
  for (int i = lo; i < hi; ++i) {
    for (int dim : {i, i + half}) {
      x[size_t(dim)] = rng.normal();
      norm2 += x[size_t(dim)] * x[size_t(dim)];
    }
  }
  const double inv = norm2 > 0.0 ? 1.0 / std::sqrt(norm2) : 0.0;
  for (double& v : x) v *= inv;
  return x;
}

// A unit vector with equal weight 1/n on each of the n pairs [lo, hi) and a uniform random phase
// per pair, so that r . R(delta) r = mean over the pairs of cos(delta * theta_p): the flattest
// RoPE kernel those pairs can make (random weights would fluctuate more at long distance).
std::vector<double> flat_on(Rng& rng, int d, int lo, int hi) {
  std::vector<double> x(static_cast<size_t>(d), 0.0);
  const int half = d / 2;
  const double amp = 1.0 / std::sqrt(double(hi - lo));
  for (int i = lo; i < hi; ++i) {
    const double phase = rng.uniform(0.0, 6.283185307179586476925);
    x[size_t(i)] = amp * std::cos(phase);
    x[size_t(i + half)] = amp * std::sin(phase);
  }
  return x;
}

// Removes from x its components along the (unit, orthogonal) vectors of `basis` and renormalises;
// leaves x unchanged if almost nothing would remain (the band is full).
bool orthogonalize(std::vector<double>& x, const std::vector<std::vector<double>>& basis) {
  std::vector<double> y = x;
  for (const auto& b : basis) {
    double dot = 0.0;
    for (size_t i = 0; i < y.size(); ++i) dot += y[i] * b[i];
    for (size_t i = 0; i < y.size(); ++i) y[i] -= dot * b[i];
  }
  double n2 = 0.0;
  for (double v : y) n2 += v * v;
  if (n2 < 1e-6) return false;
  for (double& v : y) v /= std::sqrt(n2);
  x = std::move(y);
  return true;
}

class Rope {
 public:
  Rope(int d, double theta) : half_(d / 2), inv_freq_(size_t(d / 2)), cos_(size_t(d / 2)), sin_(size_t(d / 2)) {
    for (int i = 0; i < half_; ++i) inv_freq_[size_t(i)] = std::pow(theta, -2.0 * i / d);
  }
  // Prepares the rotation of position pos.
  void at(int64_t pos) {
    for (int i = 0; i < half_; ++i) {
      const double a = double(pos) * inv_freq_[size_t(i)];
      cos_[size_t(i)] = std::cos(a);
      sin_[size_t(i)] = std::sin(a);
    }
  }
  // x <- R(pos) x (rotate-half convention).
  void apply(double* x) const {
    for (int i = 0; i < half_; ++i) {
      const double x0 = x[i], x1 = x[i + half_];
      x[i] = x0 * cos_[size_t(i)] - x1 * sin_[size_t(i)];
      x[i + half_] = x1 * cos_[size_t(i)] + x0 * sin_[size_t(i)];
    }
  }
  std::vector<double> rotated(std::vector<double> x, int64_t pos) {
    at(pos);
    apply(x.data());
    return x;
  }

 private:
  int half_;
  std::vector<double> inv_freq_, cos_, sin_;
};

void axpy(double a, const std::vector<double>& x, double* y) {
  for (size_t i = 0; i < x.size(); ++i) y[i] += a * x[i];
}

void store_row(void* base, DType t, int64_t offset, const double* x, int d) {
  for (int i = 0; i < d; ++i) store_elem(base, t, size_t(offset + i), float(x[i]));
}

// Everything one (layer, KV head) task needs to know about token positions.
struct Layout {
  int64_t S, P, T;
  uint32_t M;
  // Segment of token j: -1 for sinks, 0..M-1 in the prompt, M for decode tokens.
  int64_t segment(int64_t j) const {
    if (j < S) return -1;
    if (j < P) return (j - S) * M / (P - S);
    return M;
  }
  int64_t midpoint(int64_t m) const {
    if (m < int64_t(M)) return S + ((2 * m + 1) * (P - S)) / (2 * int64_t(M));
    return P + (T - P) / 2;
  }
};

// Generates one KV head g of one layer, and the query heads of its group.
void generate_group(const SynthConfig& cfg, uint32_t layer, uint32_t g, SynthLayer& out) {
  const int d = int(cfg.head_dim);
  const Bands bands(d);
  const Layout lay{int64_t(cfg.sinks), cfg.prefill, cfg.total(), cfg.segments};
  const uint32_t group = cfg.q_heads / cfg.kv_heads;
  const uint32_t N = cfg.needle_count();
  const int64_t T = cfg.total();

  // Coefficients (docs/synth.md, "Coefficients").
  const double s = 1.0 / std::sqrt(double(d));
  std::vector<double> w(static_cast<size_t>(d));  // noise amplitude per dim
  double w4 = 0.0;
  for (int i = 0; i < d; ++i) {
    w[size_t(i)] = bands.noise_weight(i, cfg.band_noise);
    w4 += std::pow(w[size_t(i)], 4) / d;
  }
  const double sigma_k = std::sqrt(cfg.noise_logit * d / std::sqrt(w4) / cfg.qk_scale_ratio);
  const double sigma_q = cfg.qk_scale_ratio * sigma_k;
  const double m_k = cfg.key_offset * sigma_k, m_q = cfg.query_offset * sigma_q;
  const double a_s = std::sqrt(cfg.sink_logit / s);
  const double a_c = std::sqrt(cfg.topic_logit / s);
  const double a_r = std::sqrt(cfg.recency_logit / s);
  const double a_n = std::sqrt(cfg.needle_logit / s);
  const double inv_sqrt_d = 1.0 / std::sqrt(double(d));

  // Directions, in this order (the order of draws is part of the format of a seed).
  Rng dir(derive_seed(cfg.seed, {layer, g, kStreamDirections}));
  const auto mu_k = unit_on(dir, d, 0, bands.rec_lo);
  const auto u = unit_on(dir, d, bands.sink_lo, bands.half);
  std::vector<std::vector<double>> topic(cfg.segments + 1);
  std::vector<std::vector<double>> slow_basis = {u};
  for (auto& c : topic) {
    c = unit_on(dir, d, bands.topic_lo, bands.topic_hi);
    if (orthogonalize(c, slow_basis)) {
      slow_basis.push_back(c);
    } else {
      orthogonalize(c, {u});  // the band is full: only keep clear of the sink direction
    }
  }
  const auto r = flat_on(dir, d, bands.rec_lo, bands.needle_lo);
  const auto mu_v = unit_on(dir, d, 0, bands.half);
  std::vector<std::vector<double>> vtopic(cfg.segments + 1);
  for (auto& wt : vtopic) wt = unit_on(dir, d, 0, bands.half);
  std::vector<NeedleSpan> spans(N);
  std::vector<std::vector<double>> z(N), y(N);
  for (uint32_t n = 0; n < N; ++n) {
    spans[n].len = cfg.needle_len;
    spans[n].start = lay.S + int64_t(dir.below(uint64_t(lay.P - lay.S - cfg.needle_len + 1)));
    z[n] = unit_on(dir, d, bands.needle_lo, bands.topic_lo);
    y[n] = unit_on(dir, d, 0, bands.half);
  }
  std::vector<std::vector<double>> mu_q(group);
  std::vector<double> gain(group);
  for (uint32_t h = 0; h < group; ++h) {
    mu_q[h] = unit_on(dir, d, 0, bands.rec_lo);
    gain[h] = dir.uniform(1.0 - cfg.head_spread, 1.0 + cfg.head_spread);
  }

  // Needle tokens in position order, for the key pass.
  std::vector<std::pair<int64_t, uint32_t>> cover;
  for (uint32_t n = 0; n < N; ++n)
    for (int64_t j = spans[n].start; j < spans[n].start + spans[n].len; ++j) cover.emplace_back(j, n);
  std::sort(cover.begin(), cover.end());

  Rope rope(d, cfg.rope_theta);
  std::vector<double> x(static_cast<size_t>(d));

  // Keys and values, token by token.
  Rng krng(derive_seed(cfg.seed, {layer, g, kStreamKeys}));
  size_t ci = 0;
  for (int64_t j = 0; j < T; ++j) {
    const int64_t seg = lay.segment(j);
    for (int i = 0; i < d; ++i)
      x[size_t(i)] = m_k * mu_k[size_t(i)] + sigma_k * w[size_t(i)] * krng.normal() * inv_sqrt_d;
    axpy(a_r, r, x.data());
    if (seg < 0)
      axpy(a_s, u, x.data());
    else
      axpy(a_c, topic[size_t(seg)], x.data());
    size_t cj = ci;
    while (cj < cover.size() && cover[cj].first == j) axpy(a_n, z[cover[cj++].second], x.data());
    rope.at(j);
    rope.apply(x.data());
    store_row(out.k.get(), cfg.dtype, (j * cfg.kv_heads + g) * d, x.data(), d);

    for (int i = 0; i < d; ++i)
      x[size_t(i)] = cfg.value_offset * mu_v[size_t(i)] + cfg.value_noise * krng.normal() * inv_sqrt_d;
    if (seg < 0) {
      for (double& xi : x) xi *= cfg.sink_value_scale;
    } else {
      axpy(cfg.value_topic, vtopic[size_t(seg)], x.data());
      for (size_t c = ci; c < cj; ++c) axpy(cfg.needle_value, y[cover[c].second], x.data());
    }
    ci = cj;
    store_row(out.v.get(), cfg.dtype, (j * cfg.kv_heads + g) * d, x.data(), d);
  }

  // Post-RoPE retrieval components: the query at t carries R(t) R(a - t) w = R(a) w for a
  // component w anchored at position a (sinks at 0, topics at their segment midpoint, needles at
  // their centre), which is how a retrieval head matches content at a distance under RoPE.
  const double b_s = a_s, b_c = a_c, b_n = a_n;
  std::vector<double> sink_q = u;  // R(0) = I
  for (double& v : sink_q) v *= b_s;
  std::vector<std::vector<double>> topic_q(cfg.segments + 1), needle_q(N);
  for (uint32_t m = 0; m <= cfg.segments; ++m) topic_q[m] = rope.rotated(topic[m], lay.midpoint(m));
  for (uint32_t n = 0; n < N; ++n) needle_q[n] = rope.rotated(z[n], spans[n].start + spans[n].len / 2);

  // Needles by end position: those with end <= t lie wholly before query t.
  std::vector<uint32_t> by_end(N);
  std::iota(by_end.begin(), by_end.end(), 0u);
  std::stable_sort(by_end.begin(), by_end.end(), [&](uint32_t a, uint32_t b) {
    return spans[a].start + spans[a].len < spans[b].start + spans[b].len;
  });

  Rng qrng(derive_seed(cfg.seed, {layer, g, kStreamQueries}));
  Rng trng(derive_seed(cfg.seed, {layer, g, kStreamTargets}));
  std::vector<uint32_t> targets;
  std::vector<double> retrieve(static_cast<size_t>(d));
  size_t eligible = 0;
  for (int64_t t = 0; t < T; ++t) {
    while (eligible < N && spans[by_end[eligible]].start + spans[by_end[eligible]].len <= t) ++eligible;
    if (eligible > 0) {
      const double draw = trng.uniform();
      if (targets.empty() || draw < cfg.retarget) {
        const uint64_t count = 1 + trng.below(cfg.max_targets);
        targets.clear();
        for (uint64_t i = 0; i < count; ++i) targets.push_back(by_end[trng.below(eligible)]);
        std::sort(targets.begin(), targets.end());
        targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
      }
    }
    std::fill(retrieve.begin(), retrieve.end(), 0.0);
    std::vector<int64_t> segs;
    for (uint32_t n : targets) {
      axpy(b_n, needle_q[n], retrieve.data());
      segs.push_back(lay.segment(spans[n].start + spans[n].len / 2));
    }
    std::sort(segs.begin(), segs.end());
    segs.erase(std::unique(segs.begin(), segs.end()), segs.end());
    for (int64_t m : segs) axpy(b_c, topic_q[size_t(m)], retrieve.data());

    rope.at(t);
    for (uint32_t hh = 0; hh < group; ++hh) {
      const uint32_t h = g * group + hh;
      for (int i = 0; i < d; ++i)
        x[size_t(i)] = m_q * mu_q[hh][size_t(i)] + sigma_q * w[size_t(i)] * qrng.normal() * inv_sqrt_d;
      axpy(a_r * (2.0 - gain[hh]), r, x.data());  // heads that retrieve less look more locally
      rope.apply(x.data());
      axpy(1.0, sink_q, x.data());
      axpy(gain[hh], retrieve, x.data());
      store_row(out.q.get(), cfg.dtype, (t * cfg.q_heads + h) * d, x.data(), d);
    }
  }
  out.needles[g] = std::move(spans);
}

}  // namespace

std::vector<uint32_t> SynthConfig::present_layers() const {
  if (!present.empty()) {
    auto p = present;
    std::sort(p.begin(), p.end());
    return p;
  }
  std::vector<uint32_t> all(layers);
  std::iota(all.begin(), all.end(), 0u);
  return all;
}

void validate(const SynthConfig& c) {
  auto fail = [](const std::string& m) { throw UsageError(m); };
  if (c.layers < 1) fail("--layers must be >= 1");
  if (c.q_heads < 1 || c.kv_heads < 1) fail("--q-heads and --kv-heads must be >= 1");
  if (c.q_heads % c.kv_heads != 0)
    fail(strfmt("--q-heads (%u) must be a multiple of --kv-heads (%u)", c.q_heads, c.kv_heads));
  if (c.head_dim < 8 || c.head_dim > 256 || c.head_dim % 2 != 0)
    fail(strfmt("--head-dim must be even and in [8, 256], got %u", c.head_dim));
  if (c.segments < 1) fail("--segments must be >= 1");
  if (c.prefill < 1) fail("--prefill must be >= 1");
  if (c.decode < 0) fail("--decode must be >= 0");
  if (c.total() > int64_t(INT32_MAX)) fail("--prefill + --decode must fit in int32");
  const int64_t body = c.prefill - int64_t(c.sinks);
  if (body < int64_t(c.segments))
    fail(strfmt("--prefill (%lld) must hold --sinks (%u) plus at least one token per segment (%u)",
                static_cast<long long>(c.prefill), c.sinks, c.segments));
  if (c.needle_len < 1) fail("--needle-len must be >= 1");
  if (c.needle_count() > 0 && body < int64_t(c.needle_len))
    fail("--prefill minus --sinks must be at least --needle-len");
  if (c.max_targets < 1) fail("--max-targets must be >= 1");
  if (!(c.retarget >= 0.0 && c.retarget <= 1.0)) fail("--retarget must be in [0, 1]");
  if (!(c.head_spread >= 0.0 && c.head_spread < 1.0)) fail("--head-spread must be in [0, 1)");
  if (!(c.qk_scale_ratio > 0.0)) fail("--qk-scale-ratio must be > 0");
  if (!(c.rope_theta > 1.0)) fail("--rope-theta must be > 1");
  for (auto [name, v] : {std::pair{"--sink-logit", c.sink_logit}, {"--topic-logit", c.topic_logit},
                         {"--needle-logit", c.needle_logit}, {"--recency-logit", c.recency_logit},
                         {"--noise-logit", c.noise_logit}, {"--key-offset", c.key_offset},
                         {"--query-offset", c.query_offset}, {"--value-offset", c.value_offset},
                         {"--band-noise", c.band_noise},
                         {"--value-noise", c.value_noise}, {"--value-topic", c.value_topic},
                         {"--needle-value", c.needle_value},
                         {"--sink-value-scale", c.sink_value_scale}})
    if (!(v >= 0.0) || !std::isfinite(v)) fail(std::string(name) + " must be finite and >= 0");
  if (!(c.noise_logit > 0.0)) fail("--noise-logit must be > 0");
  std::vector<uint32_t> p = c.present;
  std::sort(p.begin(), p.end());
  if (std::adjacent_find(p.begin(), p.end()) != p.end()) fail("--present lists a layer twice");
  for (uint32_t l : p)
    if (l >= c.layers) fail(strfmt("--present: layer %u is not below --layers (%u)", l, c.layers));
}

StridedArray SynthTrace::q(size_t i) const {
  return StridedArray(layers[i].q.get(), cfg.dtype, cfg.total(), cfg.q_heads, cfg.head_dim);
}
StridedArray SynthTrace::k(size_t i) const {
  return StridedArray(layers[i].k.get(), cfg.dtype, cfg.total(), cfg.kv_heads, cfg.head_dim);
}
StridedArray SynthTrace::v(size_t i) const {
  return StridedArray(layers[i].v.get(), cfg.dtype, cfg.total(), cfg.kv_heads, cfg.head_dim);
}
uint64_t SynthTrace::bytes() const {
  return uint64_t(layers.size()) * uint64_t(cfg.total()) * (cfg.q_heads + 2ull * cfg.kv_heads) *
         cfg.head_dim * dtype_size(cfg.dtype);
}

SynthTrace synth_generate(const SynthConfig& cfg, unsigned threads) {
  validate(cfg);
  SynthTrace tr;
  tr.cfg = cfg;
  const int64_t T = cfg.total();
  const size_t es = dtype_size(cfg.dtype);
  for (uint32_t l : cfg.present_layers()) {
    SynthLayer sl;
    sl.layer = l;
    sl.q = std::make_unique_for_overwrite<char[]>(size_t(T) * cfg.q_heads * cfg.head_dim * es);
    sl.k = std::make_unique_for_overwrite<char[]>(size_t(T) * cfg.kv_heads * cfg.head_dim * es);
    sl.v = std::make_unique_for_overwrite<char[]>(size_t(T) * cfg.kv_heads * cfg.head_dim * es);
    sl.needles.resize(cfg.kv_heads);
    tr.layers.push_back(std::move(sl));
  }
  const size_t tasks = tr.layers.size() * cfg.kv_heads;
  parallel_for(tasks, threads, [&](size_t i) {
    SynthLayer& sl = tr.layers[i / cfg.kv_heads];
    generate_group(cfg, sl.layer, uint32_t(i % cfg.kv_heads), sl);
  });
  // Token ids carry no meaning; they only exercise the trace's optional `tokens` tensor.
  tr.tokens.resize(size_t(T));
  for (int64_t t = 0; t < T; ++t) {
    uint64_t st = derive_seed(cfg.seed, {uint64_t(t), 5});
    tr.tokens[size_t(t)] = t == 0 ? 1 : int32_t(2 + splitmix64(st) % 31998);
  }
  return tr;
}

std::string synth_source(const SynthConfig& c) {
  return strfmt(
      "kvsieve synth: seed=%llu sinks=%u sink_logit=%g sink_value_scale=%g segments=%u "
      "topic_logit=%g value_topic=%g needles=%u needle_len=%u needle_logit=%g needle_value=%g "
      "max_targets=%u retarget=%g recency_logit=%g noise_logit=%g qk_scale_ratio=%g key_offset=%g "
      "query_offset=%g band_noise=%g value_offset=%g value_noise=%g head_spread=%g rope_theta=%g",
      static_cast<unsigned long long>(c.seed), c.sinks, c.sink_logit, c.sink_value_scale, c.segments,
      c.topic_logit, c.value_topic, c.needle_count(), c.needle_len, c.needle_logit, c.needle_value,
      c.max_targets, c.retarget, c.recency_logit, c.noise_logit, c.qk_scale_ratio, c.key_offset,
      c.query_offset, c.band_noise, c.value_offset, c.value_noise, c.head_spread, c.rope_theta);
}

void synth_write(const SynthTrace& tr, const std::string& path) {
  const SynthConfig& c = tr.cfg;
  const std::string source = synth_source(c);
  kvs_trace_info info;
  kvs_trace_info_init(&info);
  info.num_layers = c.layers;
  info.num_q_heads = c.q_heads;
  info.num_kv_heads = c.kv_heads;
  info.head_dim = c.head_dim;
  info.prefill_len = c.prefill;
  info.total_len = c.total();
  info.num_present_layers = uint32_t(tr.layers.size());
  info.softmax_scale = float(1.0 / std::sqrt(double(c.head_dim)));
  info.dtype = int32_t(c.dtype);
  info.source = source.c_str();

  const int64_t T = c.total();
  std::vector<uint32_t> ids;
  std::vector<Tensor> q, k, v;
  for (const auto& sl : tr.layers) {
    ids.push_back(sl.layer);
    q.emplace_back(sl.q.get(), c.dtype, std::initializer_list<int64_t>{T, c.q_heads, c.head_dim});
    k.emplace_back(sl.k.get(), c.dtype, std::initializer_list<int64_t>{T, c.kv_heads, c.head_dim});
    v.emplace_back(sl.v.get(), c.dtype, std::initializer_list<int64_t>{T, c.kv_heads, c.head_dim});
  }
  std::vector<const kvs_tensor*> qp, kp, vp;
  for (size_t i = 0; i < ids.size(); ++i) {
    qp.push_back(q[i].get());
    kp.push_back(k[i].get());
    vp.push_back(v[i].get());
  }
  // tokens: [T] int32 (not a float dtype, so described by hand)
  int64_t tok_shape[1] = {T};
  kvs_tensor tok{};
  tok.data = const_cast<int32_t*>(tr.tokens.data());
  tok.device = kvs_device{KVS_DEVICE_CPU, 0};
  tok.ndim = 1;
  tok.dtype = kvs_dtype{KVS_DTYPE_CODE_INT, 32, 1};
  tok.shape = tok_shape;
  tok.strides = nullptr;
  tok.byte_offset = 0;
  check(kvs_trace_write(path.c_str(), &info, ids.data(), ids.size(), qp.data(), kp.data(), vp.data(), &tok),
        "writing trace '" + path + "'");
}

void add_synth_shape_options(CLI::App* cmd, SynthConfig& c, std::string& dtype) {
  cmd->add_option("--layers", c.layers, "number of layers of the model");
  cmd->add_option("--q-heads", c.q_heads, "query heads");
  cmd->add_option("--kv-heads", c.kv_heads, "KV heads (divides --q-heads)");
  cmd->add_option("--head-dim", c.head_dim, "head dimension (even, 8..256)");
  cmd->add_option("--prefill", c.prefill, "prompt tokens");
  cmd->add_option("--decode", c.decode, "decode steps after the prompt");
  cmd->add_option("--dtype", dtype, "stored dtype: f32, f16 or bf16");
  cmd->add_option("--seed", c.seed, "random seed (the trace is a pure function of it and the knobs)");
}

void add_synth_model_options(CLI::App* cmd, SynthConfig& c) {
  const char* g = "Structure (docs/synth.md)";
  cmd->add_option("--sinks", c.sinks, "attention-sink tokens at the start")->group(g);
  cmd->add_option("--sink-logit", c.sink_logit, "logit boost of a sink key for every query")->group(g);
  cmd->add_option("--sink-value-scale", c.sink_value_scale, "scale of sink values (sinks carry little)")->group(g);
  cmd->add_option("--segments", c.segments, "topic segments the prompt is split into")->group(g);
  cmd->add_option("--topic-logit", c.topic_logit, "logit boost of a targeted segment's keys")->group(g);
  cmd->add_option("--value-topic", c.value_topic, "norm of the segment's topic component in values")->group(g);
  cmd->add_option("--needles", c.needles, "planted needle spans per KV head (0 = 2 per segment)")->group(g);
  cmd->add_option("--needle-len", c.needle_len, "tokens per needle span")->group(g);
  cmd->add_option("--needle-logit", c.needle_logit, "logit boost of a targeted needle's keys")->group(g);
  cmd->add_option("--needle-value", c.needle_value, "norm of a needle's component in its values")->group(g);
  cmd->add_option("--max-targets", c.max_targets, "needles a query retrieves at once (1..N)")->group(g);
  cmd->add_option("--retarget", c.retarget, "probability per token of drawing new targets")->group(g);
  cmd->add_option("--recency-logit", c.recency_logit, "logit boost of the current token's key (decays with RoPE distance)")->group(g);
  cmd->add_option("--noise-logit", c.noise_logit, "std of the token-noise part of a logit")->group(g);
  cmd->add_option("--qk-scale-ratio", c.qk_scale_ratio, "query noise scale / key noise scale")->group(g);
  cmd->add_option("--key-offset", c.key_offset, "norm of the key mean, in key-noise units")->group(g);
  cmd->add_option("--query-offset", c.query_offset, "norm of each query head's mean, in query-noise units")->group(g);
  cmd->add_option("--band-noise", c.band_noise, "token-noise amplitude in the needle and slow bands, relative to the fast band")->group(g);
  cmd->add_option("--value-offset", c.value_offset, "norm of the value mean")->group(g);
  cmd->add_option("--value-noise", c.value_noise, "norm of the per-token value noise")->group(g);
  cmd->add_option("--head-spread", c.head_spread, "query heads' retrieval gain is uniform in 1 +- this")->group(g);
  cmd->add_option("--rope-theta", c.rope_theta, "RoPE base")->group(g);
}

SynthStats synth_stats(const SynthTrace& tr, int64_t max_steps, unsigned threads) {
  const SynthConfig& c = tr.cfg;
  SynthStats st;
  // Sample decode steps evenly (or the last prompt tokens when there is no decode step).
  std::vector<int64_t> steps;
  const int64_t first = c.decode > 0 ? c.prefill : std::max<int64_t>(0, c.prefill - max_steps);
  const int64_t count = c.total() - first;
  const int64_t take = std::min(count, std::max<int64_t>(1, max_steps));
  for (int64_t i = 0; i < take; ++i) steps.push_back(first + i * count / take);
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  const uint32_t group = c.q_heads / c.kv_heads;
  ExactAttention ex;
  double samples = 0;
  std::vector<double> sorted;
  std::vector<char> is_needle;
  for (size_t li = 0; li < tr.layers.size(); ++li) {
    const auto q = tr.q(li), k = tr.k(li), v = tr.v(li);
    for (int64_t t : steps) {
      exact_attention(q, k, v, t, scale, false, threads, ex);
      const int64_t n = ex.n;
      for (uint32_t h = 0; h < c.q_heads; ++h) {
        const double* p = ex.probs(h);
        is_needle.assign(size_t(n), 0);
        for (const auto& sp : tr.layers[li].needles[h / group])
          for (int64_t j = sp.start; j < std::min(n, sp.start + sp.len); ++j) is_needle[size_t(j)] = 1;
        double bs = 0, bs2 = 0, bn = 0;
        for (int64_t j = 0; j < n; ++j) {
          const bool sink = j < int64_t(c.sinks), recent = j > t - 64, needle = is_needle[size_t(j)] != 0;
          if (sink) st.sink_mass += p[j];
          if (recent) st.recent_mass += p[j];
          if (needle) st.needle_mass += p[j];
          if (!sink && !recent && !needle && p[j] > 0) {
            const double logit = std::log(p[j]);  // + lse, which cancels in the std
            bs += logit;
            bs2 += logit * logit;
            bn += 1;
          }
        }
        if (bn > 1) st.background_logit_std += std::sqrt(std::max(0.0, bs2 / bn - (bs / bn) * (bs / bn)));
        sorted.assign(p, p + n);
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        const auto top = [&](double frac) {
          const int64_t kk = std::max<int64_t>(1, int64_t(std::ceil(frac * double(n))));
          return std::accumulate(sorted.begin(), sorted.begin() + kk, 0.0);
        };
        st.top1_mass += top(0.01);
        st.top5_mass += top(0.05);
        st.max_prob += sorted[0];
        samples += 1;
      }
    }
  }
  st.steps = int64_t(steps.size());
  if (samples > 0) {
    for (double* x : {&st.sink_mass, &st.needle_mass, &st.recent_mass, &st.top1_mass, &st.top5_mass,
                      &st.max_prob, &st.background_logit_std})
      *x /= samples;
  }
  return st;
}

}  // namespace kvcli
