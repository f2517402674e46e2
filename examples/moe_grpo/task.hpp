// The task: add two small numbers. Prompts come from a seed; a response is scored by verl's
// exact-match rule (Search-R1 qa_em) on "<answer>" + response: 1 for the right sum inside
// <answer>...</answer>, a format score for a closed answer with the wrong sum, 0 otherwise.
#pragma once

#include <mrr/ppo/reward_rules.hpp>
#include <mrr/rollout/sampling.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moe_grpo {

// Vocabulary: digits, '+', '=', <answer>, </answer>, end of sequence, beginning of sequence.
enum Token : std::int32_t { kPlus = 10, kEquals = 11, kAnswer = 12, kEndAnswer = 13, kEos = 14, kBos = 15 };
inline constexpr int kVocab = 16;
inline constexpr int kPromptLength = 6;  // <bos> a + b = <answer>

struct Problem {
  int a = 0, b = 0;
  std::array<std::int32_t, kPromptLength> prompt() const { return {kBos, a, kPlus, b, kEquals, kAnswer}; }
  std::string answer() const { return std::to_string(a + b); }
};

// Prompt `index` of training step `step`: operands uniform in [0, max_operand].
inline Problem make_problem(std::uint64_t seed, std::int64_t step, std::int64_t index, int max_operand) {
  const auto draw = [&](std::uint64_t which) {
    const double u = mrr::rollout::CounterRng::uniform(seed ^ 0x5eedf00dull, static_cast<std::uint64_t>(step) * 2 + which,
                                                        static_cast<std::uint64_t>(index));
    return static_cast<int>(u * (max_operand + 1));
  };
  return {draw(0), draw(1)};
}

inline std::string detokenize(std::span<const std::int32_t> tokens) {
  std::string text;
  for (const std::int32_t t : tokens) {
    if (t == kEos) break;
    if (t >= 0 && t <= 9) text += static_cast<char>('0' + t);
    if (t == kPlus) text += '+';
    if (t == kEquals) text += '=';
    if (t == kAnswer) text += "<answer>";
    if (t == kEndAnswer) text += "</answer>";
  }
  return text;
}

inline constexpr double kFormatScore = 0.1;

// The prompt ends with <answer>, so the solution text is "<answer>" + response.
inline double score_response(const Problem& p, std::span<const std::int32_t> response) {
  mrr::ppo::ExactMatchScoreOptions options;
  options.format_score = kFormatScore;
  return mrr::ppo::compute_exact_match_score("<answer>" + detokenize(response), p.answer(), options);
}

}  // namespace moe_grpo
