// The device views of permute, combine, their backward and capacity dropping (DESIGN.md section
// 11) on Thrust's OpenMP system, on buffers this test owns: int32 and int64 ids, strided rows,
// results equal to the CPU functions bit for bit, the backward against the CPU and the explicit
// formula, a bad int64 id (2^32 + e) rejected, and no allocation once the workspace is given
// (operator new is replaced in this translation unit and counted).
#include <mrr/router.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/capacity.hpp>
#include <mrr/thrust/permute.hpp>

#include <doctest/doctest.h>

#include "permute_views_body.hpp"

#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

namespace {

std::atomic<long> g_allocations{0};

}  // namespace

// Counts every allocation of this program (GCC sees malloc/free pair with new/delete here).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

namespace dev = mrr::device;

struct Problem {
  long tokens = 777, hidden = 300, stride = 320;  // rows padded: the views take a row stride
  int experts = 16, k = 4;
  mrr::Routing<float> routing;
  std::vector<float> x, expert_out, grad_out;  // [tokens | rows, stride]
};

Problem make_problem(double capacity_factor = 0) {
  Problem p;
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> z(p.tokens, p.experts);
  for (Eigen::Index i = 0; i < z.size(); ++i) z.data()[i] = n(rng);
  auto cfg = mrr::presets::qwen3_moe(p.experts, p.k, true);
  if (capacity_factor > 0) cfg.capacity_factor = capacity_factor;
  p.routing = mrr::TopKRouter<float>(cfg).route(z);
  auto fill = [&](std::vector<float>& v, long rows) {
    v.assign(static_cast<std::size_t>(rows * p.stride), -99.f);  // padding must never be read into results
    for (long r = 0; r < rows; ++r)
      for (long h = 0; h < p.hidden; ++h) v[static_cast<std::size_t>(r * p.stride + h)] = n(rng);
  };
  fill(p.x, p.tokens);
  fill(p.expert_out, p.tokens * p.k);
  fill(p.grad_out, p.tokens);
  return p;
}

// The [rows, hidden] block of a strided buffer as a dense Eigen matrix (for the CPU functions).
mrr::RowMatrix<float> dense(const std::vector<float>& v, long rows, long hidden, long stride) {
  mrr::RowMatrix<float> m(rows, hidden);
  for (long r = 0; r < rows; ++r)
    for (long h = 0; h < hidden; ++h) m(r, h) = v[static_cast<std::size_t>(r * stride + h)];
  return m;
}

bool same_block(const std::vector<float>& v, long stride, const mrr::RowMatrix<float>& m) {
  for (Eigen::Index r = 0; r < m.rows(); ++r)
    for (Eigen::Index c = 0; c < m.cols(); ++c)
      if (v[static_cast<std::size_t>(r * stride + c)] != m(r, c)) return false;
  return true;
}

// Every buffer a view call needs, owned here and sized once.
template <class Id>
struct Buffers {
  std::vector<Id> ids;
  std::vector<std::int32_t> source_token, row_of_slot, offsets;
  std::vector<std::uint8_t> workspace;
  dev::DeviceStatus status;
  std::vector<float> permuted, combined, grad_x, grad_expert_out, grad_weights;
  dev::PermutationView perm;
  explicit Buffers(const Problem& p) {
    const long slots = p.tokens * p.k;
    ids.assign(p.routing.ids.data(), p.routing.ids.data() + slots);
    source_token.resize(static_cast<std::size_t>(slots));
    row_of_slot.resize(static_cast<std::size_t>(slots));
    offsets.resize(static_cast<std::size_t>(p.experts) + 1);
    workspace.resize(dev::permutation_workspace_bytes(p.tokens, p.k, p.experts));
    permuted.assign(static_cast<std::size_t>(slots * p.stride), 0.f);
    combined.assign(static_cast<std::size_t>(p.tokens * p.stride), 0.f);
    grad_x.assign(combined.size(), 0.f);
    grad_expert_out.assign(permuted.size(), 0.f);
    grad_weights.assign(static_cast<std::size_t>(slots), 0.f);
    perm = {source_token.data(), row_of_slot.data(), offsets.data(), p.tokens, p.k, p.experts};
  }
};

