// Rule-based rewards of Search-R1 / GSM8K-style tasks, as verl scores them: exact match of the
// text inside the last <answer>...</answer> (SQuAD-style normalisation, format score, tag-spam
// penalty) and the GSM8K "#### <number>" answer. Text is UTF-8.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

namespace detail {

// Bytes that are not valid UTF-8 map to U+DC80..U+DCFF and back (Python's surrogateescape), so
// normalisation never loses or invents bytes.
inline std::vector<char32_t> decode_utf8(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    std::size_t len = 0;
    char32_t cp = 0;
    if (b0 < 0x80) {
      len = 1;
      cp = b0;
    } else if ((b0 & 0xE0) == 0xC0 && b0 >= 0xC2) {
      len = 2;
      cp = b0 & 0x1F;
    } else if ((b0 & 0xF0) == 0xE0) {
      len = 3;
      cp = b0 & 0x0F;
    } else if ((b0 & 0xF8) == 0xF0 && b0 <= 0xF4) {
      len = 4;
      cp = b0 & 0x07;
    }
    bool ok = len != 0 && i + len <= s.size();
    for (std::size_t k = 1; ok && k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (b & 0x3F);
    }
    // Reject overlong forms, surrogates and out-of-range values.
    if (ok &&
        ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))))
      ok = false;
    if (!ok) {
      out.push_back(0xDC00 + b0);
      ++i;
    } else {
      out.push_back(cp);
      i += len;
    }
  }
  return out;
}

inline void append_utf8(std::string& out, char32_t cp) {
  if (cp >= 0xDC80 && cp <= 0xDCFF) {
    out.push_back(static_cast<char>(cp - 0xDC00));
  } else if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Python's str.isspace / str.split() whitespace.
inline bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Python's string.punctuation (ASCII only, as in verl).
inline bool is_ascii_punctuation(char32_t c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
}

// Approximates Python's Unicode \w: ASCII alphanumerics and '_', and non-ASCII code points other
// than whitespace and the common punctuation blocks (Latin-1 symbols, General Punctuation, CJK
// punctuation).
inline bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (is_python_space(c)) return false;
  if (c >= 0xA1 && c <= 0xBF)
    return c == 0xAA || c == 0xB2 || c == 0xB3 || c == 0xB5 || c == 0xB9 || c == 0xBA || (c >= 0xBC && c <= 0xBE);
  if (c == 0xD7 || c == 0xF7) return false;
  if ((c >= 0x2010 && c <= 0x2027) || (c >= 0x2030 && c <= 0x205E) || (c >= 0x3001 && c <= 0x3003) ||
      (c >= 0x3008 && c <= 0x3011))
    return false;
  return true;
}

// Lower-casing for ASCII, Latin-1, basic Greek and Cyrillic capitals (a subset of str.lower()).
inline char32_t to_lower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 0x20;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
  if (c >= 0x410 && c <= 0x42F) return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  return c;
}

// Approximations of Unicode's Cased and Case_Ignorable properties over the scripts to_lower
// handles, for Python's final-sigma rule.
inline bool is_cased(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (c == 0xAA || c == 0xB5 || c == 0xBA) return true;
  if (c >= 0xC0 && c <= 0x24F) return c != 0xD7 && c != 0xF7;
  if (c >= 0x370 && c <= 0x3FF)
    return c != 0x374 && c != 0x375 && c != 0x37E && c != 0x384 && c != 0x385 && c != 0x387 && c != 0x3F6 &&
           !(c >= 0x378 && c <= 0x379) && !(c >= 0x380 && c <= 0x383) && c != 0x38B && c != 0x38D && c != 0x3A2;
  if (c >= 0x400 && c <= 0x52F) return !(c >= 0x482 && c <= 0x489);
  return false;
}

inline bool is_case_ignorable(char32_t c) {
  return c == 0x27 || c == 0x2E || c == 0x3A || c == 0x5E || c == 0x60 || c == 0xA8 || c == 0xAD || c == 0xAF ||
         c == 0xB4 || c == 0xB7 || c == 0xB8 || (c >= 0x2B0 && c <= 0x36F) || c == 0x374 || c == 0x375 || c == 0x37A ||
         c == 0x384 || c == 0x385 || c == 0x387 || (c >= 0x483 && c <= 0x489) || (c >= 0x200B && c <= 0x200F) ||
         c == 0x2018 || c == 0x2019 || c == 0x2024 || c == 0x2027;
}

