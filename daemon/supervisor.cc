#include "daemon/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "common/logging.h"
#include "common/unique_fd.h"

extern char** environ;

namespace cubetorchfs::daemon {

std::optional<double> RestartBudget::OnCrash(double now_s) {
  std::erase_if(restarts_, [now_s](double t) { return now_s - t > kRestartWindowS; });
  if (static_cast<int>(restarts_.size()) >= kMaxRestarts) return std::nullopt;
  const double wait_s =
      restarts_.empty() ? 0
                        : 0.125 * static_cast<double>(1 << std::min<size_t>(restarts_.size(), 4));
  restarts_.push_back(now_s);
  return wait_s;
}

Result<Takeover> ParseTakeover(const std::string& spec) {
  Takeover t;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return Status::InvalidArgument("--takeover: bad item " + item);
    const std::string key = item.substr(0, eq);
    uint64_t v = 0;
    const char* b = item.data() + eq + 1;
    const char* e = item.data() + item.size();
    auto [ptr, ec] = std::from_chars(b, e, v);
    if (ec != std::errc() || ptr != e || b == e || (key != "generation" && v > INT32_MAX))
      return Status::InvalidArgument("--takeover: bad value in " + item);
    if (key == "fuse")
      t.fuse_fd = static_cast<int>(v);
    else if (key == "channel")
      t.channel_fd = static_cast<int>(v);
    else if (key == "generation")
      t.generation = v;
    else if (key == "init")
      t.init_fd = static_cast<int>(v);
    else if (key == "state")
      t.state_fd = static_cast<int>(v);
    else if (key == "unix")
      t.unix_fd = static_cast<int>(v);
    else if (key == "prof")
      t.prof_fd = static_cast<int>(v);
    else if (key == "metrics")
      t.metrics_fd = static_cast<int>(v);
    else if (key == "ring")
      t.ring_fd = static_cast<int>(v);
    else if (key == "table")
      t.table_fd = static_cast<int>(v);
    else if (key == "cache")
      t.cache_fd = static_cast<int>(v);
    else if (key == "passthrough")
      t.passthrough_fd = static_cast<int>(v);
    else
      return Status::InvalidArgument("--takeover: unknown key " + key);
  }
  if (t.fuse_fd < 0 || (t.generation >> 23) != 0)
    return Status::InvalidArgument("--takeover: needs fuse=FD and a generation below 2^23");
  for (int fd : {t.fuse_fd, t.channel_fd, t.init_fd, t.state_fd, t.unix_fd, t.prof_fd, t.metrics_fd,
                 t.ring_fd, t.table_fd, t.cache_fd, t.passthrough_fd})
    if (fd >= 0 && ::fcntl(fd, F_GETFD) < 0)
      return Status::InvalidArgument("--takeover: descriptor " + std::to_string(fd) +
                                     " is not open");
  return t;
}

std::vector<std::string> BaseArgv(const std::vector<std::string>& argv) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--takeover" || argv[i] == "--resume") {
      ++i;
      continue;
    }
    out.push_back(argv[i]);
  }
  return out;
}

Result<std::string> ReadAllFd(int fd) {
  std::string out;
  char buf[1 << 16];
  for (off_t off = 0;;) {
    ssize_t n = ::pread(fd, buf, sizeof buf, off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno(errno, "read handed-over state");
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
    off += n;
  }
}

Result<int> MemfdWith(const std::string& name, const std::string& bytes) {
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "memfd_create");
  for (size_t done = 0; done < bytes.size();) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, "write " + name);
    }
    done += static_cast<size_t>(n);
  }
  return fd;
}