// The whole forward and backward through the views (the body the CUDA test runs too); returns
// the allocations it made.
template <class Id>
long run_views(const Problem& p, Buffers<Id>& b, const std::uint8_t* kept) {
  mrr::test::PermuteViewCall<Id> c;
  c.tokens = p.tokens;
  c.hidden = p.hidden;
  c.stride = p.stride;
  c.experts = p.experts;
  c.k = p.k;
  c.ids = b.ids.data();
  c.kept = kept;
  c.x = p.x.data();
  c.expert_out = p.expert_out.data();
  c.grad_out = p.grad_out.data();
  c.weights = p.routing.weights.data();
  c.source_token = b.source_token.data();
  c.row_of_slot = b.row_of_slot.data();
  c.offsets = b.offsets.data();
  c.workspace = b.workspace.data();
  c.workspace_bytes = b.workspace.size();
  c.status = &b.status;
  c.permuted = b.permuted.data();
  c.combined = b.combined.data();
  c.grad_x = b.grad_x.data();
  c.grad_expert_out = b.grad_expert_out.data();
  c.grad_weights = b.grad_weights.data();
  const long before = g_allocations.load();
  mrr::test::run_permute_views(c, mrr::device::Execution{});
  return g_allocations.load() - before;
}

template <class Id>
void check_against_cpu(const Problem& p, const Buffers<Id>& b) {
  const auto perm = mrr::make_expert_permutation(p.routing, p.experts);
  REQUIRE(b.offsets.back() == perm.rows());
  CHECK(std::equal(perm.source_token.begin(), perm.source_token.end(), b.source_token.begin()));
  CHECK(std::equal(perm.row_of_slot.data(), perm.row_of_slot.data() + perm.row_of_slot.size(), b.row_of_slot.begin()));
  const auto x = dense(p.x, p.tokens, p.hidden, p.stride);
  CHECK(same_block(b.permuted, p.stride, mrr::permute_tokens<float>(x, perm)));
  const auto y = dense(p.expert_out, perm.rows(), p.hidden, p.stride);
  CHECK(same_block(b.combined, p.stride, mrr::combine<float>(y, p.routing, perm)));
  CHECK(same_block(b.grad_x, p.stride, mrr::permute_tokens_backward<float>(y, perm)));
  const auto g = mrr::combine_backward<float>(dense(p.grad_out, p.tokens, p.hidden, p.stride), y, p.routing, perm);
  CHECK(same_block(b.grad_expert_out, p.stride, g.expert_out));
  CHECK(std::equal(g.weights.data(), g.weights.data() + g.weights.size(), b.grad_weights.begin()));
  // The explicit formula of combine's backward: d<g, out>/dw[t, j] = <g[t], y[row]>, d/dy[row] = w g[t].
  double worst_rows = 0, worst_weights = 0;
  for (long t = 0; t < p.tokens; ++t)
    for (int j = 0; j < p.k; ++j) {
      const auto r = perm.row_of_slot(t, j);
      const auto s = static_cast<std::size_t>(t * p.k + j);
      if (r < 0) {
        CHECK(b.grad_weights[s] == 0.f);
        continue;
      }
      double dot = 0;
      for (long h = 0; h < p.hidden; ++h) {
        const auto g_th = static_cast<double>(p.grad_out[static_cast<std::size_t>(t * p.stride + h)]);
        dot += g_th * static_cast<double>(y(r, h));
        worst_rows = std::max(worst_rows, std::abs(static_cast<double>(b.grad_expert_out[static_cast<std::size_t>(
                                                       r * p.stride + h)]) -
                                                   static_cast<double>(p.routing.weights(t, j)) * g_th));
      }
      worst_weights = std::max(worst_weights, std::abs(dot - static_cast<double>(b.grad_weights[s])));
    }
  CHECK(worst_rows < 1e-5);     // one fp32 rounding of w * g (|g| < 6)
  CHECK(worst_weights < 1e-3);  // a 300-term fp32 dot product against the double one
}

}  // namespace

TEST_CASE_TEMPLATE("device views: permute, combine and their backward equal the CPU's bit for bit, on strided rows",
                   Id, std::int32_t, std::int64_t) {
  const Problem p = make_problem();
  Buffers<Id> b(p);
  (void)run_views(p, b, nullptr);  // the first call may start the OpenMP thread pool
  std::fill(b.combined.begin(), b.combined.end(), 0.f);
  CHECK(run_views(p, b, nullptr) == 0);  // the workspace is given: nothing allocates
  check_against_cpu(p, b);
  // The padding past `hidden` in each output row is never written.
  for (long t = 0; t < p.tokens; ++t) CHECK(b.combined[static_cast<std::size_t>(t * p.stride + p.hidden)] == 0.f);
}

TEST_CASE_TEMPLATE("device views: dropped slots (kept = 0) get no row and pass no gradient", Id, std::int32_t,
                   std::int64_t) {
  Problem p = make_problem(0.5);
  REQUIRE(p.routing.has_capacity_mask());
  Buffers<Id> b(p);
  CHECK(run_views(p, b, p.routing.kept.data()) == 0);
  check_against_cpu(p, b);
}

