// Which sequence and position each row of a micro-batch holds. Routes are keyed by (sequence uid,
// position), so a micro-batch with another composition, order, padding or packing than the
// recording still finds its rows.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// A caller-given 64-bit id per sequence (e.g. step << 32 | sample), unique among the sequences
// a store holds.
using SequenceId = std::uint64_t;

// Positions are in [0, kMaxPositions): 2^32 tokens per sequence, far beyond any context length,
// and small enough that position x layers x k never overflows. Stores and route files refuse
// anything past it (a route file's records are checked against it before anything is sized).
inline constexpr std::int64_t kMaxPositions = std::int64_t{1} << 32;

struct TokenKey {
  SequenceId uid = 0;
  std::int64_t position = -1;  // position in the sequence (prompt + response); < 0 = padding row
  bool is_padding() const { return position < 0; }
  friend bool operator==(const TokenKey&, const TokenKey&) = default;
};

// A maximal run of rows holding consecutive positions of one sequence: stores and files work
// run by run, not row by row.
struct TokenRun {
  SequenceId uid = 0;
  std::int64_t first_position = 0;
  std::size_t first_row = 0;
  std::size_t count = 0;
};

class TokenLayout {
 public:
  TokenLayout() = default;
  explicit TokenLayout(std::vector<TokenKey> rows) : rows_(std::move(rows)) {
    for (std::size_t r = 0; r < rows_.size(); ++r)
      detail::require(rows_[r].position < kMaxPositions, "TokenLayout", "row ", r, " has position ",
                      rows_[r].position, "; positions must be < 2^32");
    find_runs();
  }

  // Padded batch [B, S] (verl's left-padded prompts, right-padded responses, or any mix): a row's
  // real tokens are those with attention_mask 1; their positions count the real tokens before.
  template <class M>
  static TokenLayout padded(std::span<const SequenceId> uids, const Eigen::MatrixBase<M>& attention_mask) {
    detail::require(static_cast<Eigen::Index>(uids.size()) == attention_mask.rows(), "TokenLayout::padded",
                    "'uids' has ", uids.size(), " entries for ", attention_mask.rows(), " rows of attention_mask");
    TokenLayout out;
    out.rows_.reserve(static_cast<std::size_t>(attention_mask.size()));
    for (Eigen::Index b = 0; b < attention_mask.rows(); ++b) {
      std::int64_t pos = 0;
      for (Eigen::Index s = 0; s < attention_mask.cols(); ++s) {
        if (attention_mask(b, s) != 0)
          out.rows_.push_back({uids[static_cast<std::size_t>(b)], pos++});
        else
          out.rows_.push_back({});
      }
    }
    out.find_runs();
    return out;
  }

  // Packed (THD) batch: sequence i occupies rows [cu_seqlens[i], cu_seqlens[i+1]) and starts at
  // position first_positions[i] (0 when not given; context-parallel shards or chunked sequences
  // start later). Rows past cu_seqlens.back() up to `total_rows` are padding.
  static TokenLayout packed(std::span<const SequenceId> uids, std::span<const std::int64_t> cu_seqlens,
                            std::span<const std::int64_t> first_positions = {}, std::int64_t total_rows = -1) {
    constexpr const char* fn = "TokenLayout::packed";
    detail::require(cu_seqlens.size() == uids.size() + 1, fn, "'cu_seqlens' needs ", uids.size() + 1,
                    " entries for ", uids.size(), " sequences, got ", cu_seqlens.size());
    detail::require(first_positions.empty() || first_positions.size() == uids.size(), fn, "'first_positions' has ",
                    first_positions.size(), " entries for ", uids.size(), " sequences");
    detail::require(cu_seqlens.front() == 0, fn, "'cu_seqlens' must start at 0");
    for (std::size_t i = 0; i + 1 < cu_seqlens.size(); ++i)
      detail::require(cu_seqlens[i + 1] >= cu_seqlens[i], fn, "'cu_seqlens' decreases at entry ", i + 1);
    const std::int64_t used = cu_seqlens.back();
    detail::require(total_rows >= -1, fn, "total_rows=", total_rows,
                    " is negative (-1, the default, means cu_seqlens.back())");
    if (total_rows == -1) total_rows = used;
    detail::require(total_rows >= used, fn, "total_rows=", total_rows, " is less than cu_seqlens.back()=", used);
    // Rows of a micro-batch, before anything is allocated for them (a wrong total must be an
    // error that names it, not a failed allocation).
    detail::require(total_rows <= kMaxPositions, fn, "total_rows=", total_rows, " (cu_seqlens.back()=", used,
                    ") is more rows than a micro-batch can have (at most 2^32)");
    TokenLayout out;
    out.rows_.reserve(static_cast<std::size_t>(total_rows));
    for (std::size_t i = 0; i < uids.size(); ++i) {
      const std::int64_t start = first_positions.empty() ? 0 : first_positions[i];
      detail::require(start >= 0, fn, "first_positions[", i, "] is negative");
      detail::require(start <= kMaxPositions - (cu_seqlens[i + 1] - cu_seqlens[i]), fn, "first_positions[", i, "] = ",
                      start, " puts sequence ", i, " past position 2^32 (positions must be < 2^32)");
      for (std::int64_t r = cu_seqlens[i]; r < cu_seqlens[i + 1]; ++r)
        out.rows_.push_back({uids[i], start + (r - cu_seqlens[i])});
    }
    out.rows_.resize(static_cast<std::size_t>(total_rows));
    out.find_runs();
    return out;
  }

  std::size_t size() const { return rows_.size(); }
  const TokenKey& operator[](std::size_t row) const { return rows_[row]; }
  std::span<const TokenKey> rows() const { return rows_; }
  std::span<const TokenRun> runs() const { return runs_; }
  std::size_t real_tokens() const {
    std::size_t n = 0;
    for (const auto& r : runs_) n += r.count;
    return n;
  }

 private:
  void find_runs() {
    runs_.clear();
    for (std::size_t r = 0; r < rows_.size(); ++r) {
      const TokenKey& key = rows_[r];
      if (key.is_padding()) continue;
      if (!runs_.empty()) {
        TokenRun& last = runs_.back();
        if (last.uid == key.uid && last.first_row + last.count == r &&
            last.first_position + static_cast<std::int64_t>(last.count) == key.position) {
          ++last.count;
          continue;
        }
      }
      runs_.push_back({key.uid, key.position, r, 1});
    }
  }

  std::vector<TokenKey> rows_;
  std::vector<TokenRun> runs_;
};

MRR_NAMESPACE_END
