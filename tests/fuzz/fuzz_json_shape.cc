// libFuzzer target: the JSON body limits (control::CheckJsonShape, control/control_routes.cc),
// counted before a body is parsed, and the parse that follows them (ServerImpl::ParseBody:
// nlohmann's, without exceptions).
//
// Input: two bytes of settings (the depth limit, 1 to 32, and the element limit, 1 to 256,
// or the server's defaults when both are 0), then the body.
//
// Besides crashes, leaks and UBSan reports: a body the count lets through that parses must be
// within the limits when its parsed values are counted: no deeper than the depth limit and no
// more values (arrays, objects and scalars; not object keys) than the element limit. The count
// exists so that a body's parsed form is bounded by the limits, not by the body's size.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "control/control_server.h"

namespace {

using json = nlohmann::json;

// Values in `j` (itself included) and its nesting (0 for a scalar), without recursion.
void Measure(const json& root, uint64_t* values, int* depth) {
  *values = 0;
  *depth = 0;
  std::vector<std::pair<const json*, int>> todo{{&root, 0}};
  while (!todo.empty()) {
    auto [j, d] = todo.back();
    todo.pop_back();
    ++*values;
    if (j->is_structured()) {
      if (d + 1 > *depth) *depth = d + 1;
      for (const auto& child : *j) todo.emplace_back(&child, d + 1);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const cubetorchfs::control::ControlServer::Options defaults;
  int max_depth = 1 + data[0] % 32;
  uint64_t max_elements = 1 + data[1];
  if (data[0] == 0 && data[1] == 0) {
    max_depth = defaults.max_json_depth;
    max_elements = defaults.max_json_elements;
  }
  const std::string body(reinterpret_cast<const char*>(data + 2), size - 2);

  const cubetorchfs::Status shape =
      cubetorchfs::control::CheckJsonShape(body, max_depth, max_elements);
  if (!shape.ok()) return 0;  // 400, never parsed
  const json parsed = json::parse(body, nullptr, false);
  if (parsed.is_discarded()) return 0;  // 400
  uint64_t values = 0;
  int depth = 0;
  Measure(parsed, &values, &depth);
  if (depth > max_depth) {
    std::fprintf(stderr, "fuzz_json_shape: depth %d passed a limit of %d\n", depth, max_depth);
    std::abort();
  }
  if (values > max_elements) {
    std::fprintf(stderr, "fuzz_json_shape: %llu values passed a limit of %llu\n",
                 static_cast<unsigned long long>(values),
                 static_cast<unsigned long long>(max_elements));
    std::abort();
  }
  return 0;
}
