#include "prefetch/access.h"

#include <arpa/inet.h>
#include <grp.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>

#include "common/parallel.h"
#include "common/unique_fd.h"

namespace cubetorchfs::prefetch {

bool Caller::InGroup(gid_t g) const {
  return g == gid || std::find(groups.begin(), groups.end(), g) != groups.end();
}

namespace {

// Supplementary groups of `uid` from the user database (as login would set them).
std::vector<gid_t> GroupsOf(uid_t uid, gid_t gid) {
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
  int n = 64;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) {
    if (n <= 0 || n > 65536) return {};
    groups.resize(static_cast<size_t>(n));
    if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) return {};
  }
  groups.resize(static_cast<size_t>(n));
  return groups;
}

gid_t PrimaryGid(uid_t uid) {
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr)
    return static_cast<gid_t>(-1);  // no such user: no group but "other"
  return pw.pw_gid;
}

}  // namespace

Result<Caller> UnixPeer(int fd) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return Status::IOError(std::string("SO_PEERCRED: ") + std::strerror(errno));
  Caller c;
  c.uid = cred.uid;
  c.gid = cred.gid;
  c.pid = cred.pid;
  std::vector<gid_t> groups(64);
  len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int r = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len);
  if (r != 0 && errno == ERANGE && len / sizeof(gid_t) <= 65536) {
    groups.resize(len / sizeof(gid_t));
    r = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len);
  }
  if (r == 0) {
    groups.resize(len / sizeof(gid_t));
    c.groups = std::move(groups);
  } else {
    c.groups = GroupsOf(c.uid, c.gid);
  }
  return c;
}

Result<Caller> TcpPeer(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t llen = sizeof(local), plen = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0)
    return Status::IOError(std::string("getpeername: ") + std::strerror(errno));
  if (local.ss_family != AF_INET || peer.ss_family != AF_INET)
    return Status::PermissionDenied("not an IPv4 loopback connection");
  const auto& l4 = reinterpret_cast<const sockaddr_in&>(local);
  const auto& p4 = reinterpret_cast<const sockaddr_in&>(peer);

  UniqueFd nl(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (nl.get() < 0)
    return Status::IOError(std::string("NETLINK_SOCK_DIAG: ") + std::strerror(errno));
  struct timeval tv {
    1, 0
  };
  ::setsockopt(nl.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof(msg);
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.nlh.nlmsg_seq = 1;
  msg.req.sdiag_family = AF_INET;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0u;
  // The peer's socket: its source is the peer's address, its destination ours.
  msg.req.id.idiag_sport = p4.sin_port;
  msg.req.id.idiag_dport = l4.sin_port;
  msg.req.id.idiag_src[0] = p4.sin_addr.s_addr;
  msg.req.id.idiag_dst[0] = l4.sin_addr.s_addr;
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(nl.get(), &msg, sizeof(msg), 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof(kernel)) < 0)
    return Status::IOError(std::string("sock_diag request: ") + std::strerror(errno));
  alignas(nlmsghdr) char buf[8192];
  const ssize_t n = ::recv(nl.get(), buf, sizeof(buf), 0);
  if (n < 0) return Status::IOError(std::string("sock_diag reply: ") + std::strerror(errno));
  int left = static_cast<int>(n);
  for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
    if (h->nlmsg_type == NLMSG_ERROR || h->nlmsg_type == NLMSG_DONE) break;
    if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) continue;
    const auto* d = reinterpret_cast<const inet_diag_msg*>(NLMSG_DATA(h));
    if (d->id.idiag_sport != p4.sin_port || d->id.idiag_dport != l4.sin_port) continue;
    // A peer socket no process holds any more (closed: orphaned, or a time-wait remnant the
    // kernel reports as uid 0) names nobody; taking its uid would make any user root.
    if (d->idiag_inode == 0)
      return Status::PermissionDenied("the peer closed its socket before it was identified");
    Caller c;
    c.uid = d->idiag_uid;
    c.gid = PrimaryGid(c.uid);
    c.groups = GroupsOf(c.uid, c.gid);
    return c;
  }
  return Status::PermissionDenied("the kernel does not know the peer of this connection");
}