bool SendMessage(int sock, ChannelMessage kind, const std::string& payload, int fd) {
  std::string msg(1, static_cast<char>(kind));
  msg += payload;
  iovec iov{msg.data(), msg.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    mh.msg_control = control;
    mh.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(msg.size());
}

namespace {

constexpr int kExitFailure = 1;
constexpr size_t kMaxMessage = 1 << 20;  // the INIT request is well under a page

// Receives one message; `fd` gets an attached descriptor (else -1). False at EOF or error.
bool ReceiveMessage(int sock, std::string* msg, int* fd) {
  msg->resize(kMaxMessage);
  iovec iov{msg->data(), msg->size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  ssize_t n;
  do n = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  *fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      std::memcpy(fd, CMSG_DATA(c), sizeof(int));
  if (n <= 0) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
    return false;
  }
  msg->resize(static_cast<size_t>(n));
  return true;
}

}  // namespace

void UnmountPath(const std::string& mount_point) {
  if (::geteuid() == 0) {
    if (::umount2(mount_point.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
      CTFS_LOG(kWarn) << "unmount " << mount_point << ": " << std::strerror(errno);
    return;
  }
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execlp("fusermount3", "fusermount3", "-u", "-z", "--", mount_point.c_str(),
             static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  if (pid > 0)
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
}

namespace {

// Tells systemd (Type=notify units: $NOTIFY_SOCKET) how the mount is: READY=1 once served,
// RELOADING=1 during an upgrade, STOPPING=1. Nothing without the variable.
void NotifySystemd(const std::string& state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || (path[0] != '/' && path[0] != '@')) return;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = std::strlen(path);
  if (len >= sizeof addr.sun_path) return;
  std::memcpy(addr.sun_path, path, len);
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';  // the abstract namespace
  UniqueFd sock(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) return;
  ::sendto(sock.get(), state.data(), state.size(), MSG_NOSIGNAL,
           reinterpret_cast<const sockaddr*>(&addr),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len));
}

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// execv's argument vector; points into `args`.
std::vector<char*> CArgs(std::vector<std::string>& args);

class Supervisor {
 public:
  Supervisor(const conf::Config& config, const CommandLine& cl, std::string exe,
             std::vector<std::string> argv, int ready_fd, int fuse_fd, const Takeover& listeners)
      : config_(config),
        cl_(cl),
        exe_(std::move(exe)),
        argv_(BaseArgv(argv)),
        ready_fd_(ready_fd),
        fuse_fd_(fuse_fd),
        listeners_{listeners.unix_fd, listeners.prof_fd, listeners.metrics_fd} {
    // The socket file this supervisor's socket is bound at: removed when the mount ends, if it
    // is still that one.
    struct stat st;
    const std::string path = conf::ControlSocketPath(config_);
    if (listeners_[0] >= 0 && !path.empty() && ::lstat(path.c_str(), &st) == 0 &&
        S_ISSOCK(st.st_mode))
      socket_file_ = {st.st_dev, st.st_ino};
    for (int fd : listeners_)
      if (fd >= 0) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }

  int Run(const Takeover* resume);

 private:
  bool Spawn(int state_fd);
  // This daemon's command line with `flag` (--takeover or --resume) and the descriptors of `t`.
  // `with_listeners`: hand the listeners on (a binary that takes them, --supports).
  std::vector<std::string> TakeoverArgv(const char* flag, const Takeover& t,
                                        bool with_listeners = true) const;
  void OnMessage();
  // The worker ended with `status`; returns the exit status of the supervisor, or -1 to go on.
  int OnWorkerExit(int status);
  // Whether the main thread of `pid` has ended (a zombie) though other threads may live.
  static bool LeaderEnded(pid_t pid);
  static void KeepFd(int* kept, int* fd);
  static constexpr int kStuckCheckMs = 500;
  static constexpr int kStuckChecks = 10;
  int stuck_checks_ = 0;
  void Ready();
  [[noreturn]] void Reexec(int state_fd);
  int Finish(int code);

  const conf::Config& config_;
  const CommandLine& cl_;
  const std::string exe_;
  const std::vector<std::string> argv_;
  int ready_fd_;
  const int fuse_fd_;
  UniqueFd self_image_;     // this process's executable, for the workers it starts
  const int listeners_[3];  // unix, prof, metrics (-1: none), as in Takeover
  std::pair<dev_t, ino_t> socket_file_{0, 0};
  UniqueFd signal_fd_;
  UniqueFd channel_;  // our end for the current worker
  pid_t worker_ = -1;
  uint64_t generation_ = 0;
  std::string init_;       // the raw FUSE_INIT, once the first worker sent it
  bool served_ = false;    // some worker reported ready
  bool stopping_ = false;  // SIGTERM passed on: no restart
  int state_fd_ = -1;      // handed over by the worker, for the next binary
  int ring_fd_ = -1;       // the workers' io_uring entries (kMsgRing), for every next worker
  // The current worker's inode records (kMsgTable), for the next worker of this binary if it
  // dies; not handed to another binary (its records may be of another form).
  int table_fd_ = -1;
  int cache_fd_ = -1;  // the current worker's RAM cache (kMsgCache), handed on as table_fd_
  // The current worker's passthrough table (kMsgPassthrough), for every next worker of this
  // binary after a crash; an upgrade hands the table over in the state instead.
  int passthrough_fd_ = -1;
  RestartBudget restarts_;
  sigset_t old_mask_{};
};

std::vector<std::string> Supervisor::TakeoverArgv(const char* flag, const Takeover& t,
                                                  bool with_listeners) const {
  std::string spec = "fuse=" + std::to_string(t.fuse_fd);
  if (t.channel_fd >= 0) spec += ",channel=" + std::to_string(t.channel_fd);
  spec += ",generation=" + std::to_string(t.generation);
  if (t.init_fd >= 0) spec += ",init=" + std::to_string(t.init_fd);
  if (t.state_fd >= 0) spec += ",state=" + std::to_string(t.state_fd);
  if (ring_fd_ >= 0) spec += ",ring=" + std::to_string(ring_fd_);
  if (t.table_fd >= 0) spec += ",table=" + std::to_string(t.table_fd);
  if (t.cache_fd >= 0) spec += ",cache=" + std::to_string(t.cache_fd);
  if (t.passthrough_fd >= 0) spec += ",passthrough=" + std::to_string(t.passthrough_fd);
  static constexpr const char* kListenerKeys[] = {"unix", "prof", "metrics"};
  for (int i = 0; i < 3 && with_listeners; ++i)
    if (listeners_[i] >= 0)
      spec += std::string(",") + kListenerKeys[i] + "=" + std::to_string(listeners_[i]);
  std::vector<std::string> args = argv_;
  args.push_back(flag);
  args.push_back(spec);
  return args;
}

// Runs `exe arg1 [arg2]` with nothing but its stdout kept, for at most 5 s; returns what it
// printed if it exited 0, else why not.
Result<std::string> RunBinary(const std::string& exe, const char* arg1,
                              const char* arg2 = nullptr) {
  const std::string what = exe + " " + arg1 + (arg2 != nullptr ? std::string(" ") + arg2 : "");
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return Status::FromErrno(errno, "pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, STDIN_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    ::execl(exe.c_str(), exe.c_str(), arg1, arg2, static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  UniqueFd reader(out[0]);
  if (pid < 0) return Status::FromErrno(errno, "fork");
  std::string text;
  const double deadline = NowS() + 5;
  for (char buf[256]; text.size() < 4096;) {
    pollfd p{reader.get(), POLLIN, 0};
    const int left_ms = static_cast<int>((deadline - NowS()) * 1000);
    if (left_ms <= 0 || ::poll(&p, 1, left_ms) <= 0) break;
    const ssize_t n = ::read(reader.get(), buf, sizeof buf);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && NowS() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return Status::IOError(what + " did not answer within 5 s");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Status::IOError(what + " " +
                           (WIFEXITED(status)
                                ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                : std::string("was killed by a signal")));
  return text;
}

// Checks that `exe --version` answers as a cubetorchfs: a binary that cannot start here (a
// missing library: exit 127, a truncated file) is never executed in the supervisor's place.
Status ProbeBinary(const std::string& exe) {
  CTFS_ASSIGN_OR_RETURN(std::string text, RunBinary(exe, "--version"));
  if (text.rfind("cubetorchfs ", 0) != 0)
    return Status::IOError(exe + " --version does not answer as cubetorchfs");
  return Status::OK();
}

std::vector<char*> CArgs(std::vector<std::string>& args) {
  std::vector<char*> out;
  for (std::string& a : args) out.push_back(a.data());
  out.push_back(nullptr);
  return out;
}

void Supervisor::Ready() {
  if (ready_fd_ < 0) return;
  char c = 'R';
  ssize_t ignored = ::write(ready_fd_, &c, 1);
  (void)ignored;
  ::close(ready_fd_);
  ready_fd_ = -1;
  if (!cl_.foreground) {
    int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, STDIN_FILENO);
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
      if (null > STDERR_FILENO) ::close(null);
    }
  }
}

bool Supervisor::Spawn(int state_fd) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    CTFS_LOG(kError) << "socketpair: " << std::strerror(errno);
    return false;
  }
  int init_fd = -1;
  if (!init_.empty()) {
    Result<int> m = MemfdWith("cubetorchfs-init", init_);
    if (!m.ok()) {
      CTFS_LOG(kError) << m.status().ToString();
      ::close(sv[0]);
      ::close(sv[1]);
      return false;
    }
    init_fd = *m;
  }
  Takeover t{fuse_fd_, sv[1], generation_, init_fd, state_fd};
  // After a crash (no state handed over), the records the dead worker left.
  t.table_fd = state_fd < 0 ? table_fd_ : -1;
  // The RAM cache after a crash and after an upgrade alike: its form is checked by the adopter
  // (a build of another layout starts empty).
  t.cache_fd = cache_fd_;
  // The passthrough table after a crash: the kernel's passthrough opens outlived the worker.
  t.passthrough_fd = state_fd < 0 ? passthrough_fd_ : -1;
  std::vector<std::string> args = TakeoverArgv("--takeover", t);
  std::vector<char*> cargs = CArgs(args);

  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int fd : {fuse_fd_, sv[1], init_fd, state_fd, listeners_[0], listeners_[1], listeners_[2],
                   ring_fd_, t.table_fd, t.cache_fd, t.passthrough_fd})
      if (fd >= 0) ::fcntl(fd, F_SETFD, 0);
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    // The worker runs this supervisor's own image, whatever is installed at exe_ now (removed,
    // or replaced by a package not yet upgraded to): an upgrade goes through Reexec.
    if (self_image_.get() >= 0) ::fexecve(self_image_.get(), cargs.data(), environ);
    ::execv(exe_.c_str(), cargs.data());
    ::_exit(127);
  }
  const int err = errno;
  ::close(sv[1]);
  if (init_fd >= 0) ::close(init_fd);
  if (pid < 0) {
    ::close(sv[0]);
    CTFS_LOG(kError) << "fork: " << std::strerror(err);
    return false;
  }
  channel_.reset(sv[0]);
  worker_ = pid;
  // The records and the cache go to that worker alone; it sends them back once it has
  // adopted them (kMsgTable, kMsgCache). Should reading them be what kills it, the worker
  // after it starts empty instead of dying the same way until the restarts run out.
  for (int* kept : {&table_fd_, &cache_fd_})
    if (*kept >= 0 && (*kept == t.table_fd || *kept == t.cache_fd)) {
      ::close(*kept);
      *kept = -1;
    }
  CTFS_LOG(kInfo) << "supervisor: worker " << pid << " started (generation " << generation_
                  << (state_fd >= 0 ? ", with the state handed over" : "") << ")";
  return true;
}

