// Seeded token sampling for a rollout engine (temperature, top-k, top-p, as vLLM applies them) and
// per-token log-probabilities with their gradient (verl's logprobs_from_logits) and the sum of
// squared probabilities the optimal token baseline needs. The random draw of
// a token depends only on (seed, sequence uid, position), never on the batch it was sampled in, so
// a rollout reproduces bit for bit however its requests are batched or sharded.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/counter_rng.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace rollout {

// vLLM's SamplingParams names: temperature 0 is greedy, and so is any temperature below vLLM's
// 1e-5 (_SAMPLING_EPS; dividing by it overflows); top_k <= 0 (vLLM: -1) and top_p = 1 disable the
// filters.
struct SamplingParams {
  static constexpr double kGreedyBelow = 1e-5;
  double temperature = 1.0;
  int top_k = -1;
  double top_p = 1.0;

  void validate() const {
    constexpr const char* fn = "rollout::SamplingParams";
    detail::require(std::isfinite(temperature) && temperature >= 0.0, fn, "temperature must be finite and >= 0, got ",
                    temperature);
    detail::require(top_p > 0.0 && top_p <= 1.0, fn, "top_p must be in (0, 1], got ", top_p);
  }
  bool greedy() const { return temperature < kGreedyBelow; }
};

// A counter-based generator: uniform(seed, stream, counter) is a pure function (SplitMix64
// finaliser over the three keys), so draws need no shared state between threads or ranks.
using CounterRng = mrr::detail::CounterRng;

template <class T>
struct SampledToken {
  std::int32_t token = -1;
  T logprob = 0;           // log softmax(logits / temperature)[token]: what the trainer recomputes (verl)
  T sampling_logprob = 0;  // log of the probability it was drawn with (after top-k / top-p)
};

namespace detail {

// Indices of a row in descending order of value; ties: lower index first (mrr's rule everywhere).
template <class T>
void order_descending(const T* z, int n, std::vector<int>& order) {
  order.resize(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [z](int a, int b) { return z[a] > z[b]; });
}

template <class T>
void check_row(const T* z, int n, const char* fn) {
  mrr::detail::require(n > 0, fn, "the vocabulary is empty");
  for (int i = 0; i < n; ++i)
    if (std::isnan(z[i]) || z[i] == std::numeric_limits<T>::infinity()) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, "logit ", i, " is ", z[i], " (NaN and +inf are not valid logits)");
}

// 1 / temperature in T: finite and non-zero, else a softmax of logits / temperature would be NaN.
template <class T>
T inverse_temperature(double temperature, const char* fn) {
  mrr::detail::require(temperature > 0.0 && std::isfinite(temperature), fn, "temperature must be > 0, got ",
                       temperature);
  const T inv_t = static_cast<T>(1.0 / temperature);
  mrr::detail::require(std::isfinite(inv_t) && inv_t > T(0), fn, "temperature ", temperature,
                       " is outside what the logits' type can divide by (1 / temperature is ", inv_t, ")");
  return inv_t;
}

// The largest of a row's logits scaled by inv_t, after checking the row: finite (a row of only
// -inf, or logits that overflow once scaled, have no softmax).
template <class T>
T scaled_row_max(const T* z, int vocab, T inv_t, Eigen::Index row, const char* fn) {
  check_row(z, vocab, fn);
  T top = -std::numeric_limits<T>::infinity();
  for (int i = 0; i < vocab; ++i)
    top = std::max(top, z[i] * inv_t);
  if (!std::isfinite(top)) [[unlikely]]
    mrr::detail::throw_invalid_argument(fn, "row ", row,
                                        top < T(0) ? " has every logit -inf (no token to take)"
                                                   : ": a logit / temperature overflows (scale the logits down)");
  return top;
}

}  // namespace detail