bool MayAccess(const cfs_client::FileAttr& a, const Caller& c, int want) {
  if (c.IsRoot()) {
    // Root reads and searches anything; it executes only what someone may execute.
    if ((want & X_OK) && !a.IsDir() && (a.mode & 0111) == 0) return false;
    return true;
  }
  mode_t bits;
  if (a.uid == c.uid)
    bits = (a.mode >> 6) & 7;
  else if (c.InGroup(a.gid))
    bits = (a.mode >> 3) & 7;
  else
    bits = a.mode & 7;
  return (bits & static_cast<mode_t>(want)) == static_cast<mode_t>(want);
}

const char* RejectName(Reject r) {
  switch (r) {
    case Reject::kNone:
      return "none";
    case Reject::kOutside:
      return "outside";
    case Reject::kSymlink:
      return "symlink";
    case Reject::kPermission:
      return "permission";
    case Reject::kNotFound:
      return "not_found";
    case Reject::kNotFile:
      return "not_file";
    case Reject::kLoop:
      return "loop";
    case Reject::kStore:
      return "store";
  }
  return "unknown";
}

PathResolver::PathResolver(const Options& options, cfs_client::Backend* backend, Clock* clock)
    : options_(options), backend_(backend), clock_(clock) {}

Result<cfs_client::FileAttr> PathResolver::StatCached(const std::string& path, bool fresh,
                                                      uint64_t dir_id) {
  const uint64_t now = clock_->NowNanos();
  const auto ttl = static_cast<uint64_t>(options_.ttl_s * 1e9);
  if (!fresh && options_.known_attr) {
    if (std::optional<cfs_client::FileAttr> known = options_.known_attr(path, dir_id))
      return *known;
  }
  if (!fresh) {
    MutexLock l(mu_);
    auto it = cache_.find(path);
    if (it != cache_.end() && now - it->second.time_ns < ttl && it->second.dir_id == dir_id)
      return it->second.attr;
  }
  const size_t slash = path.rfind('/');
  const std::string_view parent =
      slash == std::string::npos ? std::string_view() : std::string_view(path).substr(0, slash);
  Result<cfs_client::FileAttr> a = [&] {
    const cfs_client::Expected::Scope in_dir({{parent, dir_id}});
    return backend_->Stat(path);
  }();
  if (a.ok() && ttl > 0) {
    MutexLock l(mu_);
    if (cache_.size() >= options_.max_cached) cache_.clear();
    cache_[path] = Cached{a.value(), now, dir_id};
  }
  return a;
}

uint64_t PathResolver::HeldDirId(const std::string& path) {
  if (options_.known_attr) {
    if (std::optional<cfs_client::FileAttr> known = options_.known_attr(path, 0))
      return known->StoreId();
  }
  const uint64_t now = clock_->NowNanos();
  const auto ttl = static_cast<uint64_t>(options_.ttl_s * 1e9);
  MutexLock l(mu_);
  auto it = cache_.find(path);
  return it != cache_.end() && now - it->second.time_ns < ttl ? it->second.attr.StoreId() : 0;
}

