// The control API's route matching (routes.h).
#include "control/routes.h"

#include <boost/beast/http.hpp>
#include <string>
#include <string_view>

namespace cubetorchfs::control::detail {

namespace {

// Whether `target` has the shape of `pattern`; the "{id}" segment goes to *id.
bool Matches(std::string_view pattern, std::string_view target, std::string* id) {
  constexpr std::string_view kId = "{id}";
  const size_t at = pattern.find(kId);
  if (at == std::string_view::npos) return pattern == target;
  const std::string_view head = pattern.substr(0, at), tail = pattern.substr(at + kId.size());
  if (target.size() <= head.size() + tail.size() || target.substr(0, head.size()) != head ||
      target.substr(target.size() - tail.size()) != tail)
    return false;
  const std::string_view segment =
      target.substr(head.size(), target.size() - head.size() - tail.size());
  if (segment.find('/') != std::string_view::npos) return false;
  id->assign(segment);
  return true;
}

}  // namespace

RouteMatch MatchRoute(boost::beast::http::verb method, std::string_view target,
                      std::span<const RouteSpec> routes) {
  RouteMatch m;
  for (const RouteSpec& r : routes) {
    std::string id;
    if (!Matches(r.pattern, target, &id)) continue;
    if (r.method == method) {
      m.route = &r;
      m.id = std::move(id);
      m.allowed.clear();
      return m;
    }
    const auto name = boost::beast::http::to_string(r.method);
    const std::string method_name(name.data(), name.size());
    if (m.allowed.find(method_name) == std::string::npos) {
      if (!m.allowed.empty()) m.allowed += ", ";
      m.allowed += method_name;
    }
  }
  return m;
}

}  // namespace cubetorchfs::control::detail