// Which tokens of one row of logits survive temperature, top-k and top-p, in vLLM's order: top-k on
// the scaled logits, then top-p on the softmax of the survivors (the smallest prefix, in
// descending probability, whose mass reaches top_p; the most likely token is always kept). keep
// gets 1 for survivors. Greedy (temperature 0) keeps the argmax alone. Returns the survivor count.
template <class T>
int sampling_mask(const T* logits, int vocab, const SamplingParams& params, std::vector<std::uint8_t>& keep) {
  constexpr const char* fn = "rollout::sampling_mask";
  params.validate();
  detail::check_row(logits, vocab, fn);
  keep.assign(static_cast<std::size_t>(vocab), 0);
  std::vector<int> order;
  detail::order_descending(logits, vocab, order);
  mrr::detail::require(logits[order[0]] > -std::numeric_limits<T>::infinity(), fn, "every logit is -inf");
  if (params.greedy()) {
    keep[static_cast<std::size_t>(order[0])] = 1;
    return 1;
  }
  int count = vocab;
  for (int i = 0; i < vocab; ++i)
    if (logits[order[static_cast<std::size_t>(i)]] == -std::numeric_limits<T>::infinity()) {
      count = i;
      break;
    }
  // top-k keeps every token tied with the k-th largest, as vLLM's mask (logits < k-th value) does.
  if (params.top_k > 0 && params.top_k < count) {
    const T kth = logits[order[static_cast<std::size_t>(params.top_k - 1)]];
    count = params.top_k;
    while (count < vocab && logits[order[static_cast<std::size_t>(count)]] == kth)
      ++count;
  }
  if (params.top_p < 1.0) {
    const double inv_t = 1.0 / params.temperature;
    const double top = static_cast<double>(logits[order[0]]) * inv_t;
    double total = 0;
    for (int i = 0; i < count; ++i) total += std::exp(static_cast<double>(logits[order[i]]) * inv_t - top);
    double before = 0;
    int kept = 0;
    while (kept < count && (kept == 0 || before < params.top_p)) {
      before += std::exp(static_cast<double>(logits[order[kept]]) * inv_t - top) / total;
      ++kept;
    }
    count = kept;
  }
  for (int i = 0; i < count; ++i) keep[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = 1;
  return count;
}

// Draws one token from a row of logits with the uniform number u in [0, 1): inverse CDF over the
// surviving tokens in index order (softmax of logits / temperature, renormalised over them).
template <class T>
SampledToken<T> sample_token(const T* logits, int vocab, const SamplingParams& params, double u) {
  constexpr const char* fn = "rollout::sample_token";
  mrr::detail::require(u >= 0.0 && u < 1.0, fn, "u must be in [0, 1), got ", u);
  std::vector<std::uint8_t> keep;
  sampling_mask(logits, vocab, params, keep);
  // The full distribution's log-normaliser (temperature 0: scale 1, verl divides by 1e-6 only in
  // its own sampler; the trainer's log-prob is of the unscaled logits then).
  const double inv_t = params.greedy() ? 1.0 : 1.0 / params.temperature;
  double top = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < vocab; ++i) top = std::max(top, static_cast<double>(logits[i]) * inv_t);
  double total = 0, kept_total = 0;
  for (int i = 0; i < vocab; ++i) {
    const double p = std::exp(static_cast<double>(logits[i]) * inv_t - top);
    total += p;
    if (keep[static_cast<std::size_t>(i)] != 0) kept_total += p;
  }
  SampledToken<T> out;
  if (params.greedy()) {
    for (int i = 0; i < vocab; ++i)
      if (keep[static_cast<std::size_t>(i)] != 0) out.token = i;
  } else {
    const double target = u * kept_total;
    double cumulative = 0;
    for (int i = 0; i < vocab; ++i) {
      if (keep[static_cast<std::size_t>(i)] == 0) continue;
      out.token = i;  // the last survivor catches target == kept_total after rounding
      cumulative += std::exp(static_cast<double>(logits[i]) * inv_t - top);
      if (cumulative > target) break;
    }
  }
  const double z = static_cast<double>(logits[out.token]) * inv_t - top;
  out.logprob = static_cast<T>(z - std::log(total));
  out.sampling_logprob = static_cast<T>(params.greedy() ? 0.0 : z - std::log(kept_total));
  return out;
}

// Samples one token per row of logits [rows, vocab]; row r draws uniform(seed, streams[r],
// counters[r]) — e.g. the sequence uid and the position being generated.
template <class T>
std::vector<SampledToken<T>> sample(MatrixRef<T> logits, const SamplingParams& params, std::uint64_t seed,
                                    std::span<const std::uint64_t> streams, std::span<const std::int64_t> counters) {
  constexpr const char* fn = "rollout::sample";
  mrr::detail::require(static_cast<Eigen::Index>(streams.size()) == logits.rows() &&
                           static_cast<Eigen::Index>(counters.size()) == logits.rows(),
                       fn, "need one stream and one counter per row of logits (", logits.rows(), "), got ",
                       streams.size(), " and ", counters.size());
  std::vector<SampledToken<T>> out(static_cast<std::size_t>(logits.rows()));
  for (Eigen::Index r = 0; r < logits.rows(); ++r) {
    const auto i = static_cast<std::size_t>(r);
    out[i] = sample_token(mrr::detail::row_ptr(logits, r), static_cast<int>(logits.cols()), params,
                          CounterRng::uniform(seed, streams[i], static_cast<std::uint64_t>(counters[i])));
  }
  return out;
}

