#include "loader/daemon_fd.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "common/thread_annotations.h"
#include "common/trusted_file.h"
#include "common/unique_fd.h"

namespace cubetorchfs::loader {

namespace {

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7' && s[i + 2] >= '0' &&
        s[i + 2] <= '7' && s[i + 3] >= '0' && s[i + 3] <= '7') {
      out.push_back(
          static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

bool Contains(const std::string& mount_point, const std::string& path) {
  if (mount_point == "/") return true;
  return path.compare(0, mount_point.size(), mount_point) == 0 &&
         (path.size() == mount_point.size() || path[mount_point.size()] == '/');
}

int RemainingMs(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(left.count());
}

// Waits until `fd` is ready for `events` or the deadline passes.
Status WaitFor(int fd, short events, std::chrono::steady_clock::time_point deadline,
               const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = RemainingMs(deadline);
    if (ms == 0) return Status::IOError("control socket: timed out " + what);
    int n = ::poll(&p, 1, ms);
    if (n > 0) return Status::OK();
    if (n < 0 && errno != EINTR)
      return Status::IOError("control socket: poll: " + std::string(std::strerror(errno)));
  }
}

// One line on stderr per path and process: the loader then reads through the mount.
void WarnOnce(const std::string& path, const std::string& message) {
  static Mutex mu;
  static std::set<std::string>* warned = new std::set<std::string>();
  {
    MutexLock l(mu);
    if (!warned->insert(path).second) return;
  }
  std::fprintf(stderr, "cube_torch: warning: %s; not using it (reading through the mount)\n",
               message.c_str());
}

Status Untrusted(const std::string& path, const std::string& why) {
  WarnOnce(path, why);
  return Status::PermissionDenied(why);
}

// A reply read from the control socket: its bytes and the descriptor that came with them.
struct Reply {
  std::string bytes;
  UniqueFd fd{-1};
  size_t header_end = std::string::npos;  // end of the HTTP head (npos until it is in)
  size_t content_length = 0;
};

// Returns a non-blocking socket connecting (or connected) to the control socket.
Result<UniqueFd> ConnectControlSocket(const std::string& socket_path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path))
    return Status::InvalidArgument("control socket path too long: " + socket_path);
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (sock.get() < 0) return Status::IOError(std::string("socket: ") + std::strerror(errno));
  if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS && errno != EAGAIN)
    return Status::IOError("control socket " + socket_path + ": " + std::strerror(errno));
  return sock;
}

// Sends the HTTP request that asks the daemon to open `path`.
Status SendOpenRequest(int sock, const std::string& socket_path, const std::string& path,
                       std::chrono::steady_clock::time_point deadline) {
  const std::string body =
      nlohmann::json{{"path", path}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string request =
      "POST /v1/files/open HTTP/1.1\r\nHost: cubetorchfs\r\n"
      "Content-Type: application/json\r\nConnection: close\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    CTFS_RETURN_IF_ERROR(WaitFor(sock, POLLOUT, deadline, "sending the request"));
    ssize_t n = ::send(sock, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Status::IOError("control socket " + socket_path + ": send: " + std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
  }
  return Status::OK();
}

// Takes the descriptors passed in `msg`: keeps the first in *received, closes the rest.
void TakeDescriptors(msghdr* msg, UniqueFd* received) {
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (received->get() < 0)
        received->reset(fd);
      else
        ::close(fd);  // only one is expected
    }
  }
}

// Notes where the reply's HTTP head ends, and its Content-Length, once the head is in.
void ParseHead(Reply* reply) {
  size_t p = reply->bytes.find("\r\n\r\n");
  if (p != std::string::npos) {
    reply->header_end = p + 4;
    std::string head = reply->bytes.substr(0, p);
    for (char& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    size_t cl = head.find("content-length:");
    if (cl != std::string::npos)
      reply->content_length = std::strtoull(head.c_str() + cl + 15, nullptr, 10);
  }
}

// Reads the reply until its body is in or the daemon closes the connection.
Status ReadReply(int sock, std::chrono::steady_clock::time_point deadline, Reply* reply) {
  for (;;) {
    if (reply->header_end != std::string::npos &&
        reply->bytes.size() >= reply->header_end + reply->content_length)
      break;
    CTFS_RETURN_IF_ERROR(WaitFor(sock, POLLIN, deadline, "waiting for the daemon's reply"));
    char buf[4096];
    iovec iov{buf, sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Status::IOError("control socket: recvmsg: " + std::string(std::strerror(errno)));
    }
    TakeDescriptors(&msg, &reply->fd);
    if (n == 0) break;
    reply->bytes.append(buf, static_cast<size_t>(n));
    if (reply->header_end == std::string::npos) ParseHead(reply);
    if (reply->bytes.size() > (1u << 20))
      return Status::Corruption("control socket: reply too large");
  }
  return Status::OK();
}

// Returns the daemon's descriptor and file size from a complete reply, or the daemon's error.
Result<DaemonFile> ParseReply(Reply* reply) {
  if (reply->header_end == std::string::npos)
    return Status::IOError("control socket: the daemon closed the connection without a reply");
  const std::string& bytes = reply->bytes;
  int code = 0;
  if (bytes.rfind("HTTP/1.", 0) == 0 && bytes.size() > 12) code = std::atoi(bytes.c_str() + 9);
  nlohmann::json j = nlohmann::json::parse(bytes.substr(reply->header_end), nullptr, false);
  if (code != 200) {
    std::string why = (j.is_object() && j.contains("error") && j["error"].is_string())
                          ? j["error"].get<std::string>()
                          : "HTTP " + std::to_string(code);
    // The reply's code says which status the daemon's request ended in.
    if (j.is_object() && j.contains("code") && j["code"].is_string()) {
      const int64_t err =
          j.contains("errno") && j["errno"].is_number_integer() ? j["errno"].get<int64_t>() : 0;
      return Status::FromWire(j["code"].get<std::string>(), "daemon: " + why, err);
    }
    if (code == 501 || code == 405 || code == 404) return Status::NotSupported("daemon: " + why);
    return Status::IOError("daemon: " + why);
  }
  if (reply->fd.get() < 0) return Status::IOError("daemon: reply carried no file descriptor");
  if (!j.is_object() || !j.contains("size") || !j["size"].is_number_unsigned())
    return Status::Corruption("daemon: reply without a size");
  return DaemonFile{reply->fd.release(), j["size"].get<uint64_t>()};
}

}  // namespace

