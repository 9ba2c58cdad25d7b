#include "fuse/control_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cubetorchfs::fuse {
namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace

std::string ControlFilePath(const std::string& vol_name) {
  const char* dir = std::getenv("CUBE_TORCH_CONFIG_DIR");
  std::string d = dir && *dir ? dir : "/tmp";
  return d + "/cube_torch.config." + vol_name;
}

std::string ControlFileJson(const ControlInfo& info) {
  std::ostringstream os;
  os << "{\"vol_name\": " << JsonString(info.vol_name)
     << ", \"mount_point\": " << JsonString(info.mount_point) << ", \"prof\": " << info.prof_port
     << ", \"local_ip\": \"127.0.0.1\", \"control_socket\": " << JsonString(info.control_socket)
     << ", \"metrics_port\": " << info.metrics_port << ", \"pid\": " << info.pid
     << ", \"version\": " << JsonString(info.version) << "}\n";
  return os.str();
}

Status WriteControlFile(const std::string& path, const ControlInfo& info) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const std::string body = ControlFileJson(info);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(tmp + ": " + std::strerror(errno));
  bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size()) &&
            ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) err = errno;
    ::unlink(tmp.c_str());
    return Status::IOError(path + ": " + std::strerror(err));
  }
  return Status::OK();
}

void RemoveControlFile(const std::string& path, int pid) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().find("\"pid\": " + std::to_string(pid) + ",") != std::string::npos)
    ::unlink(path.c_str());
}

}  // namespace cubetorchfs::fuse