TEST_CASE_TEMPLATE("device views: an expert id outside [0, E) is reported in the status and rejected", Id,
                   std::int32_t, std::int64_t) {
  const Problem p = make_problem();
  Buffers<Id> b(p);
  const long bad_slot = 5 * p.k + 2;
  // 2^32 + 3 is not expert 3: an int64 id is range-checked as is, never narrowed.
  b.ids[static_cast<std::size_t>(bad_slot)] = std::is_same_v<Id, std::int64_t> ? static_cast<Id>((1LL << 32) + 3) : Id(-1);
  const dev::Workspace ws{b.workspace.data(), b.workspace.size()};
  dev::make_expert_permutation(dev::matrix_view<const Id>(b.ids.data(), p.tokens, p.k), nullptr, b.perm, ws, &b.status);
  CHECK(b.status.code == dev::status_expert_out_of_range);
  CHECK(b.status.index == bad_slot);
  // The permutation is inert until the status is checked: no rows, every slot dropped. A permute
  // and a combine enqueued behind it (a stream nobody synchronised yet) touch nothing outside their
  // inputs: the permute copies no row, the combine writes zeros.
  CHECK(std::all_of(b.offsets.begin(), b.offsets.end(), [](std::int32_t o) { return o == 0; }));
  CHECK(std::all_of(b.row_of_slot.begin(), b.row_of_slot.end(), [](std::int32_t r) { return r == -1; }));
  std::fill(b.permuted.begin(), b.permuted.end(), 5.f);
  std::fill(b.combined.begin(), b.combined.end(), 5.f);
  dev::permute_tokens(dev::matrix_view<const float>(p.x.data(), p.tokens, p.hidden, p.stride), b.perm,
                      dev::matrix_view(b.permuted.data(), p.tokens * p.k, p.hidden, p.stride));
  CHECK(std::all_of(b.permuted.begin(), b.permuted.end(), [](float v) { return v == 5.f; }));
  dev::combine(dev::matrix_view<const float>(p.expert_out.data(), p.tokens * p.k, p.hidden, p.stride),
               dev::matrix_view<const float>(p.routing.weights.data(), p.tokens, p.k), b.perm,
               dev::matrix_view(b.combined.data(), p.tokens, p.hidden, p.stride));
  CHECK(same_block(b.combined, p.stride, mrr::RowMatrix<float>::Zero(p.tokens, p.hidden)));
  CHECK_THROWS_WITH_AS(dev::check_permutation(&b.status, b.perm), doctest::Contains("token 5 slot 2"),
                       std::invalid_argument);
  // A workspace smaller than asked for, and strided ids, are errors before anything runs.
  CHECK_THROWS_WITH_AS(dev::make_expert_permutation(dev::matrix_view<const Id>(b.ids.data(), p.tokens, p.k), nullptr,
                                                    b.perm, dev::Workspace{b.workspace.data(), 8}, &b.status),
                       doctest::Contains("workspace_bytes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(dev::make_expert_permutation(dev::matrix_view<const Id>(b.ids.data(), p.tokens / 2, p.k, 2 * p.k),
                                                    nullptr, b.perm, ws, &b.status),
                       doctest::Contains("'ids'"), std::invalid_argument);
}

TEST_CASE_TEMPLATE("device views: capacity dropping equals the CPU router's, without allocating", Id, std::int32_t,
                   std::int64_t) {
  for (const auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position}) {
    const Problem p = make_problem();
    mrr::Routing<float> cpu = p.routing;
    mrr::drop_over_capacity(cpu, p.experts, 0.6, policy);
    const long slots = p.tokens * p.k;
    std::vector<Id> ids(p.routing.ids.data(), p.routing.ids.data() + slots);
    std::vector<float> weights(p.routing.weights.data(), p.routing.weights.data() + slots);
    std::vector<std::uint8_t> kept(static_cast<std::size_t>(slots), 7);
    std::vector<std::uint8_t> workspace(dev::drop_over_capacity_workspace_bytes(p.tokens, p.k, p.experts));
    dev::DeviceStatus status;
    const long before = g_allocations.load();
    dev::drop_over_capacity(dev::matrix_view<const Id>(ids.data(), p.tokens, p.k),
                            dev::matrix_view(weights.data(), p.tokens, p.k), kept.data(), p.experts, 0.6, policy,
                            dev::Workspace{workspace.data(), workspace.size()}, &status);
    CHECK(g_allocations.load() - before == 0);
    CHECK(status.code == dev::status_ok);
    CHECK(std::equal(kept.begin(), kept.end(), cpu.kept.data()));
    CHECK(std::equal(weights.begin(), weights.end(), cpu.weights.data()));
    CHECK(std::count(kept.begin(), kept.end(), 0) > 0);  // the capacity binds
  }
}

