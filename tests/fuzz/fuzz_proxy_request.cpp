// libFuzzer target for what the reward proxy decides about a request before any I/O
// (mrr/reward/request_checks.hpp): worker-URL validation and the allow-list, admin authentication
// and command parsing, hop-by-hop header filtering, strict request-head parsing (request
// smuggling shapes), body framing and the chunked decoder. Every
// input must end in a result or an mrr::InvalidArgument; anything else (another exception, a
// sanitizer report, a broken invariant) is a bug.
//
// Input: the first byte picks the function; the rest is split at '\n' where several fields are
// needed (method, path, url parameter, body; or header lines "Name: value"). In head mode the
// rest is also parsed whole as a raw request head ("POST / HTTP/1.1\r\n...\r\n\r\n").
#include <mrr/reward/request_checks.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

std::vector<std::string_view> split(std::string_view text, char sep, std::size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const auto at = text.find(sep);
    if (at == std::string_view::npos) break;
    parts.push_back(text.substr(0, at));
    text.remove_prefix(at + 1);
  }
  parts.push_back(text);
  return parts;
}

mrr::reward::Headers headers_of(std::string_view text) {
  mrr::reward::Headers out;
  for (const auto line : split(text, '\n', 64)) {
    const auto colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    out.emplace_back(std::string(line.substr(0, colon)), std::string(line.substr(colon + 1)));
  }
  return out;
}

void check(bool invariant) {
  if (!invariant) std::abort();
}

void worker_url(std::string_view input) {
  try {
    const auto url = mrr::reward::check_worker_url(input, mrr::reward::WorkerUrlPolicy{{"127.0.0.1", "::1"}});
    // What is accepted can be put in a request line: no control characters, spaces or non-ASCII.
    for (const std::string_view part : {std::string_view(url.host), std::string_view(url.base_path)})
      for (const char c : part)
        check(static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f);
    check(url.port >= 1 && url.port <= 65535);
    check(url.host == "127.0.0.1" || url.host == "::1");
    (void)mrr::reward::parse_worker_url(url.origin());  // an origin re-parses
  } catch (const mrr::InvalidArgument&) {
  }
}

void admin(std::string_view input) {
  const auto f = split(input, '\n', 5);
  const std::string_view method = f[0];
  const std::string_view path = f.size() > 1 ? f[1] : "";
  const std::optional<std::string_view> url = f.size() > 2 && !f[2].empty() ? std::optional(f[2]) : std::nullopt;
  const std::string_view authorization = f.size() > 3 ? f[3] : "";
  const std::string_view body = f.size() > 4 ? f[4] : "";
  (void)mrr::reward::bearer_token_matches(authorization, "fuzz-admin-token-0123456789");
  check(!mrr::reward::bearer_token_matches(authorization, ""));
  const auto parsed = mrr::reward::parse_admin_command(method, path, url, body, {});
  if (const auto* command = std::get_if<mrr::reward::AdminCommand>(&parsed)) {
    if (command->kind == mrr::reward::AdminCommand::Kind::add) (void)mrr::reward::parse_worker_url(command->url);
  } else {
    const auto& rejection = std::get<mrr::reward::RequestRejection>(parsed);
    check(rejection.status >= 400 && rejection.status < 600);
    (void)mrr::reward::json_error_body(rejection.error, rejection.detail);
  }
}

// A raw head: what parse_request_head accepts holds no byte that could frame a request differently
// behind the proxy, and its framing check agrees with the fields it parsed.
void raw_head(std::string_view input) {
  const auto end = mrr::reward::find_head_end(input);
  const auto parsed = mrr::reward::parse_request_head(input.substr(0, end));  // all of it without an end
  if (const auto* rejection = std::get_if<mrr::reward::RequestRejection>(&parsed)) {
    check(rejection->status >= 400 && rejection->status < 600);
    (void)mrr::reward::json_error_body(rejection->error, rejection->detail);
    return;
  }
  check(end != std::string_view::npos);
  const auto& head = std::get<mrr::reward::RequestHead>(parsed);
  check(head.version == "HTTP/1.1" || head.version == "HTTP/1.0");
  for (const char c : head.target)
    check(c > 0x20 && c < 0x7f);
  for (const auto& [name, value] : head.headers) {
    check(!name.empty());
    for (const char c : name)
      check(mrr::reward::detail::is_tchar(c));
    for (const char c : value)
      check(mrr::reward::detail::is_field_value_byte(c));
    check(value.empty() || (value.front() != ' ' && value.back() != ' '));
  }
  (void)mrr::reward::check_request_head(head.target, head.headers, 1 << 20);
}

void head(std::string_view input) {
  raw_head(input);
  const auto f = split(input, '\n', 2);
  const auto headers = headers_of(f.size() > 1 ? f[1] : "");
  const auto forwarded = mrr::reward::forwardable(headers);
  for (const auto& [name, value] : forwarded)
    check(!mrr::reward::is_unforwardable_header(name));
  const auto verdict = mrr::reward::check_request_head(f[0], headers, 1 << 20);
  if (verdict.rejection) {
    check(verdict.rejection->status >= 400 && verdict.rejection->status < 600);
    (void)mrr::reward::json_error_body(verdict.rejection->error, verdict.rejection->detail);
  } else if (verdict.framing.kind == mrr::reward::BodyFraming::Kind::length) {
    check(verdict.framing.length > 0 && verdict.framing.length <= (1 << 20));
  }
}

void chunked(std::string_view input) {
  // Fed in two pieces, split where the first byte says, to exercise the incremental state.
  const std::size_t cut = input.empty() ? 0 : static_cast<unsigned char>(input[0]) % (input.size() + 1);
  mrr::reward::ChunkedDecoder decoder(4096);
  std::string body;
  std::size_t used = decoder.feed(input.substr(0, cut), body);
  if (!decoder.done() && !decoder.failed()) used += decoder.feed(input.substr(cut), body);
  check(used <= input.size());
  check(body.size() <= 4096);
  (void)mrr::reward::find_head_end(input);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      worker_url(input);
      break;
    case 1:
      admin(input);
      break;
    case 2:
      head(input);
      break;
    default:
      chunked(input);
      break;
  }
  return 0;
}