// A memfd the worker sent, kept for the workers after it in place of the one before.
void Supervisor::KeepFd(int* kept, int* fd) {
  if (*fd < 0) return;
  if (*kept >= 0) ::close(*kept);
  *kept = *fd;
  ::fcntl(*kept, F_SETFD, FD_CLOEXEC);
  *fd = -1;
}

void Supervisor::OnMessage() {
  std::string msg;
  int fd = -1;
  if (!ReceiveMessage(channel_.get(), &msg, &fd)) {
    channel_.reset();  // the worker is gone or going; its exit comes as SIGCHLD
    return;
  }
  switch (msg[0]) {
    case kMsgInit:
      if (init_.empty()) init_ = msg.substr(1);
      break;
    case kMsgReady:
      served_ = true;
      Ready();
      NotifySystemd("READY=1\nSTATUS=serving " + config_.mount_point + " (generation " +
                    std::to_string(generation_) + ")\nMAINPID=" + std::to_string(::getpid()));
      break;
    case kMsgRing:
      KeepFd(&ring_fd_, &fd);
      break;
    case kMsgTable:
      KeepFd(&table_fd_, &fd);
      break;
    case kMsgCache:
      KeepFd(&cache_fd_, &fd);
      break;
    case kMsgPassthrough:
      KeepFd(&passthrough_fd_, &fd);
      break;
    case kMsgState:
      if (fd >= 0) {
        if (state_fd_ >= 0) ::close(state_fd_);
        state_fd_ = fd;
        fd = -1;
      }
      break;
    default:
      CTFS_LOG(kWarn) << "supervisor: unknown message from the worker";
  }
  if (fd >= 0) ::close(fd);
}

