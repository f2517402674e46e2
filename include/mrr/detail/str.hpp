// detail::str: the message text of mrr's exceptions, built from the values it names. Each value
// is printed as `std::ostream << value` prints it with the stream's default format (so messages
// read as they always have), without <sstream>/<ostream>, which would otherwise reach every
// translation unit through mrr/error.hpp. <format> is not available on every supported compiler.
#pragma once

#include <mrr/detail/config.hpp>

#include <charconv>
#include <string>
#include <string_view>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace detail {

template <class T, bool = std::is_enum_v<T>>
inline constexpr bool is_unscoped_enum_v = false;
template <class T>
inline constexpr bool is_unscoped_enum_v<T, true> = std::is_convertible_v<T, std::underlying_type_t<T>>;

template <class T>
inline constexpr bool is_char_like_v =
    std::is_same_v<T, char> || std::is_same_v<T, signed char> || std::is_same_v<T, unsigned char>;

// Appends `value` as a default-formatted std::ostream prints it: text as is; char types (int8_t
// and uint8_t included) as one character; bool as 1 or 0; integers in decimal; floating point as
// printf's %g (6 significant digits: 0.1, 1e-05, 1.23457e+08, inf, -nan); an unscoped enum as its
// underlying type. Any other type does not compile: give it a printing of its own first.
template <class T>
void append_text(std::string& out, const T& value) {
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out.append(std::string_view(value));
  } else if constexpr (is_char_like_v<T>) {
    out.push_back(static_cast<char>(value));
  } else if constexpr (std::is_same_v<T, bool>) {
    out.push_back(value ? '1' : '0');
  } else if constexpr (std::is_integral_v<T>) {
    char buf[24];  // 20 digits and a sign for 64 bits
    out.append(buf, std::to_chars(buf, buf + sizeof buf, value).ptr);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[32];  // "-d.ddddde+dddd" at most
    out.append(buf, std::to_chars(buf, buf + sizeof buf, value, std::chars_format::general, 6).ptr);
  } else if constexpr (is_unscoped_enum_v<T>) {
    append_text(out, static_cast<std::underlying_type_t<T>>(value));
  } else {
    static_assert(!sizeof(T*), "mrr::detail::str: no text for this type; pass a string, a character, a number or "
                               "an unscoped enum");
  }
}

// Concatenates the text of every argument: str("k=", 8, ", scale ", 0.5) is "k=8, scale 0.5".
template <class... Args>
std::string str(const Args&... args) {
  std::string out;
  (append_text(out, args), ...);
  return out;
}

}  // namespace detail
MRR_NAMESPACE_END
