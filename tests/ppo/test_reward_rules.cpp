// Rule-based rewards: Search-R1 exact match on <answer>...</answer> and GSM8K "#### number".
#include <mrr/ppo/reward_rules.hpp>

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace mrr;

TEST_CASE("normalize_answer: case, punctuation, articles, whitespace") {
  CHECK(ppo::normalize_answer("The Eiffel Tower!") == "eiffel tower");
  CHECK(ppo::normalize_answer("  a  Tale of   Two\tCities. ") == "tale of two cities");
  CHECK(ppo::normalize_answer("An apple, the pear and a banana") == "apple pear and banana");
  // Articles only as whole words; punctuation is removed before, so "the-end" becomes "theend".
  CHECK(ppo::normalize_answer("theater anthem banana") == "theater anthem banana");
  CHECK(ppo::normalize_answer("the-end") == "theend");
  CHECK(ppo::normalize_answer("U.S.A.") == "usa");
  CHECK(ppo::normalize_answer("") == "");
  CHECK(ppo::normalize_answer("the") == "");
  // Non-ASCII: Latin-1 capitals are lowered, non-breaking space is whitespace, bytes survive.
  CHECK(ppo::normalize_answer("\xC3\x89mile\xC2\xA0Zola") == "\xC3\xA9mile zola");
  CHECK(ppo::normalize_answer("caf\xC3\xA9 a\xE2\x80\x94the") == "caf\xC3\xA9 \xE2\x80\x94");
  CHECK(ppo::normalize_answer(std::string("bad\xFFutf8")) == std::string("bad\xFFutf8"));
}

TEST_CASE("normalize_answer: a capital sigma that ends a word lowers to the final sigma, as str.lower()") {
  // Expected strings from Python 3's str.lower() (then verl's punctuation removal).
  CHECK(ppo::normalize_answer("\u03A3\u0391\u03A3") == "\u03C3\u03B1\u03C2");  // ΣΑΣ -> σας
  CHECK(ppo::normalize_answer("\u039F\u0394\u03A5\u03A3\u03A3\u0395\u03A5\u03A3") ==
        "\u03BF\u03B4\u03C5\u03C3\u03C3\u03B5\u03C5\u03C2");                     // ΟΔΥΣΣΕΥΣ -> οδυσσευς
  CHECK(ppo::normalize_answer("\u03A3") == "\u03C3");                            // no letter before it
  CHECK(ppo::normalize_answer("\u0391\u03A3 \u0392") == "\u03B1\u03C2 \u03B2");  // ΑΣ Β -> ας β
  CHECK(ppo::normalize_answer("\u0391\u03A31") == "\u03B1\u03C21");              // a digit is not cased
  // '.' and the apostrophe are case-ignorable: skipped when looking for a cased letter after it.
  CHECK(ppo::normalize_answer("\u0391\u03A3.\u0392") == "\u03B1\u03C3\u03B2");  // ασ.β, then '.' dropped
  CHECK(ppo::normalize_answer("\u0391\u03A3'") == "\u03B1\u03C2");
  const std::string gold = "\u03C3\u03B1\u03C2";
  CHECK(ppo::compute_exact_match_score("<answer>\u03A3\u0391\u03A3</answer>", gold) == 1.0);
}

TEST_CASE("extract_answer takes the last tagged answer, stripped") {
  CHECK(ppo::extract_answer("<think>...</think><answer> Paris </answer>") == "Paris");
  CHECK(ppo::extract_answer("<answer>Lyon</answer> then <answer>\nParis\n</answer>") == "Paris");
  CHECK(ppo::extract_answer("<answer>multi\nline</answer>") == "multi\nline");
  CHECK_FALSE(ppo::extract_answer("no tags here").has_value());
  CHECK_FALSE(ppo::extract_answer("<answer>unclosed").has_value());
  // Non-greedy and non-overlapping, as re.finditer("<answer>(.*?)</answer>", re.DOTALL).
  CHECK(ppo::extract_answer("<answer>a<answer>b</answer>") == "a<answer>b");
  CHECK(ppo::extract_answer("<answer></answer>") == "");
  const auto tags = ppo::count_answer_tags("<answer>x</answer><answer>");
  CHECK(tags.opening == 2);
  CHECK(tags.closing == 1);
}