TEST_CASE_TEMPLATE("device capacity dropping refuses a token listing an expert twice, as the CPU does", Id,
                   std::int32_t, std::int64_t) {
  // Two places of one expert for one token would let it take two of the expert's capacity slots.
  const Problem p = make_problem();
  const long slots = p.tokens * p.k;
  std::vector<Id> ids(p.routing.ids.data(), p.routing.ids.data() + slots);
  const auto first = static_cast<std::size_t>(300 * p.k), second = static_cast<std::size_t>(600 * p.k);
  ids[first + 3] = ids[first + 1];    // token 300: slot 3 repeats slot 1
  ids[second + 2] = ids[second + 0];  // token 600 too: the lowest repeat is reported
  std::vector<std::uint8_t> workspace(dev::drop_over_capacity_workspace_bytes(p.tokens, p.k, p.experts));
  const auto run = [&](const std::vector<Id>& in, std::vector<float>& weights, std::vector<std::uint8_t>& kept) {
    dev::DeviceStatus status;
    dev::drop_over_capacity(dev::matrix_view<const Id>(in.data(), p.tokens, p.k),
                            dev::matrix_view(weights.data(), p.tokens, p.k), kept.data(), p.experts, 0.6,
                            mrr::DropPolicy::probs, dev::Workspace{workspace.data(), workspace.size()}, &status);
    return status;
  };
  const std::vector<float> given(p.routing.weights.data(), p.routing.weights.data() + slots);
  std::vector<float> weights = given;
  std::vector<std::uint8_t> kept(static_cast<std::size_t>(slots), 7);
  dev::DeviceStatus status = run(ids, weights, kept);
  CHECK(status.code == dev::status_repeated_expert);
  CHECK(status.index == 300 * p.k + 3);
  CHECK(weights == given);  // nothing written
  CHECK(std::all_of(kept.begin(), kept.end(), [](std::uint8_t v) { return v == 7; }));
  const dev::PermutationView shape{nullptr, nullptr, nullptr, p.tokens, p.k, p.experts};
  CHECK_THROWS_WITH_AS(dev::check_permutation(&status, shape),
                       doctest::Contains("token 300 slot 3 repeats an expert id"), std::invalid_argument);
  // With an id out of range too, the lowest bad slot is reported, as the CPU does.
  std::vector<Id> both = ids;
  both[static_cast<std::size_t>(700 * p.k)] = static_cast<Id>(p.experts);
  status = run(both, weights, kept);
  CHECK(status.code == dev::status_repeated_expert);
  CHECK(status.index == 300 * p.k + 3);
  both[static_cast<std::size_t>(100 * p.k + 2)] = Id{-5};
  status = run(both, weights, kept);
  CHECK(status.code == dev::status_expert_out_of_range);
  CHECK(status.index == 100 * p.k + 2);
  mrr::Routing<float> cpu_both = p.routing;
  for (long i = 0; i < slots; ++i)
    cpu_both.ids.data()[i] = static_cast<std::int32_t>(both[static_cast<std::size_t>(i)]);
  CHECK_THROWS_WITH_AS(mrr::drop_over_capacity(cpu_both, p.experts, 0.6, mrr::DropPolicy::probs),
                       doctest::Contains("row 100 slot 2 has expert id -5"), mrr::InvalidArgument);
  cpu_both.ids(100, 2) = p.routing.ids(100, 2);
  CHECK_THROWS_WITH_AS(mrr::drop_over_capacity(cpu_both, p.experts, 0.6, mrr::DropPolicy::probs),
                       doctest::Contains("row 300 repeats expert id"), mrr::InvalidArgument);
  // The owning layer throws with its own name; k = 1 has nothing to repeat.
  using Omp = mrr::ThrustDeviceBackend;
  const std::vector<std::int32_t> ids32(ids.begin(), ids.end());
  Omp::vector<std::int32_t> dids(ids32.begin(), ids32.end());
  Omp::vector<float> dweights(given.begin(), given.end());
  Omp::vector<std::uint8_t> dkept;
  const auto owning = [&] {
    dev::drop_over_capacity<float, Omp>(dids, dweights, dkept, p.tokens, p.k, p.experts, 0.6, mrr::DropPolicy::probs);
  };
  CHECK_THROWS_WITH_AS(owning(), doctest::Contains("device::drop_over_capacity: token 300 slot 3 repeats"),
                       std::invalid_argument);
  CHECK(std::equal(dweights.begin(), dweights.end(), given.begin()));
  // The repaired ids are accepted and match the CPU.
  std::vector<Id> fixed(p.routing.ids.data(), p.routing.ids.data() + slots);
  weights = given;
  status = run(fixed, weights, kept);
  CHECK(status.code == dev::status_ok);
  mrr::Routing<float> cpu = p.routing;
  mrr::drop_over_capacity(cpu, p.experts, 0.6, mrr::DropPolicy::probs);
  CHECK(std::equal(kept.begin(), kept.end(), cpu.kept.data()));
}