// Python's str.lower() of cps[i] within its string: to_lower, and a capital sigma that ends a word
// (a cased letter before it and none after it, case-ignorable characters skipped) becomes the
// final sigma.
inline char32_t to_lower_at(const std::vector<char32_t>& cps, std::size_t i) {
  if (cps[i] != 0x3A3) return to_lower(cps[i]);
  auto cased_before = [&] {
    for (std::size_t j = i; j-- > 0;)
      if (!is_case_ignorable(cps[j])) return is_cased(cps[j]);
    return false;
  };
  auto cased_after = [&] {
    for (std::size_t j = i + 1; j < cps.size(); ++j)
      if (!is_case_ignorable(cps[j])) return is_cased(cps[j]);
    return false;
  };
  return cased_before() && !cased_after() ? char32_t{0x3C2} : char32_t{0x3C3};
}

inline std::string_view strip_python_space(std::string_view s) {
  // Strip whole code points from both ends.
  const auto cps = decode_utf8(s);
  std::size_t begin = 0, end = cps.size();
  while (begin < end && is_python_space(cps[begin]))
    ++begin;
  while (end > begin && is_python_space(cps[end - 1]))
    --end;
  std::size_t byte_begin = 0, byte_end = 0;
  std::string scratch;
  for (std::size_t k = 0; k < cps.size(); ++k) {
    scratch.clear();
    append_utf8(scratch, cps[k]);
    if (k < begin) byte_begin += scratch.size();
    if (k < end) byte_end += scratch.size();
  }
  return s.substr(byte_begin, byte_end - byte_begin);
}

inline std::size_t count_occurrences(std::string_view text, std::string_view needle) {
  std::size_t count = 0;
  for (std::size_t pos = text.find(needle); pos != std::string_view::npos; pos = text.find(needle, pos + needle.size()))
    ++count;
  return count;
}

}  // namespace detail

// SQuAD-style answer normalisation (verl's normalize_answer): lower-case, drop ASCII
// punctuation, replace the words a/an/the by a space, collapse whitespace.
inline std::string normalize_answer(std::string_view text) {
  auto cps = detail::decode_utf8(text);
  std::vector<char32_t> kept;
  kept.reserve(cps.size());
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const char32_t lower = detail::to_lower_at(cps, i);
    if (!detail::is_ascii_punctuation(lower)) kept.push_back(lower);
  }
  // Articles are whole \w runs equal to a, an or the.
  std::vector<char32_t> no_articles;
  no_articles.reserve(kept.size());
  for (std::size_t i = 0; i < kept.size();) {
    if (!detail::is_word_char(kept[i])) {
      no_articles.push_back(kept[i++]);
      continue;
    }
    std::size_t j = i;
    while (j < kept.size() && detail::is_word_char(kept[j]))
      ++j;
    const std::size_t n = j - i;
    const bool article = (n == 1 && kept[i] == 'a') || (n == 2 && kept[i] == 'a' && kept[i + 1] == 'n') ||
                         (n == 3 && kept[i] == 't' && kept[i + 1] == 'h' && kept[i + 2] == 'e');
    if (article)
      no_articles.push_back(' ');
    else
      no_articles.insert(no_articles.end(), kept.begin() + static_cast<std::ptrdiff_t>(i),
                         kept.begin() + static_cast<std::ptrdiff_t>(j));
    i = j;
  }
  std::string out;
  bool pending_space = false;
  for (const char32_t c : no_articles) {
    if (detail::is_python_space(c)) {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    detail::append_utf8(out, c);
  }
  return out;
}

// The stripped content of the last non-overlapping <answer>...</answer> pair, or nothing.
inline std::optional<std::string> extract_answer(std::string_view solution) {
  constexpr std::string_view open = "<answer>", close = "</answer>";
  std::optional<std::string_view> last;
  std::size_t pos = 0;
  while (true) {
    const auto begin = solution.find(open, pos);
    if (begin == std::string_view::npos) break;
    const auto content = begin + open.size();
    const auto end = solution.find(close, content);
    if (end == std::string_view::npos) break;
    last = solution.substr(content, end - content);
    pos = end + close.size();
  }
  if (!last) return std::nullopt;
  return std::string(detail::strip_python_space(*last));
}

struct AnswerTagCount {
  std::size_t opening = 0;
  std::size_t closing = 0;
};

inline AnswerTagCount count_answer_tags(std::string_view text) {
  return {detail::count_occurrences(text, "<answer>"), detail::count_occurrences(text, "</answer>")};
}

// Normalised prediction equals one of the normalised golden answers.
inline bool exact_match(std::string_view prediction, std::span<const std::string> golden_answers) {
  const std::string normalized = normalize_answer(prediction);
  for (const auto& golden : golden_answers)
    if (normalize_answer(golden) == normalized) return true;
  return false;
}

// One of the normalised golden answers occurs inside the normalised prediction.
inline bool substring_exact_match(std::string_view prediction, std::span<const std::string> golden_answers) {
  const std::string normalized = normalize_answer(prediction);
  for (const auto& golden : golden_answers)
    if (normalized.find(normalize_answer(golden)) != std::string::npos) return true;
  return false;
}

