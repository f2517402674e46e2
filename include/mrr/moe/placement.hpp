// Where experts live under expert parallelism: E experts over P ranks in contiguous blocks, rank
// r owning [r*E/P, (r+1)*E/P) (Megatron's layout). Ids stay global everywhere else.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

MRR_NAMESPACE_BEGIN

class ExpertPlacement {
 public:
  // E experts over P ranks; E must be a multiple of P.
  static ExpertPlacement contiguous(int num_experts, int ranks) {
    constexpr const char* fn = "ExpertPlacement::contiguous";
    detail::require(num_experts > 0, fn, "num_experts must be positive, got ", num_experts);
    detail::require(ranks > 0, fn, "the number of ranks must be positive, got ", ranks);
    detail::require(num_experts % ranks == 0, fn, "num_experts=", num_experts, " is not divisible by ", ranks,
                    " expert-parallel ranks (experts are placed in equal contiguous blocks)");
    return ExpertPlacement(num_experts, ranks);
  }

  int num_experts() const { return num_experts_; }
  int ranks() const { return ranks_; }
  int experts_per_rank() const { return num_experts_ / ranks_; }
  int first_expert(int rank) const { return rank * experts_per_rank(); }
  int owner(int expert) const { return expert / experts_per_rank(); }

 private:
  ExpertPlacement(int num_experts, int ranks) : num_experts_(num_experts), ranks_(ranks) {}
  int num_experts_;
  int ranks_;
};

MRR_NAMESPACE_END