TEST_CASE_TEMPLATE("device views: the radix-sort permutation (CUDA's) equals the counting sort's, bit for bit", Id,
                   std::int32_t, std::int64_t) {
  // The GPU's algorithm runs here through thrust::stable_sort_by_key (CUB's radix sort on CUDA):
  // slot keys, sorted-key bounds, placing, dropped slots and the bad-id report are the same code.
  struct Out {
    std::vector<std::int32_t> source_token, row_of_slot, offsets;
    dev::DeviceStatus status;
  };
  const auto permutation = [](const Problem& p, const std::vector<Id>& ids, const std::uint8_t* kept,
                              dev::PermutationAlgorithm algorithm) {
    const long slots = p.tokens * p.k;
    Out o;
    o.source_token.assign(static_cast<std::size_t>(slots), -7);
    o.row_of_slot.assign(static_cast<std::size_t>(slots), -7);
    o.offsets.assign(static_cast<std::size_t>(p.experts) + 1, -7);
    std::vector<std::uint8_t> ws(dev::permutation_workspace_bytes(p.tokens, p.k, p.experts, algorithm));
    const dev::PermutationView v{
        o.source_token.data(), o.row_of_slot.data(), o.offsets.data(), p.tokens, p.k, p.experts};
    dev::make_expert_permutation(dev::matrix_view<const Id>(ids.data(), p.tokens, p.k), kept, v,
                                 dev::Workspace{ws.data(), ws.size()}, &o.status, {}, algorithm);
    return o;
  };
  for (const double cf : {0.0, 0.6}) {
    CAPTURE(cf);
    const Problem p = make_problem(cf);
    const std::uint8_t* kept = p.routing.has_capacity_mask() ? p.routing.kept.data() : nullptr;
    std::vector<Id> ids(p.routing.ids.data(), p.routing.ids.data() + p.tokens * p.k);
    const Out counting = permutation(p, ids, kept, dev::PermutationAlgorithm::counting);
    const Out sorted = permutation(p, ids, kept, dev::PermutationAlgorithm::radix_sort);
    REQUIRE(counting.status.code == dev::status_ok);
    CHECK(sorted.status.code == dev::status_ok);
    CHECK(sorted.offsets == counting.offsets);
    CHECK(sorted.source_token == counting.source_token);
    CHECK(sorted.row_of_slot == counting.row_of_slot);
    CHECK((cf > 0) == (std::count(sorted.row_of_slot.begin(), sorted.row_of_slot.end(), -1) > 0));
    // Two bad ids: both algorithms report the lower slot, write no row and leave the permutation
    // inert (no rows, every slot dropped).
    ids[static_cast<std::size_t>(9 * p.k + 1)] = Id(p.experts);
    ids[static_cast<std::size_t>(4 * p.k + 3)] = Id(-2);
    for (const auto algorithm : {dev::PermutationAlgorithm::radix_sort, dev::PermutationAlgorithm::counting}) {
      const Out bad = permutation(p, ids, kept, algorithm);
      CHECK(bad.status.code == dev::status_expert_out_of_range);
      CHECK(bad.status.index == 4 * p.k + 3);
      CHECK(std::count(bad.source_token.begin(), bad.source_token.end(), -7) == p.tokens * p.k);
      CHECK(std::count(bad.row_of_slot.begin(), bad.row_of_slot.end(), -1) == p.tokens * p.k);
      CHECK(std::count(bad.offsets.begin(), bad.offsets.end(), 0) == p.experts + 1);
    }
  }
}

TEST_CASE("kernels: the radix select finds the n-th smallest key, as std::nth_element does") {
  std::mt19937_64 rng(3);
  for (const long n : {1L, 2L, 17L, 1000L}) {
    std::vector<std::uint64_t> keys(static_cast<std::size_t>(n));
    for (auto& k : keys) k = rng() % 5 == 0 ? 42 : (rng() >> (rng() % 60));  // ties and every magnitude
    for (long rank = 0; rank < n; rank += 1 + n / 7) {
      auto sorted = keys;
      std::nth_element(sorted.begin(), sorted.begin() + rank, sorted.end());
      CHECK(mrr::kernels::select_key(keys.data(), n, rank) == sorted[static_cast<std::size_t>(rank)]);
    }
  }
}