void PathResolver::Warm(const std::vector<std::string>& dirs) {
  if (!options_.check_store || dirs.empty()) return;
  const uint64_t now = clock_->NowNanos();
  const auto ttl = static_cast<uint64_t>(options_.ttl_s * 1e9);
  if (ttl == 0) return;
  std::vector<const std::string*> todo;
  {
    MutexLock l(mu_);
    for (const std::string& d : dirs) {
      auto it = cache_.find(d);
      if (it == cache_.end() || now - it->second.time_ns >= ttl) todo.push_back(&d);
    }
  }
  if (options_.known_attr)
    std::erase_if(todo, [this](const std::string* d) { return options_.known_attr(*d, 0); });
  if (todo.size() < 2) return;  // one is asked as Resolve comes to it
  // Each is asked in its parent as held then (bound to it, as Resolve, walking down, asks):
  // so the shallower first, a depth at a time, each depth on parallel threads.
  auto depth = [](const std::string* d) { return std::count(d->begin(), d->end(), '/'); };
  std::stable_sort(todo.begin(), todo.end(),
                   [&](const std::string* a, const std::string* b) { return depth(a) < depth(b); });
  // The root's entries are asked in the root: its identity first (one request, once a ttl).
  if (depth(todo.front()) == 0) (void)StatCached("", false, 0);
  for (size_t begin = 0; begin < todo.size();) {
    size_t end = begin;
    while (end < todo.size() && depth(todo[end]) == depth(todo[begin])) ++end;
    std::vector<uint64_t> parents(end - begin);
    for (size_t k = begin; k < end; ++k) {
      const size_t slash = todo[k]->rfind('/');
      parents[k - begin] =
          HeldDirId(slash == std::string::npos ? std::string() : todo[k]->substr(0, slash));
    }
    std::atomic<size_t> next{begin};
    auto work = [&] {
      for (size_t k; (k = next.fetch_add(1)) < end;)
        (void)StatCached(*todo[k], false, parents[k - begin]);
    };
    RunOnThreads(static_cast<int>(std::min(kWarmThreads, end - begin)), work);
    begin = end;
  }
}

namespace {

// A path that names something other than a regular file: a directory is EISDIR; a FIFO,
// socket or device is EINVAL (never reported as a directory).
Status NotAFile(const std::string& path, const cfs_client::FileAttr& a) {
  if (a.IsDir()) return Status::IsDirectory(path + ": names a directory, not a regular file");
  return Status::InvalidArgument(path + ": not a regular file (a FIFO, socket or device)");
}

// The components of a path still to resolve, and how many of them name something (not "" or
// "."): the count says in O(1) whether a component is the last.
class Components {
 public:
  explicit Components(const std::string& path) { PushFront(path); }
  // A symlink's target takes the place of the link.
  void PushFront(const std::string& p) {
    std::vector<std::string> parts;
    for (size_t start = 0; start <= p.size();) {
      size_t slash = p.find('/', start);
      if (slash == std::string::npos) slash = p.size();
      parts.push_back(p.substr(start, slash - start));
      start = slash + 1;
    }
    for (const auto& part : parts) named_ += !part.empty() && part != ".";
    todo_.insert(todo_.begin(), parts.begin(), parts.end());
  }
  // The next component that names something, if any.
  std::optional<std::string> Next() {
    while (!todo_.empty()) {
      std::string part = std::move(todo_.front());
      todo_.pop_front();
      if (part.empty() || part == ".") continue;
      --named_;
      return part;
    }
    return std::nullopt;
  }
  bool Last() const { return named_ == 0; }  // the component Next gave was the last

 private:
  std::deque<std::string> todo_;
  size_t named_ = 0;
};

}  // namespace

Result<PathResolver::Resolved> PathResolver::ResolveLexical(const std::string& path, bool fresh,
                                                            Reject* why) {
  if (!fresh) return Resolved{path, {}};
  Result<cfs_client::FileAttr> a = backend_->Stat(path);
  if (!a.ok()) {
    const bool missing =
        a.status().IsNotFound() || a.status().code() == Status::Code::kNotDirectory;
    *why = missing ? Reject::kNotFound : Reject::kStore;
    return a.status();
  }
  if (!a->IsRegular()) {
    *why = Reject::kNotFile;
    return NotAFile(path, *a);
  }
  return Resolved{path, a.value()};
}