struct ExactMatchScoreOptions {
  double score = 1.0;         // a correct answer
  double format_score = 0.0;  // an <answer> that is wrong (no <answer> at all scores 0)
  // More than this many opening or closing tags divides a correct score by tag_spam_divisor.
  std::size_t max_answer_tags = 10;
  double tag_spam_divisor = 4.0;
};

// Search-R1's exact-match reward (verl search_r1_like_qa_em.compute_score).
inline double compute_exact_match_score(std::string_view solution, std::span<const std::string> golden_answers,
                                        const ExactMatchScoreOptions& options = {}) {
  const auto answer = extract_answer(solution);
  if (!answer) return 0.0;
  if (!exact_match(*answer, golden_answers)) return options.format_score;
  const auto tags = count_answer_tags(solution);
  if (tags.opening > options.max_answer_tags || tags.closing > options.max_answer_tags)
    return options.score / options.tag_spam_divisor;
  return options.score;
}

inline double compute_exact_match_score(std::string_view solution, std::string_view golden_answer,
                                        const ExactMatchScoreOptions& options = {}) {
  const std::string golden(golden_answer);
  return compute_exact_match_score(solution, std::span<const std::string>(&golden, 1), options);
}

// Substring variant (verl compute_score_subem): no tag-spam penalty.
inline double compute_substring_exact_match_score(std::string_view solution,
                                                  std::span<const std::string> golden_answers,
                                                  const ExactMatchScoreOptions& options = {}) {
  const auto answer = extract_answer(solution);
  if (!answer) return 0.0;
  return substring_exact_match(*answer, golden_answers) ? options.score : options.format_score;
}

enum class Gsm8kMethod {
  strict,    // the last "#### <number>" (the format GSM8K's references use)
  flexible,  // the last number anywhere
};

namespace detail {

// verl only looks at the last 300 characters (code points) of a solution.
inline constexpr std::size_t kGsm8kSolutionClipChars = 300;

inline std::string_view last_code_points(std::string_view s, std::size_t count) {
  std::size_t seen = 0, pos = s.size();
  while (pos > 0 && seen < count) {
    --pos;
    if ((static_cast<unsigned char>(s[pos]) & 0xC0) != 0x80) ++seen;
  }
  return s.substr(pos);
}

inline bool is_number_char(char c) {
  return (c >= '0' && c <= '9') || c == '.' || c == ',';
}

// Length of the match of -?[0-9.,]+ at pos, 0 when none.
inline std::size_t number_at(std::string_view s, std::size_t pos) {
  std::size_t j = pos;
  if (j < s.size() && s[j] == '-' && j + 1 < s.size() && is_number_char(s[j + 1])) ++j;
  const std::size_t digits_begin = j;
  while (j < s.size() && is_number_char(s[j]))
    ++j;
  return j > digits_begin ? j - pos : 0;
}

}  // namespace detail

// verl gsm8k.extract_solution. strict: the number after the last "#### " with ',' removed;
// flexible: the last -?[0-9.,]+ run that is not "." (verl returns "." when every run is ".").
inline std::optional<std::string> extract_gsm8k_answer(std::string_view solution,
                                                       Gsm8kMethod method = Gsm8kMethod::strict) {
  const std::string_view text = detail::last_code_points(solution, detail::kGsm8kSolutionClipChars);
  std::optional<std::string_view> last;
  if (method == Gsm8kMethod::strict) {
    constexpr std::string_view marker = "#### ";
    std::size_t pos = 0;
    while ((pos = text.find(marker, pos)) != std::string_view::npos) {
      const std::size_t len = detail::number_at(text, pos + marker.size());
      if (len == 0) {
        ++pos;
        continue;
      }
      last = text.substr(pos + marker.size(), len);
      pos += marker.size() + len;
    }
    if (!last) return std::nullopt;
    std::string answer;
    for (const char c : *last)
      if (c != ',' && c != '$') answer.push_back(c);
    return answer;
  }
  std::optional<std::string_view> first;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t len = detail::number_at(text, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    const auto match = text.substr(pos, len);
    if (!first) first = match;
    if (match != ".") last = match;
    pos += len;
  }
  if (last) return std::string(*last);
  if (first) return std::string(*first);
  return std::nullopt;
}

struct Gsm8kScoreOptions {
  Gsm8kMethod method = Gsm8kMethod::strict;
  double format_score = 0.0;  // an extracted answer that is wrong
  double score = 1.0;         // the right answer
};

// verl gsm8k.compute_score: 0 without an answer, score when it equals ground_truth exactly,
// format_score otherwise.
inline double compute_gsm8k_score(std::string_view solution, std::string_view ground_truth,
                                  const Gsm8kScoreOptions& options = {}) {
  const auto answer = extract_gsm8k_answer(solution, options.method);
  if (!answer) return 0.0;
  return *answer == ground_truth ? options.score : options.format_score;
}

}  // namespace ppo
MRR_NAMESPACE_END
