#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <string_view>

TEST_CASE("require throws InvalidArgument naming the function and the argument") {
  CHECK_NOTHROW(mrr::detail::require(true, "f", "never built"));
  try {
    mrr::detail::require(false, "ppo::compute_gae", "'values' has shape ", "[2, 3]", " but 'rewards' has [2, 4]");
    FAIL("require(false) did not throw");
  } catch (const mrr::InvalidArgument& e) {
    CHECK(std::string(e.what()) == "mrr::ppo::compute_gae: 'values' has shape [2, 3] but 'rewards' has [2, 4]");
  }
}

TEST_CASE("shape_of prints rows and columns") {
  mrr::RowMatrix<float> m(3, 5);
  CHECK(mrr::detail::shape_of(m) == "[3, 5]");
}

TEST_CASE("RouteFileError is a RouteStoreError") {
  CHECK_THROWS_AS(throw mrr::RouteFileError("x"), mrr::RouteStoreError);
}

// detail::str prints every value as a default-formatted std::ostream did before it stopped using
// one: messages are compared byte for byte by callers and tests.
TEST_CASE("str prints floating point as printf's %g with 6 significant digits") {
  using mrr::detail::str;
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(str(0.5) == "0.5");
  CHECK(str(0.1) == "0.1");
  CHECK(str(1.0) == "1");
  CHECK(str(100000.0) == "100000");
  CHECK(str(1000000.0) == "1e+06");
  CHECK(str(123456789.0) == "1.23457e+08");
  CHECK(str(0.0001) == "0.0001");
  CHECK(str(0.00001) == "1e-05");
  CHECK(str(1e-20) == "1e-20");
  CHECK(str(1e300) == "1e+300");
  CHECK(str(-2.5e-7) == "-2.5e-07");
  CHECK(str(0.0) == "0");
  CHECK(str(-0.0) == "-0");
  CHECK(str(inf) == "inf");
  CHECK(str(-inf) == "-inf");
  CHECK(str(std::numeric_limits<double>::quiet_NaN()) == "nan");
  CHECK(str(-std::numeric_limits<double>::quiet_NaN()) == "-nan");
  CHECK(str(std::numeric_limits<double>::denorm_min()) == "4.94066e-324");
  CHECK(str(1.5f) == "1.5");
  CHECK(str(0.1f) == "0.1");
  CHECK(str(3.0e38f) == "3e+38");
  CHECK(str(2.0L / 3) == "0.666667");
}

TEST_CASE("str prints integers, characters, bools, text and enums as ostream does") {
  using mrr::detail::str;
  enum Plain { three = 3 };
  enum Byte : std::uint8_t { letter = 'B' };
  CHECK(str(0) == "0");
  CHECK(str(-42) == "-42");
  CHECK(str(std::numeric_limits<std::int64_t>::min()) == "-9223372036854775808");
  CHECK(str(std::numeric_limits<std::uint64_t>::max()) == "18446744073709551615");
  CHECK(str(std::size_t{7}, 'x', std::int16_t{-3}) == "7x-3");
  CHECK(str(std::uint8_t{65}, std::int8_t{66}) == "AB");  // char types print as characters, as ostream does
  CHECK(str(true, false) == "10");
  CHECK(str(three, letter) == "3B");
  const std::string s = "text";
  const char* c = "chars";
  CHECK(str(s, ' ', std::string_view("view"), ' ', c, ' ', "literal") == "text view chars literal");
  CHECK(str() == "");
  CHECK(str("route file ", "r.mrr", ": ", 12, " records, scale ", 0.25) == "route file r.mrr: 12 records, scale 0.25");
}

TEST_CASE("str agrees with a default-formatted ostringstream on many values") {
  std::mt19937_64 rng(16);
  std::uniform_int_distribution<int> exponent(-330, 310);
  std::uniform_real_distribution<double> mantissa(-10.0, 10.0);
  for (int i = 0; i < 20000; ++i) {
    const double d = mantissa(rng) * std::pow(10.0, exponent(rng));
    const auto f = static_cast<float>(d);
    const auto n = static_cast<std::int64_t>(rng());
    std::ostringstream expected;
    expected << d << '|' << f << '|' << n << '|' << static_cast<std::uint32_t>(n);
    REQUIRE(mrr::detail::str(d, '|', f, '|', n, '|', static_cast<std::uint32_t>(n)) == expected.str());
  }
}