Result<PathResolver::Resolved> PathResolver::Resolve(const std::string& path, const Caller& caller,
                                                     bool fresh, Reject* why, Depth depth,
                                                     Searched* searched) {
  *why = Reject::kNone;
  auto fail = [why](Reject r, Status s) {
    *why = r;
    return s;
  };
  if (!options_.check_store) return ResolveLexical(path, fresh, why);
  Components todo(path);
  // Bounded work whatever the store's links: 40 links, and at most this many steps.
  constexpr int kMaxSteps = 4096;
  int steps = 0;
  // The root itself must be searchable.
  uint64_t root_id = searched != nullptr ? searched->root_id : 0;
  if (searched == nullptr || !searched->root) {
    Result<cfs_client::FileAttr> root = StatCached("", false, 0);
    if (!root.ok()) return fail(Reject::kStore, root.status());
    if (!MayAccess(*root, caller, X_OK))
      return fail(Reject::kPermission, Status::PermissionDenied(path + ": permission denied"));
    root_id = root->StoreId();
    if (searched != nullptr) {
      searched->root = true;
      searched->root_id = root_id;
    }
  }
  constexpr size_t kMaxSearched = 4096;
  std::string done;  // resolved so far: real directories only
  // The store identities of the directories of `done`, one a component: each next component
  // is looked up in the very directory whose rights were checked (docs/security.md).
  std::vector<uint64_t> ids;
  auto done_id = [&] { return ids.empty() ? root_id : ids.back(); };
  int links = 0;
  while (std::optional<std::string> next = todo.Next()) {
    const std::string& part = *next;
    if (++steps > kMaxSteps)
      return fail(Reject::kLoop, Status::Errno(ELOOP, path + ": too many components to resolve"));
    if (part == "..") {
      const size_t slash = done.rfind('/');
      if (done.empty())
        return fail(Reject::kSymlink, Status::PermissionDenied(path + ": leaves the store's root"));
      done.erase(slash == std::string::npos ? 0 : slash);
      ids.pop_back();
      continue;
    }
    const std::string cur = done.empty() ? part : done + "/" + part;
    // The last component is the file once nothing is left to resolve.
    const bool last = todo.Last();
    if (last && depth == Depth::kDirectories) return Resolved{cur, {}};
    if (!last && searched != nullptr) {
      if (auto it = searched->dirs.find(cur); it != searched->dirs.end()) {  // a real directory
        done = cur;
        ids.push_back(it->second);
        continue;
      }
    }
    // Directories as the mount sees them; the file (and whether it is a link) as of now.
    Result<cfs_client::FileAttr> a = StatCached(cur, fresh && last, done_id());
    if (!a.ok()) {
      const bool missing =
          a.status().IsNotFound() || a.status().code() == Status::Code::kNotDirectory;
      return fail(missing ? Reject::kNotFound : Reject::kStore, a.status());
    }
    if (a->IsSymlink()) {
      if (++links > 40)
        return fail(Reject::kLoop, Status::Errno(ELOOP, path + ": too many levels of symlinks"));
      Result<std::string> target = [&] {
        const cfs_client::Expected::Scope in_dir({{done, done_id()}});
        return backend_->ReadLink(cur);
      }();
      if (!target.ok()) return fail(Reject::kStore, target.status());
      if (target->empty() || (*target)[0] == '/')
        return fail(Reject::kSymlink,
                    Status::PermissionDenied(path + ": " + cur + " is an absolute symlink"));
      todo.PushFront(target.value());
      continue;
    }
    if (!last) {
      if (!a->IsDir())
        return fail(Reject::kNotFound,
                    Status::NotDirectory(path + ": " + cur + " is not a directory"));
      if (!MayAccess(*a, caller, X_OK))
        return fail(Reject::kPermission, Status::PermissionDenied(path + ": permission denied"));
      if (searched != nullptr && searched->dirs.size() < kMaxSearched)
        searched->dirs.emplace(cur, a->StoreId());
      done = cur;
      ids.push_back(a->StoreId());
      continue;
    }
    if (!a->IsRegular()) return fail(Reject::kNotFile, NotAFile(path, *a));
    if (!MayAccess(*a, caller, R_OK))
      return fail(Reject::kPermission, Status::PermissionDenied(path + ": permission denied"));
    return Resolved{cur, a.value()};
  }
  return fail(Reject::kNotFile, Status::IsDirectory(path + ": names a directory"));
}

}  // namespace cubetorchfs::prefetch