namespace {

// One forward and backward by an executor, as dense matrices for the checks below.
struct Results {
  std::vector<std::int64_t> source_token;
  mrr::RowMatrix<float> permuted, combined, grad_x, grad_expert_out, grad_weights;
};

struct CpuExecutor {
  static Results run(const Problem& p) {
    const auto perm = mrr::make_expert_permutation(p.routing, p.experts);
    const auto y = dense(p.expert_out, perm.rows(), p.hidden, p.stride);
    const auto g = mrr::combine_backward<float>(dense(p.grad_out, p.tokens, p.hidden, p.stride), y, p.routing, perm);
    return {perm.source_token, mrr::permute_tokens<float>(dense(p.x, p.tokens, p.hidden, p.stride), perm),
            mrr::combine<float>(y, p.routing, perm), mrr::permute_tokens_backward<float>(y, perm), g.expert_out,
            g.weights};
  }
};

struct ThrustOmpExecutor {
  static Results run(const Problem& p) {
    Buffers<std::int32_t> b(p);
    (void)run_views(p, b, p.routing.has_capacity_mask() ? p.routing.kept.data() : nullptr);
    const long rows = b.offsets.back();
    Results r;
    r.source_token.assign(b.source_token.begin(), b.source_token.begin() + rows);
    r.permuted = dense(b.permuted, rows, p.hidden, p.stride);
    r.combined = dense(b.combined, p.tokens, p.hidden, p.stride);
    r.grad_x = dense(b.grad_x, p.tokens, p.hidden, p.stride);
    r.grad_expert_out = dense(b.grad_expert_out, rows, p.hidden, p.stride);
    r.grad_weights = Eigen::Map<const mrr::RowMatrix<float>>(b.grad_weights.data(), p.tokens, p.k);
    return r;
  }
};

}  // namespace

// Written once, run by every executor: each result against its definition, computed here by the
// plainest loops in the same (slot) order, so equality is exact.
TEST_CASE_TEMPLATE("permute and combine by every executor equal their definitions", Exec, CpuExecutor,
                   ThrustOmpExecutor) {
  for (const double capacity_factor : {0.0, 0.5}) {
    CAPTURE(capacity_factor);
    const Problem p = make_problem(capacity_factor);
    const Results r = Exec::run(p);
    // Expert-major, tokens ascending within an expert (Megatron's permute), dropped slots left out.
    std::vector<std::int64_t> source, row_of(static_cast<std::size_t>(p.tokens * p.k), -1);
    for (int e = 0; e < p.experts; ++e)
      for (long t = 0; t < p.tokens; ++t)
        for (int j = 0; j < p.k; ++j)
          if (p.routing.ids(t, j) == e && p.routing.is_kept(t, j)) {
            row_of[static_cast<std::size_t>(t * p.k + j)] = static_cast<std::int64_t>(source.size());
            source.push_back(t);
          }
    REQUIRE(r.source_token == source);
    const long rows = static_cast<long>(source.size());
    const auto x = dense(p.x, p.tokens, p.hidden, p.stride);
    const auto y = dense(p.expert_out, rows, p.hidden, p.stride);
    const auto go = dense(p.grad_out, p.tokens, p.hidden, p.stride);
    bool permuted = true, combined = true, grad_x = true, grad_y = true;
    for (long i = 0; i < rows; ++i) permuted = permuted && r.permuted.row(i) == x.row(source[static_cast<std::size_t>(i)]);
    for (long t = 0; t < p.tokens; ++t)
      for (long h = 0; h < p.hidden; ++h) {
        float out = 0.f, gx = 0.f;
        for (int j = 0; j < p.k; ++j) {
          const auto row = row_of[static_cast<std::size_t>(t * p.k + j)];
          if (row < 0) continue;
          out += y(row, h) * p.routing.weights(t, j);
          gx += y(row, h);
          grad_y = grad_y && r.grad_expert_out(row, h) == p.routing.weights(t, j) * go(t, h);
        }
        combined = combined && r.combined(t, h) == out;
        grad_x = grad_x && r.grad_x(t, h) == gx;
      }
    CHECK(permuted);
    CHECK(combined);
    CHECK(grad_x);
    CHECK(grad_y);
    for (long t = 0; t < p.tokens; ++t)
      for (int j = 0; j < p.k; ++j) {
        const auto row = row_of[static_cast<std::size_t>(t * p.k + j)];
        // The dot product in kDotLanes lanes (column h in lane h % 16, each in column order),
        // the lanes then added in a fixed tree.
        float lanes[mrr::kernels::kDotLanes] = {};
        for (long h = 0; row >= 0 && h < p.hidden; ++h)
          lanes[h % mrr::kernels::kDotLanes] += go(t, h) * y(row, h);
        for (int width = mrr::kernels::kDotLanes / 2; width > 0; width /= 2)
          for (int l = 0; l < width; ++l)
            lanes[l] += lanes[l + width];
        CHECK(r.grad_weights(t, j) == lanes[0]);
      }
  }
}