void Supervisor::Reexec(int state_fd) {
  Result<int> init = MemfdWith("cubetorchfs-init", init_);
  // A version before the listener handover would not know what to do with them (and a port
  // it inherited would stay taken from its own daemon): it gets none and binds its own.
  const bool hand_listeners = RunBinary(exe_, "--supports", "listener-handover").ok();
  if (!hand_listeners && (listeners_[0] >= 0 || listeners_[1] >= 0 || listeners_[2] >= 0))
    CTFS_LOG(kWarn) << "supervisor: " << exe_ << " does not take listeners over; its daemon "
                    << "binds its own";
  Takeover t{fuse_fd_, -1, generation_ + 1, init.ok() ? *init : -1, state_fd};
  // The RAM cache, to a version that takes it (one before would refuse the argument).
  if (cache_fd_ >= 0 && RunBinary(exe_, "--supports", "cache-handover").ok())
    t.cache_fd = cache_fd_;
  std::vector<std::string> args = TakeoverArgv("--resume", t, hand_listeners);
  std::vector<char*> cargs = CArgs(args);
  for (int fd : {fuse_fd_, state_fd, init.ok() ? *init : -1, ring_fd_, t.cache_fd})
    if (fd >= 0) ::fcntl(fd, F_SETFD, 0);
  for (int fd : listeners_)
    if (fd >= 0 && hand_listeners) ::fcntl(fd, F_SETFD, 0);
  ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
  CTFS_LOG(kInfo) << "supervisor: upgrading: executing " << exe_;
  ::execv(exe_.c_str(), cargs.data());
  // The installed binary cannot run: go on with this one, from its own image.
  CTFS_LOG(kError) << "supervisor: cannot execute " << exe_ << ": " << std::strerror(errno)
                   << "; the running version goes on";
  ::execv("/proc/self/exe", cargs.data());
  CTFS_LOG(kError) << "supervisor: cannot execute /proc/self/exe: " << std::strerror(errno);
  UnmountPath(config_.mount_point);
  ::_exit(kExitFailure);
}

