// Expected (backend.h): the store objects a thread's requests must reach, as a small stack of
// bindings per thread. A request looks its paths up here only when a binding is alive, so a
// thread that set none pays one load of a thread-local.

#include <vector>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {

namespace {

thread_local std::vector<Expected::Object> t_expected;

}  // namespace

Expected::Scope::Scope(std::initializer_list<Object> objects) {
  for (const Object& o : objects) {
    if (o.id == 0) continue;
    t_expected.push_back(o);
    ++pushed_;
  }
}

Expected::Scope::~Scope() { t_expected.resize(t_expected.size() - pushed_); }

bool Expected::Any() { return !t_expected.empty(); }

uint64_t Expected::IdOf(std::string_view path) {
  for (auto it = t_expected.rbegin(); it != t_expected.rend(); ++it)
    if (it->path == path) return it->id;
  return 0;
}

Status Expected::Check(std::string_view path, uint64_t found, const char* what) {
  const uint64_t want = IdOf(path);
  if (want == 0 || found == want) return Status::OK();
  return Status::Stale(std::string(what) + " " + std::string(path.empty() ? "/" : path) +
                       ": another object than the one checked is there now in the store");
}

}  // namespace cubetorchfs::cfs_client