// The device permutation of a problem's routing, in buffers it owns.
struct OwnedPermutation {
  std::vector<std::int32_t> source, row_of_slot, offsets;
  dev::PermutationView view;
  explicit OwnedPermutation(const Problem& p)
      : source(static_cast<std::size_t>(p.tokens * p.k)),
        row_of_slot(source.size()),
        offsets(static_cast<std::size_t>(p.experts) + 1),
        view{source.data(), row_of_slot.data(), offsets.data(), p.tokens, p.k, p.experts} {
    std::vector<std::uint8_t> workspace(dev::permutation_workspace_bytes(p.tokens, p.k, p.experts));
    dev::DeviceStatus status;
    dev::make_expert_permutation(dev::matrix_view<const std::int32_t>(p.routing.ids.data(), p.tokens, p.k), nullptr,
                                 view, dev::Workspace{workspace.data(), workspace.size()}, &status);
    dev::check_permutation(&status, view);
  }
};

TEST_CASE("device views: bf16 rows are combined in float and rounded, not truncated into their bits") {
  // static_cast<bf16>(float sum) once meant C++20 aggregate initialisation of the bits.
  const Problem p = make_problem();
  const long rows = p.tokens * p.k, h = p.hidden;
  const OwnedPermutation owned(p);
  const dev::PermutationView& perm = owned.view;
  const std::vector<std::int32_t>& row_of_slot = owned.row_of_slot;
  std::vector<mrr::bf16> y(static_cast<std::size_t>(rows * h)), w(static_cast<std::size_t>(rows));
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = mrr::bf16::from_float(p.expert_out[i % p.expert_out.size()]);
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = mrr::bf16::from_float(p.routing.weights.data()[i]);
  std::vector<mrr::bf16> out(static_cast<std::size_t>(p.tokens * h)), grad_tokens(out.size());
  dev::combine(dev::matrix_view<const mrr::bf16>(y.data(), rows, h),
               dev::matrix_view<const mrr::bf16>(w.data(), p.tokens, p.k), perm,
               dev::matrix_view(out.data(), p.tokens, h));
  dev::permute_tokens_backward(dev::matrix_view<const mrr::bf16>(y.data(), rows, h), perm,
                               dev::matrix_view(grad_tokens.data(), p.tokens, h));
  long worst_combine = 0, worst_backward = 0;
  for (long t = 0; t < p.tokens; ++t)
    for (long c = 0; c < h; ++c) {
      float sum = 0, plain = 0;  // the kernels' float accumulation, in slot order
      for (int j = 0; j < p.k; ++j) {
        const long r = row_of_slot[static_cast<std::size_t>(t * p.k + j)];
        const float v = y[static_cast<std::size_t>(r * h + c)].to_float();
        sum += w[static_cast<std::size_t>(t * p.k + j)].to_float() * v;
        plain += v;
      }
      const auto at = static_cast<std::size_t>(t * h + c);
      worst_combine = std::max<long>(worst_combine, std::abs(int(out[at].bits) - int(mrr::bf16::from_float(sum).bits)));
      worst_backward =
          std::max<long>(worst_backward, std::abs(int(grad_tokens[at].bits) - int(mrr::bf16::from_float(plain).bits)));
    }
  CHECK(worst_combine <= 1);  // the float sum rounded once (an FMA may move it by one bf16 ulp)
  CHECK(worst_backward == 0);
  CHECK(static_cast<mrr::bf16>(2.5f).to_float() == 2.5f);
}