// verl's logprobs_from_logits: log_softmax(logits / temperature)[label] per row (the trainer divides
// the logits by the rollout temperature first, as verl's actor does).
template <class T>
Vector<T> logprobs_from_logits(MatrixRef<T> logits, std::span<const std::int32_t> labels, double temperature = 1.0) {
  constexpr const char* fn = "rollout::logprobs_from_logits";
  mrr::detail::require(static_cast<Eigen::Index>(labels.size()) == logits.rows(), fn, "'labels' has ", labels.size(),
                       " entries for ", logits.rows(), " rows of logits");
  const int vocab = static_cast<int>(logits.cols());
  const T inv_t = detail::inverse_temperature<T>(temperature, fn);
  Vector<T> out(logits.rows());
  for (Eigen::Index r = 0; r < logits.rows(); ++r) {
    const T* z = mrr::detail::row_ptr(logits, r);
    const T top = detail::scaled_row_max(z, vocab, inv_t, r, fn);
    const std::int32_t label = labels[static_cast<std::size_t>(r)];
    mrr::detail::require(label >= 0 && label < vocab, fn, "label ", label, " of row ", r, " outside [0, ", vocab, ")");
    T total = 0;
    for (int i = 0; i < vocab; ++i) total += std::exp(z[i] * inv_t - top);
    out[r] = z[label] * inv_t - top - std::log(total);
  }
  return out;
}

// verl's calculate_sum_pi_squared_from_logits: sum_v pi_v^2 of softmax(logits / temperature) per
// row, the input the optimal token baseline needs (ppo::compute_optimal_token_baseline_advantage),
// computed as sum e_v^2 / (sum e_v)^2 with e_v = exp(z_v / t - max): verl's
// exp(logsumexp(2 z) - 2 logsumexp(z)) without a logarithm. In (0, 1]: 1 / vocab for equal logits,
// 1 for a one-hot distribution.
template <class T>
Vector<T> sum_pi_squared_from_logits(MatrixRef<T> logits, double temperature = 1.0) {
  constexpr const char* fn = "rollout::sum_pi_squared_from_logits";
  const int vocab = static_cast<int>(logits.cols());
  const T inv_t = detail::inverse_temperature<T>(temperature, fn);
  Vector<T> out(logits.rows());
  for (Eigen::Index r = 0; r < logits.rows(); ++r) {
    const T* z = mrr::detail::row_ptr(logits, r);
    const T top = detail::scaled_row_max(z, vocab, inv_t, r, fn);
    T total = 0, squares = 0;
    for (int i = 0; i < vocab; ++i) {
      const T e = std::exp(z[i] * inv_t - top);
      total += e;
      squares += e * e;
    }
    out[r] = squares / (total * total);
  }
  return out;
}

// Gradient of sum_r grad_logprobs[r] * logprobs_from_logits(logits, labels, temperature)[r] w.r.t.
// the logits: grad_logprobs[r] * (onehot(label) - softmax(logits / t)) / t.
template <class T>
RowMatrix<T> logprobs_from_logits_backward(MatrixRef<T> logits, std::span<const std::int32_t> labels,
                                           VectorRef<T> grad_logprobs, double temperature = 1.0) {
  constexpr const char* fn = "rollout::logprobs_from_logits_backward";
  mrr::detail::require(
      static_cast<Eigen::Index>(labels.size()) == logits.rows() && grad_logprobs.size() == logits.rows(), fn,
      "'labels' (", labels.size(), ") and 'grad_logprobs' (", grad_logprobs.size(),
      ") need one entry per row of logits (", logits.rows(), ")");
  const int vocab = static_cast<int>(logits.cols());
  const T inv_t = detail::inverse_temperature<T>(temperature, fn);
  RowMatrix<T> grad(logits.rows(), vocab);
  for (Eigen::Index r = 0; r < logits.rows(); ++r) {
    const T* z = mrr::detail::row_ptr(logits, r);
    const T top = detail::scaled_row_max(z, vocab, inv_t, r, fn);  // the forward's checks
    const std::int32_t label = labels[static_cast<std::size_t>(r)];
    mrr::detail::require(label >= 0 && label < vocab, fn, "label ", label, " of row ", r, " outside [0, ", vocab, ")");
    T total = 0;
    for (int i = 0; i < vocab; ++i) total += std::exp(z[i] * inv_t - top);
    const T g = grad_logprobs[r] * inv_t;
    for (int i = 0; i < vocab; ++i) grad(r, i) = -g * std::exp(z[i] * inv_t - top) / total;
    grad(r, label) += g;
  }
  return grad;
}

}  // namespace rollout
MRR_NAMESPACE_END