Status CheckControlSocket(const std::string& socket_path) {
  struct stat st;
  if (::lstat(socket_path.c_str(), &st) != 0) {
    if (errno == ENOENT)
      return Status::NotFound(socket_path + ": no control socket (is the daemon running?)");
    return Status::IOError("control socket " + socket_path + ": " + std::strerror(errno));
  }
  if (S_ISLNK(st.st_mode))
    return Untrusted(socket_path, "control socket " + socket_path + " is a symlink (owned by " +
                                      OwnerName(st.st_uid) + ")");
  if (!S_ISSOCK(st.st_mode))
    return Untrusted(socket_path, "control socket " + socket_path + " is not a socket (owned by " +
                                      OwnerName(st.st_uid) + ")");
  if (!TrustedOwner(st.st_uid))
    return Untrusted(socket_path, "control socket " + socket_path + " is owned by " +
                                      OwnerName(st.st_uid) + ", neither root nor this user");
  // Its directory: nobody else may put another socket in its place.
  const size_t slash = socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : socket_path.substr(0, slash);
  struct stat d;
  if (::stat(dir.c_str(), &d) != 0)
    return Status::IOError("control socket directory " + dir + ": " + std::strerror(errno));
  if (!TrustedOwner(d.st_uid) ||
      ((d.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (d.st_mode & S_ISVTX) == 0))
    return Untrusted(socket_path, "control socket " + socket_path + ": its directory " + dir +
                                      " (owned by " + OwnerName(d.st_uid) +
                                      ") lets other users replace it");
  return Status::OK();
}

std::optional<MountOf> FindCubetorchfsMount(const std::string& path, const std::string& mountinfo) {
  std::string text = mountinfo;
  if (text.empty()) {
    std::ifstream in("/proc/self/mountinfo");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  std::optional<MountOf> best;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    // id parent major:minor root mount_point options [optional fields...] - fstype source super
    std::istringstream f(line);
    std::string id, parent, dev, root, mnt, opts, tok;
    if (!(f >> id >> parent >> dev >> root >> mnt >> opts)) continue;
    while (f >> tok && tok != "-") {
    }
    std::string fstype, source;
    if (!(f >> fstype >> source)) continue;
    if (fstype != "fuse.cubetorchfs") continue;
    const std::string prefix = "cubetorchfs:";
    if (source.rfind(prefix, 0) != 0) continue;
    std::string mount_point = Unescape(mnt);
    if (!Contains(mount_point, path)) continue;
    if (!best || mount_point.size() > best->mount_point.size())
      best = MountOf{mount_point, Unescape(source.substr(prefix.size())), Unescape(root)};
  }
  return best;
}

std::string MountOf::StorePath(const std::string& path) const {
  std::string rel = mount_point == "/" ? path : path.substr(mount_point.size());
  std::string base = root == "/" ? "" : root;
  std::string out = base + rel;
  size_t start = out.find_first_not_of('/');
  return start == std::string::npos ? "" : out.substr(start);
}

Result<std::string> ControlSocketOf(const std::string& vol_name) {
  const char* dir = std::getenv("CUBE_TORCH_CONFIG_DIR");
  std::string file = std::string(dir && *dir ? dir : "/tmp") + "/cube_torch.config." + vol_name;
  Result<std::string> text = ReadTrustedControlFile(file);
  if (!text.ok()) {
    if (text.status().IsNotFound())
      return Status::NotFound(file + ": no control file (is the daemon running?)");
    if (text.status().code() == Status::Code::kPermissionDenied)
      return Untrusted(file, text.status().message());
    return text.status();
  }
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("control_socket") ||
      !j["control_socket"].is_string() || j["control_socket"].get<std::string>().empty())
    return Status::Corruption(file + ": no control_socket in the control file");
  std::string sock = j["control_socket"].get<std::string>();
  CTFS_RETURN_IF_ERROR(CheckControlSocket(sock));
  return sock;
}

Result<DaemonFile> OpenViaDaemon(const std::string& socket_path, const std::string& path,
                                 int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  CTFS_ASSIGN_OR_RETURN(UniqueFd sock, ConnectControlSocket(socket_path));
  CTFS_RETURN_IF_ERROR(SendOpenRequest(sock.get(), socket_path, path, deadline));

  // Read the reply; the descriptor arrives with its first bytes.
  Reply reply;
  CTFS_RETURN_IF_ERROR(ReadReply(sock.get(), deadline, &reply));
  return ParseReply(&reply);
}

}  // namespace cubetorchfs::loader