TEST_CASE("device views: an output sharing memory with an input is refused") {
  const Problem p = make_problem();
  const long rows = p.tokens * p.k;
  const OwnedPermutation owned(p);
  const dev::PermutationView& perm = owned.view;
  std::vector<float> big(static_cast<std::size_t>(rows * p.stride), 1.0f);
  const auto in = dev::matrix_view<const float>(big.data(), rows, p.hidden, p.stride);
  const auto weights = dev::matrix_view<const float>(p.routing.weights.data(), p.tokens, p.k);
  CHECK_THROWS_WITH_AS(dev::combine(in, weights, perm, dev::matrix_view(big.data() + 5, p.tokens, p.hidden, p.stride)),
                       doctest::Contains("'out' shares memory with 'expert_out'"), std::invalid_argument);
  {  // out starting on the last 3 values of the tokens' last row
    std::vector<float> buf(static_cast<std::size_t>((p.tokens + rows) * p.stride));
    const long last = (p.tokens - 1) * p.stride + p.hidden;
    const auto tokens = dev::matrix_view<const float>(buf.data(), p.tokens, p.hidden, p.stride);
    CHECK_THROWS_WITH_AS(
        dev::permute_tokens(tokens, perm, dev::matrix_view(buf.data() + last - 3, rows, p.hidden, p.stride)),
        doctest::Contains("'out' shares memory with 'tokens'"), std::invalid_argument);
    dev::permute_tokens(tokens, perm, dev::matrix_view(buf.data() + last, rows, p.hidden, p.stride));  // right after
  }
  CHECK_THROWS_WITH_AS(
      dev::permute_tokens_backward(in, perm, dev::matrix_view(big.data(), p.tokens, p.hidden, p.stride)),
      doctest::Contains("'grad_tokens' shares memory with 'grad_permuted'"), std::invalid_argument);
  {  // the column halves of one buffer interleave without sharing a value: accepted
    std::vector<float> halves(static_cast<std::size_t>(rows * 2 * p.hidden), 1.0f);
    const auto left = dev::matrix_view<const float>(halves.data(), p.tokens, p.hidden, 2 * p.hidden);
    dev::permute_tokens(left, perm, dev::matrix_view(halves.data() + p.hidden, rows, p.hidden, 2 * p.hidden));
    CHECK_THROWS_WITH_AS(  // one value into the left half: shared
        dev::permute_tokens(left, perm, dev::matrix_view(halves.data() + p.hidden - 1, rows, p.hidden, 2 * p.hidden)),
        doctest::Contains("'out' shares memory with 'tokens'"), std::invalid_argument);
  }
  // Right after the input's last element is not shared.
  std::vector<float> out(static_cast<std::size_t>(p.tokens * p.stride));
  dev::combine(in, weights, perm, dev::matrix_view(out.data(), p.tokens, p.hidden, p.stride));
}

TEST_CASE("device views: a workspace sized once fits whatever the thread count is later") {
  const Problem p = make_problem();
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  std::vector<std::uint8_t> workspace(dev::permutation_workspace_bytes(p.tokens * 200, p.k, p.experts));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(p.tokens * 200 * p.k));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = p.routing.ids.data()[i % static_cast<std::size_t>(p.tokens * p.k)];
  std::vector<std::int32_t> source(ids.size()), row_of_slot(ids.size()),
      offsets(static_cast<std::size_t>(p.experts) + 1);
  const dev::PermutationView perm{source.data(), row_of_slot.data(), offsets.data(), p.tokens * 200, p.k, p.experts};
  omp_set_num_threads(8);
  CHECK(dev::permutation_workspace_bytes(p.tokens * 200, p.k, p.experts) == workspace.size());
  dev::DeviceStatus status;
  dev::make_expert_permutation(dev::matrix_view<const std::int32_t>(ids.data(), p.tokens * 200, p.k), nullptr, perm,
                               dev::Workspace{workspace.data(), workspace.size()}, &status);
  dev::check_permutation(&status, perm);
  omp_set_num_threads(before);
  CHECK(offsets.back() == p.tokens * 200 * p.k);
}

TEST_CASE("an empty batch permutes to no rows (CPU and views)") {
  mrr::Routing<float> empty{mrr::ExpertIds(0, 2), mrr::RowMatrix<float>(0, 2), {}};
  const auto perm = mrr::make_expert_permutation(empty, 4);
  CHECK(perm.rows() == 0);
  CHECK(perm.tokens_per_expert == std::vector<std::int64_t>(4, 0));
  std::vector<std::int32_t> offsets(5, -1);
  std::vector<std::uint8_t> workspace(dev::permutation_workspace_bytes(0, 2, 4));
  dev::DeviceStatus status;
  const dev::PermutationView p{nullptr, nullptr, offsets.data(), 0, 2, 4};
  dev::make_expert_permutation(dev::matrix_view<const std::int32_t>(nullptr, 0, 2), nullptr, p,
                               dev::Workspace{workspace.data(), workspace.size()}, &status);
  dev::check_permutation(&status, p);
  CHECK(offsets == std::vector<std::int32_t>(5, 0));
}