TEST_CASE("exact-match reward with format score and tag-spam penalty") {
  const std::vector<std::string> golden{"Paris", "City of Light"};
  ppo::ExactMatchScoreOptions options;
  options.format_score = 0.1;
  CHECK(ppo::compute_exact_match_score("<answer>paris.</answer>", golden, options) == 1.0);
  CHECK(ppo::compute_exact_match_score("<answer>The city of light</answer>", golden, options) == 1.0);
  CHECK(ppo::compute_exact_match_score("<answer>Lyon</answer>", golden, options) == 0.1);
  CHECK(ppo::compute_exact_match_score("Paris", golden, options) == 0.0);  // no answer tag: 0, not the format score
  std::string spam;
  for (int k = 0; k < 11; ++k)
    spam += "</answer>";
  CHECK(ppo::compute_exact_match_score("<answer>Paris</answer>" + spam, golden, options) == 0.25);
  CHECK(ppo::compute_exact_match_score("<answer>Paris</answer>", "paris") == 1.0);
  CHECK(ppo::exact_match("the  Paris", golden));
  CHECK_FALSE(ppo::exact_match("Paris France", golden));
  CHECK(ppo::substring_exact_match("Paris France", golden));
  CHECK(ppo::compute_substring_exact_match_score("<answer>It is Paris, France</answer>" + spam, golden, options) ==
        1.0);
  CHECK(ppo::compute_substring_exact_match_score("<answer>Rome</answer>", golden, options) == 0.1);
}

TEST_CASE("GSM8K answers: strict #### extraction") {
  CHECK(ppo::extract_gsm8k_answer("She has 3 apples.\n#### 72") == "72");
  CHECK(ppo::extract_gsm8k_answer("#### 1,234") == "1234");
  CHECK(ppo::extract_gsm8k_answer("#### -5.5") == "-5.5");
  CHECK(ppo::extract_gsm8k_answer("#### 3 then #### 4") == "4");
  CHECK(ppo::extract_gsm8k_answer("##### 7") == "7");
  CHECK_FALSE(ppo::extract_gsm8k_answer("The answer is 72").has_value());
  CHECK_FALSE(ppo::extract_gsm8k_answer("#### x").has_value());
  CHECK_FALSE(ppo::extract_gsm8k_answer("####72").has_value());
  // Only the last 300 characters are searched.
  CHECK_FALSE(ppo::extract_gsm8k_answer("#### 9" + std::string(300, ' ')).has_value());
  CHECK(ppo::extract_gsm8k_answer("#### 9" + std::string(294, ' ')) == "9");
  CHECK(ppo::compute_gsm8k_score("so... #### 1,234", "1234") == 1.0);
  CHECK(ppo::compute_gsm8k_score("#### 12", "13", {ppo::Gsm8kMethod::strict, 0.1, 1.0}) == 0.1);
  CHECK(ppo::compute_gsm8k_score("twelve", "12", {ppo::Gsm8kMethod::strict, 0.1, 1.0}) == 0.0);
}

TEST_CASE("GSM8K answers: flexible extraction takes the last number") {
  using ppo::Gsm8kMethod;
  CHECK(ppo::extract_gsm8k_answer("3 apples and 4 pears, so 7.", Gsm8kMethod::flexible) == "7.");
  CHECK(ppo::extract_gsm8k_answer("total: -1,200 dollars", Gsm8kMethod::flexible) == "-1,200");
  CHECK(ppo::extract_gsm8k_answer("12 then . end", Gsm8kMethod::flexible) == "12");
  CHECK(ppo::extract_gsm8k_answer("only . and .", Gsm8kMethod::flexible) == ".");  // verl's fall-through
  CHECK_FALSE(ppo::extract_gsm8k_answer("no digits", Gsm8kMethod::flexible).has_value());
  CHECK(ppo::compute_gsm8k_score("answer 42", "42", {Gsm8kMethod::flexible, 0.0, 1.0}) == 1.0);
}