int Supervisor::Finish(int code) {
  UnmountPath(config_.mount_point);
  struct stat st;
  const std::string path = conf::ControlSocketPath(config_);
  if (socket_file_.second != 0 && ::lstat(path.c_str(), &st) == 0 &&
      std::pair<dev_t, ino_t>{st.st_dev, st.st_ino} == socket_file_)
    ::unlink(path.c_str());
  if (ready_fd_ >= 0) {  // never ready: the waiting parent reads the exit status instead
    ::close(ready_fd_);
    ready_fd_ = -1;
  }
  CTFS_LOG(kInfo) << "supervisor: exiting with status " << code;
  return code;
}

bool Supervisor::LeaderEnded(pid_t pid) {
  // /proc/PID/stat: "PID (comm) STATE ...": the comm may hold spaces and parentheses.
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() &&
         (stat[close + 2] == 'Z' || stat[close + 2] == 'X');
}

int Supervisor::OnWorkerExit(int status) {
  worker_ = -1;
  channel_.reset();
  const bool exited = WIFEXITED(status);
  const int code = exited ? WEXITSTATUS(status) : 0;
  if (state_fd_ >= 0 && exited && code == 0) {
    const int fd = state_fd_;
    state_fd_ = -1;
    Status probe = ProbeBinary(exe_);
    // A mount on FUSE over io_uring needs a binary that serves it that way (one before would
    // read /dev/fuse while every request waits in the io_uring queues).
    if (probe.ok() && ring_fd_ >= 0 && !RunBinary(exe_, "--supports", "io_uring-adoption").ok())
      probe = Status::IOError(exe_ + " cannot serve a mount on FUSE over io_uring");
    if (probe.ok()) Reexec(fd);  // does not return
    // The installed binary cannot run here: the running version goes on, with the state.
    CTFS_LOG(kError) << "supervisor: upgrade abandoned: " << probe.message()
                     << "; the running version goes on";
    ++generation_;
    const bool spawned = Spawn(fd);
    ::close(fd);
    if (!spawned) return Finish(kExitFailure);
    return -1;
  }
  if (stopping_) return Finish(exited ? code : kExitFailure);
  if (exited && code == 0) return Finish(0);  // unmounted, or stopped by a signal of its own
  if (!served_) return Finish(exited ? code : kExitFailure);  // never came up: a start error
  const std::string how =
      exited ? "exited with status " + std::to_string(code)
             : std::string("was killed by signal ") + ::strsignal(WTERMSIG(status));
  const std::optional<double> wait = restarts_.OnCrash(NowS());
  if (!wait) {
    CTFS_LOG(kError) << "supervisor: worker " << how << "; " << kMaxRestarts
                     << " restarts in the last " << kRestartWindowS << " s: giving up";
    return Finish(kExitFailure);
  }
  const double wait_s = *wait;
  ++generation_;
  CTFS_LOG(kError) << "supervisor: worker " << how << "; starting a new one on the same "
                   << "connection in " << wait_s << " s (generation " << generation_ << ")";
  if (wait_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
  if (!Spawn(-1)) return Finish(kExitFailure);
  return -1;
}

int Supervisor::Run(const Takeover* resume) {
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGUSR2}) sigaddset(&mask, s);
  ::sigprocmask(SIG_BLOCK, &mask, &old_mask_);
  sigdelset(&old_mask_, SIGCHLD);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR2}) sigdelset(&old_mask_, s);
  signal_fd_.reset(::signalfd(-1, &mask, SFD_CLOEXEC));
  if (!(signal_fd_.get() >= 0)) {
    CTFS_LOG(kError) << "signalfd: " << std::strerror(errno);
    return Finish(kExitFailure);
  }
  int state_fd = -1;
  if (resume != nullptr) {
    generation_ = resume->generation;
    served_ = true;
    if (resume->init_fd >= 0) {
      Result<std::string> init = ReadAllFd(resume->init_fd);
      ::close(resume->init_fd);
      if (init.ok()) init_ = std::move(init).value();
    }
    state_fd = resume->state_fd;
    if (state_fd >= 0) ::fcntl(state_fd, F_SETFD, FD_CLOEXEC);
    ring_fd_ = resume->ring_fd;
    if (ring_fd_ >= 0) ::fcntl(ring_fd_, F_SETFD, FD_CLOEXEC);
    cache_fd_ = resume->cache_fd;
    if (cache_fd_ >= 0) ::fcntl(cache_fd_, F_SETFD, FD_CLOEXEC);
    ::fcntl(fuse_fd_, F_SETFD, FD_CLOEXEC);
  }
  self_image_.reset(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  if (self_image_.get() < 0)
    CTFS_LOG(kWarn) << "supervisor: /proc/self/exe: " << std::strerror(errno)
                    << "; workers start from " << exe_;
  if (!Spawn(state_fd)) return Finish(kExitFailure);
  if (state_fd >= 0) ::close(state_fd);

  for (;;) {
    pollfd pfds[2] = {{signal_fd_.get(), POLLIN, 0}, {channel_.get(), POLLIN, 0}};
    // While a worker runs, look at it every kStuckCheckMs: one whose threads all ended but
    // one held in the kernel is dead, though no SIGCHLD comes and its channel stays open (the
    // thread left keeps the process's descriptors).
    const bool watching = worker_ > 0;
    const int n = ::poll(pfds, channel_.get() >= 0 ? 2 : 1, watching ? kStuckCheckMs : -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      CTFS_LOG(kError) << "supervisor: poll: " << std::strerror(errno);
      return Finish(kExitFailure);
    }
    if (n == 0 && watching) {
      // A worker that handed its state over, or is being stopped, is left to end however
      // long it takes; another must have been a zombie for kStuckChecks looks, 5 s (an exit
      // tearing down a large memory takes a moment too).
      // (Only while the connection lives: after an unmount the worker ends as it will.)
      pollfd conn{fuse_fd_, POLLIN, 0};
      const bool connected = ::poll(&conn, 1, 0) >= 0 && !(conn.revents & (POLLERR | POLLNVAL));
      stuck_checks_ = connected && LeaderEnded(worker_) ? stuck_checks_ + 1 : 0;
      if (state_fd_ >= 0 || stopping_ || stuck_checks_ < kStuckChecks) continue;
      stuck_checks_ = 0;
      // Its store of pages into the kernel's cache may wait for a read only the next worker
      // can answer (fuse/page_probe.h): the next one starts now, the dead one is reaped when
      // it ends.
      CTFS_LOG(kError) << "supervisor: worker " << worker_ << " has died with a thread still "
                       << "in the kernel";
      // That thread may be copying a cached buffer into the kernel: the next worker must not
      // adopt the RAM cache, whose pages it would give back or hand out again under the copy.
      if (cache_fd_ >= 0) {
        ::close(cache_fd_);
        cache_fd_ = -1;
      }
      if (int code = OnWorkerExit(W_EXITCODE(0, SIGKILL)); code >= 0) return code;
      continue;
    }
    if ((channel_.get() >= 0) && (pfds[1].revents & (POLLIN | POLLHUP | POLLERR))) OnMessage();
    if (!(pfds[0].revents & POLLIN)) continue;
    signalfd_siginfo si;
    if (::read(signal_fd_.get(), &si, sizeof si) != sizeof si) continue;
    if (si.ssi_signo == SIGCHLD) {
      for (;;) {
        int status = 0;
        const pid_t pid = ::waitpid(-1, &status, WNOHANG);
        if (pid <= 0) break;
        if (pid != worker_) continue;
        // Messages the worker sent just before it ended (its state) are read first.
        while ((channel_.get() >= 0)) {
          pollfd p{channel_.get(), POLLIN, 0};
          if (::poll(&p, 1, 0) <= 0 || !(p.revents & (POLLIN | POLLHUP))) break;
          OnMessage();
        }
        if (int code = OnWorkerExit(status); code >= 0) return code;
      }
    } else if (si.ssi_signo == SIGUSR2) {
      if ((channel_.get() >= 0) && served_) {
        NotifySystemd("RELOADING=1\nSTATUS=upgrading");
        CTFS_LOG(kInfo) << "supervisor: SIGUSR2: asking worker " << worker_ << " to hand over";
        SendMessage(channel_.get(), kMsgUpgrade, "");
      }
    } else {
      if (!stopping_) NotifySystemd("STOPPING=1");
      stopping_ = true;
      if (worker_ > 0) ::kill(worker_, SIGTERM);
    }
  }
}

}  // namespace

int Supervise(const conf::Config& config, const CommandLine& cl, const std::string& exe,
              const std::vector<std::string>& argv, int ready_fd, int fuse_fd,
              const Takeover& listeners, const Takeover* resume) {
  Supervisor supervisor(config, cl, exe, argv, ready_fd, fuse_fd, listeners);
  return supervisor.Run(resume);
}

}  // namespace cubetorchfs::daemon
