// The s3 backend: an S3-compatible object store (AWS S3, MinIO, a CubeFS ObjectNode), over
// the HTTP transport of s3_transport.h (the only part that knows libcurl).
//
// Mapping: key `prefix/a/b.jpg` is file `a/b.jpg`; directories are the common prefixes of a
// delimiter "/" listing (a "dir/" marker object makes an empty directory). A name that is both
// an object and a prefix shows as the file, in Stat and List alike.
//
// Requests: HEAD for Stat, ranged GET for Read and StatRead, ListObjectsV2 (1000 keys a page,
// continuation tokens) for List. libcurl signs them (CURLOPT_AWS_SIGV4); the URL is built in
// canonical form (see s3_protocol.h) because curl 7.88 signs path and query as given.
//
// Writes: a file open for writing is a staging file in `staging_dir` (one per open file). It
// holds the object's bytes (downloaded on the first write or read that needs them, or empty
// for a new or truncated file) and is uploaded on Flush/Sync when changed: one PUT, or for a
// file over `multipart_bytes` a multipart upload whose parts go up in parallel. A failed
// upload returns its error and keeps the staging file (and the handle dirty) for the next
// try; a staging file still unuploaded when its handle goes is left in place and logged.
// Rename is PUT with x-amz-copy-source, then DELETE of the source: not atomic (a crash in
// between leaves both; readers may see both names for a moment). Directories are renamed by
// no single request, so renaming one fails with EXDEV (mv then copies). Payloads are sent
// with x-amz-content-sha256: UNSIGNED-PAYLOAD (the signature covers the headers, not the body).
//
// Dialects: the rules above hold on AWS S3, MinIO and moto; a CubeFS ObjectNode differs in
// four ways, each handled so that the other stores see no change. (1) A listing of "dir/"
// leaves out the marker "dir/" itself: a name that is neither an object nor a listed prefix
// is looked for as a marker (one more HEAD, for names that do not exist). (2) Deleting a
// directory's last object removes the directory (on S3, a directory with no marker goes too):
// after a delete, an emptied parent gets its marker back. (3) encoding-type=url listings come
// back encoded byte by byte with no <EncodingType>: a listing that does not say it is encoded
// switches the backend to plain listings. (4) Objects written through its file interface have
// no ETag until a listing computes one: the first object without one switches versions to
// Last-Modified and size alone (an overwrite of the same size within the same second then
// goes unseen). A HEAD of a key under a file answers 500 there: it is not retried when a
// component above is a file (ENOTDIR).
//
// Threads: any number of callers; the transport runs at most max_connections requests at
// once and retries failed attempts (s3_transport.h).

#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_set>
#include <utility>

#include "cfs_client/backend.h"
#include "cfs_client/s3_protocol.h"
#include "cfs_client/s3_transport.h"
#include "cfs_client/s3_writable_file.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/private_dir.h"

namespace cubetorchfs::cfs_client {
namespace {

constexpr int kListPageKeys = 1000;

using s3::Reply;
using s3::Request;

// backend.staging_dir holds the bytes of files being written, which may be files only their
// owner may read.
Status PrivateStagingDir(const std::string& dir, bool create) {
  return EnsurePrivateDir(dir, "backend.staging_dir", "files being written",
                          create ? CreateDir::kDir : CreateDir::kNo);
}

class S3Backend final : public Backend, public S3FileHost {
 public:
  S3Backend(const conf::S3Options& opts, s3::Endpoint endpoint,
            std::unique_ptr<s3::Transport> transport)
      : opts_(opts),
        endpoint_(std::move(endpoint)),
        transport_(std::move(transport)),
        uid_(::getuid()),
        gid_(::getgid()),
        start_ns_(static_cast<int64_t>(std::time(nullptr)) * 1'000'000'000) {}

  Capabilities capabilities() const override { return CapabilitiesOfType(conf::BackendType::kS3); }

  Result<FileAttr> Stat(const std::string& path) override {
    if (path.empty()) {
      CTFS_RETURN_IF_ERROR(FetchListPage(s3::DirKeyPrefix(opts_.prefix, ""), "", 1).status());
      return DirAttr();
    }
    const std::string key = s3::ObjectKey(opts_.prefix, path);
    Request req = NewRequest("HEAD", key);
    req.head = true;
    req.retry_server_errors = false;
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status >= 500) {
      // A CubeFS ObjectNode answers 500 to a HEAD of "file/child": no retry can help that.
      if (std::optional<Status> not_dir = UnderAFile(path)) return *not_dir;
      req.retry_server_errors = true;
      CTFS_ASSIGN_OR_RETURN(reply, transport_->Execute(req));
    }
    if (reply.status == 404) return StatMissingObject(key, reply);
    if (reply.status != 200) return Error(req, reply);
    const std::string* length = reply.Header("content-length");
    if (!length) return Status::IOError("s3 HEAD " + Show(key) + ": no Content-Length");
    return FileAttrOf(reply, std::strtoull(length->c_str(), nullptr, 10));
  }

  // One LIST request a page, resumed by its continuation token. A name that is both an object
  // and a prefix ("x" and "x/...") is listed once, as the file, when the two come in one page
  // (they sort close together: only keys of "x" and a character below '/' fall between).
  class Lister final : public DirLister {
   public:
    Lister(S3Backend* store, std::string path)
        : store_(store),
          path_(std::move(path)),
          dir_(s3::DirKeyPrefix(store->opts_.prefix, path_)),
          exists_(path_.empty()) {}
    Result<DirPage> Next(size_t max) override {
      DirPage page;
      if (done_) return page;
      const int keys = static_cast<int>(std::min<size_t>(std::max<size_t>(max, 1), kListPageKeys));
      CTFS_ASSIGN_OR_RETURN(s3::ListPage got, store_->FetchListPage(dir_, token_, keys));
      std::unordered_set<std::string> files;
      for (s3::ListedObject& o : got.objects) {
        exists_ = true;  // even the directory's own marker object "dir/"
        std::string name = s3::EntryName(dir_, o.key);
        if (name.empty() || name.size() > 255) continue;
        files.insert(name);
        page.entries.push_back(
            {std::move(name), store_->FileAttrOf(o.size, o.last_modified_s, o.etag)});
      }
      for (const std::string& p : got.common_prefixes) {
        exists_ = true;
        std::string name = s3::EntryName(dir_, p);
        if (!name.empty() && name.size() <= 255 && !files.count(name))
          page.entries.push_back({std::move(name), store_->DirAttr()});
      }
      if (got.truncated) {
        if (got.next_token == token_)
          return Status::IOError("s3 LIST " + store_->Show(dir_) +
                                 ": the continuation token repeats");
        token_ = std::move(got.next_token);
        page.last = false;
        return page;
      }
      done_ = true;
      if (!exists_) {
        // An empty directory whose marker the listing left out (see Dialects).
        CTFS_ASSIGN_OR_RETURN(bool marker, store_->MarkerExists(store_->Key(path_)));
        if (!marker)
          return Status::NotFound("s3 LIST " + store_->Show(dir_) + ": no such directory");
      }
      return page;
    }

   private:
    S3Backend* const store_;
    const std::string path_;
    const std::string dir_;
    std::string token_;
    bool exists_;
    bool done_ = false;
  };

  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    return std::unique_ptr<DirLister>(new Lister(this, path));
  }

  Result<std::vector<DirEntry>> List(const std::string& path) override {
    const std::string dir = s3::DirKeyPrefix(opts_.prefix, path);
    std::vector<DirEntry> out;
    std::unordered_set<std::string> files;
    std::vector<std::string> dirs;
    bool exists = path.empty();
    std::string token;
    for (;;) {
      CTFS_ASSIGN_OR_RETURN(s3::ListPage page, FetchListPage(dir, token, kListPageKeys));
      for (s3::ListedObject& o : page.objects) {
        exists = true;  // even the directory's own marker object "dir/"
        std::string name = s3::EntryName(dir, o.key);
        if (name.empty() || name.size() > 255) continue;
        FileAttr a = FileAttrOf(o.size, o.last_modified_s, o.etag);
        files.insert(name);
        out.push_back({std::move(name), a});
      }
      for (const std::string& p : page.common_prefixes) {
        exists = true;
        std::string name = s3::EntryName(dir, p);
        if (!name.empty() && name.size() <= 255) dirs.push_back(std::move(name));
      }
      if (!page.truncated) break;
      if (page.next_token == token)
        return Status::IOError("s3 LIST " + Show(dir) + ": the continuation token repeats");
      token = page.next_token;
    }
    if (!exists) {
      // An empty directory whose marker the listing left out (see Dialects).
      CTFS_ASSIGN_OR_RETURN(bool marker, MarkerExists(Key(path)));
      if (!marker) return Status::NotFound("s3 LIST " + Show(dir) + ": no such directory");
    }
    for (std::string& d : dirs)
      if (!files.count(d)) out.push_back({std::move(d), DirAttr()});
    return out;
  }

  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    if (len == 0) return static_cast<size_t>(0);
    const std::string key = s3::ObjectKey(opts_.prefix, path);
    Request req = NewRequest("GET", key);
    req.range = std::to_string(offset) + "-" + std::to_string(offset + len - 1);
    req.range_first = offset;
    req.buf = buf;
    req.cap = len;
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status == 416 || reply.empty_object) {  // nothing at `offset`: past the end
      CTFS_ASSIGN_OR_RETURN(FileAttr now, Stat(path));
      if (now.Version() != expect) return StaleError(key);
      if (offset < now.size) return Status::IOError("s3 GET " + Show(key) + ": HTTP 416");
      return static_cast<size_t>(0);
    }
    if (reply.status != 200 && reply.status != 206) return Error(req, reply);
    CTFS_ASSIGN_OR_RETURN(uint64_t size, ObjectSize(req, reply));
    if (FileAttrOf(reply, size).Version() != expect) return StaleError(key);
    const size_t want =
        static_cast<size_t>(std::min<uint64_t>(len, size > offset ? size - offset : 0));
    if (reply.bytes != want)
      return Status::IOError("s3 GET " + Show(key) + ": got " + std::to_string(reply.bytes) +
                             " bytes of " + std::to_string(want));
    return want;
  }

  // A GET brings the attributes with the bytes: `check` is asked after, and the bytes dropped.
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    Result<Fetched> r = GetHead(path, len, buf);
    if (r.ok() && check) CTFS_RETURN_IF_ERROR(check(r->attr));
    return r;
  }

  // A GET of the first `len` bytes: a regular file's attributes and bytes in one request; a
  // directory costs what Stat does.
  Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) override {
    if (path.empty() || len == 0) return Backend::LookupRead(path, len, buf);
    Result<Fetched> r = GetHead(path, len, buf);
    if (r.status().code() == Status::Code::kIsDirectory) return Fetched{DirAttr(), 0};
    return r;
  }

  Result<Fetched> GetHead(const std::string& path, size_t len, char* buf) {
    const std::string key = s3::ObjectKey(opts_.prefix, path);
    if (len == 0) {
      CTFS_ASSIGN_OR_RETURN(FileAttr attr, Stat(path));
      if (!attr.IsRegular()) return Status::IsDirectory("read " + Show(key) + ": a directory");
      return Fetched{attr, 0};
    }
    Request req = NewRequest("GET", key);
    req.range = "0-" + std::to_string(len - 1);
    req.buf = buf;
    req.cap = len;
    req.retry_server_errors = false;
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status >= 500) {  // as in Stat
      if (std::optional<Status> not_dir = UnderAFile(path)) return *not_dir;
      req.retry_server_errors = true;
      CTFS_ASSIGN_OR_RETURN(reply, transport_->Execute(req));
    }
    if (reply.status == 404) {
      CTFS_RETURN_IF_ERROR(StatMissingObject(key, reply).status());
      return Status::IsDirectory("read " + Show(key) + ": a directory");
    }
    if (reply.status == 416 || reply.empty_object) {  // S3 says so of an empty object
      CTFS_ASSIGN_OR_RETURN(FileAttr attr, Stat(path));
      if (attr.size != 0) return StaleError(key);
      return Fetched{attr, 0};
    }
    if (reply.status != 200 && reply.status != 206) return Error(req, reply);
    CTFS_ASSIGN_OR_RETURN(uint64_t size, ObjectSize(req, reply));
    Fetched out{FileAttrOf(reply, size), 0};
    const size_t want = static_cast<size_t>(std::min<uint64_t>(len, size));
    if (reply.bytes != want)
      return Status::IOError("s3 GET " + Show(key) + ": got " + std::to_string(reply.bytes) +
                             " bytes of " + std::to_string(want));
    out.bytes = want;
    return out;
  }

  Result<std::string> ReadLink(const std::string& path) override {
    return Status::NotSupported("readlink " + path + ": an object store has no symbolic links");
  }

  Result<FsStats> StatFs() override {
    // An object store has no capacity to report; show a large, fixed one (1 PiB, 2^32 files).
    FsStats s;
    s.block_size = 4096;
    s.blocks = s.blocks_free = s.blocks_avail = (1ull << 50) / 4096;
    s.files = s.files_free = 1ull << 32;
    s.name_max = 255;
    return s;
  }

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& o) override {
    Result<FileAttr> now = Stat(path);
    std::optional<FileAttr> exists;
    if (now.ok()) {
      if (now->IsDir()) return Status::IsDirectory("open " + Show(Key(path)) + ": a directory");
      if (o.create && o.exclusive) return Status::Exists("create " + Show(Key(path)) + ": exists");
      exists = now.value();
    } else if (!now.status().IsNotFound() || !o.create) {
      return now.status();
    }
    CTFS_RETURN_IF_ERROR(PrivateStagingDir(opts_.staging_dir, /*create=*/true));
    // A unique name even among files left by an earlier daemon with the same pid (a
    // restarted container): mkostemp picks it with O_EXCL (a planted symlink is never
    // followed), mode 0600 whatever the umask.
    std::string staging = opts_.staging_dir + "/" + std::to_string(::getpid()) + "-XXXXXX";
    int fd = ::mkostemp(staging.data(), O_CLOEXEC);
    if (fd < 0)
      return Status::IOError("backend.staging_dir: " + staging + ": " + std::strerror(errno));
    return NewS3WritableFile(this, path, exists ? *exists : NewFileAttr(), exists.has_value(),
                             o.truncate, staging, fd);
  }

  Result<FileAttr> Mkdir(const std::string& path, mode_t, int64_t, int64_t) override {
    Result<FileAttr> now = Stat(path);
    if (now.ok()) return Status::Exists("mkdir " + Show(Key(path)) + ": exists");
    if (!now.status().IsNotFound()) return now.status();
    CTFS_RETURN_IF_ERROR(CheckParentDir(path));
    Request req = NewRequest("PUT", Key(path) + "/");
    req.method = "PUT";
    CTFS_RETURN_IF_ERROR(Expect2xx(req).status());
    return DirAttr();
  }

  Status Unlink(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(FileAttr now, Stat(path));
    if (now.IsDir()) return Status::IsDirectory("unlink " + Show(Key(path)) + ": a directory");
    CTFS_RETURN_IF_ERROR(Delete(Key(path)));
    KeepDir(Parent(path));
    return Status::OK();
  }

  Status Rmdir(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(FileAttr now, Stat(path));
    if (!now.IsDir()) return Status::NotDirectory("rmdir " + Show(Key(path)) + ": not a directory");
    const std::string marker = Key(path) + "/";
    CTFS_ASSIGN_OR_RETURN(s3::ListPage page, FetchListPage(marker, "", 2));
    for (const s3::ListedObject& obj : page.objects)
      if (obj.key != marker) return Status::NotEmpty("rmdir " + Show(Key(path)) + ": not empty");
    if (!page.common_prefixes.empty())
      return Status::NotEmpty("rmdir " + Show(Key(path)) + ": not empty");
    CTFS_RETURN_IF_ERROR(Delete(marker));
    KeepDir(Parent(path));
    return Status::OK();
  }

  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    CTFS_ASSIGN_OR_RETURN(FileAttr src, Stat(from));
    if (src.IsDir())
      return Status::Errno(EXDEV, "rename " + Show(Key(from)) +
                                      ": an object store cannot rename a directory in one step");
    Result<FileAttr> dst = Stat(to);
    if (dst.ok()) {
      if (noreplace) return Status::Exists("rename to " + Show(Key(to)) + ": exists");
      if (dst->IsDir()) return Status::IsDirectory("rename to " + Show(Key(to)) + ": a directory");
    } else if (!dst.status().IsNotFound()) {
      return dst.status();
    }
    CTFS_RETURN_IF_ERROR(CheckParentDir(to));
    // Copy, then delete: not atomic (see the top of this file).
    Request req = NewRequest("COPY", Key(to));
    req.method = "PUT";
    req.extra_headers.push_back("x-amz-copy-source: " +
                                s3::UriEncode("/" + opts_.bucket + "/" + Key(from), true));
    CTFS_RETURN_IF_ERROR(Expect2xx(req).status());
    CTFS_RETURN_IF_ERROR(Delete(Key(from)));
    KeepDir(Parent(from));
    return Status::OK();
  }

  Result<FileAttr> Symlink(const std::string&, const std::string& path, int64_t, int64_t) override {
    return Status::Errno(EPERM, "symlink " + Show(Key(path)) + ": an object store has none");
  }
  Result<FileAttr> Link(const std::string& from, const std::string&) override {
    return Status::Errno(EPERM, "link " + Show(Key(from)) + ": an object store has no hard links");
  }

  // Objects have no mode or owner to change: a request to set the ones they show (as cp -p
  // and mv across file systems make) succeeds and changes nothing; any other fails. Times are
  // the store's (Last-Modified), so a request to set them is accepted and has no effect
  // (touch, cp -p keep working).
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& c) override {
    CTFS_ASSIGN_OR_RETURN(FileAttr now, Stat(path));
    const bool same_mode = !c.mode || (*c.mode & 07777) == (now.mode & 07777);
    const bool same_owner = (!c.uid || *c.uid == static_cast<int64_t>(uid_)) &&
                            (!c.gid || *c.gid == static_cast<int64_t>(gid_));
    if (!same_mode || !same_owner)
      return Status::NotSupported("chmod/chown " + Show(Key(path)) +
                                  ": objects have no mode or owner");
    return now;
  }

  // Every upload, copy and delete is durable in the store when it returns.
  Status SyncDir(const std::string&) override { return Status::OK(); }

  // For the startup check: lists one key of the bucket, naming the config key at fault.
  Status Probe() {
    const std::string dir = s3::DirKeyPrefix(opts_.prefix, "");
    Request req = NewRequest("LIST", "");
    req.url = BucketUrl() + "?" + s3::ListQuery(dir, "", 1);
    Result<Reply> reply = transport_->Execute(req);
    if (!reply.ok())
      return Status::IOError("backend.endpoint: " + opts_.endpoint + ": " +
                             reply.status().message());
    if (reply->status == 200) {
      Result<s3::ListPage> page = s3::ParseListObjectsV2(reply->text);
      if (page.ok()) return Status::OK();
      return Status::IOError("backend.endpoint: " + opts_.endpoint +
                             " is not an S3 server: " + page.status().message());
    }
    const Status st = Error(req, reply.value());
    const std::string code = s3::ErrorCode(reply->text);
    std::string key = "backend.endpoint";
    if (reply->status == 404 || code == "NoSuchBucket") {
      key = "backend.bucket";
    } else if (code == "InvalidAccessKeyId") {
      key = "backend.access_key";
    } else if (code == "SignatureDoesNotMatch") {
      key = "backend.secret_key";
    } else if (reply->status == 403) {
      key = transport_->signs() ? "backend.bucket" : "backend.access_key";
    } else if (code == "AuthorizationHeaderMalformed" || code == "PermanentRedirect" ||
               reply->status == 301) {
      key = "backend.region";
    }
    return Status::InvalidArgument(key + ": bucket \"" + opts_.bucket + "\" at " + opts_.endpoint +
                                   ": " + st.message());
  }

 private:
  std::string Show(const std::string& key) const {
    return key.empty() ? opts_.bucket : opts_.bucket + "/" + key;
  }
  std::string BucketUrl() const {
    return s3::ObjectUrl(endpoint_, opts_.bucket, opts_.path_style, "");
  }

  std::string Key(const std::string& path) const { return s3::ObjectKey(opts_.prefix, path); }

  // A file made here has no ETag until its upload: that says nothing of the store's dialect.
  FileAttr NewFileAttr() const {
    return FileAttrOf(0, std::time(nullptr), "", /*from_store=*/false);
  }

  // A file or directory is made under `path`'s parent: that must be a directory.
  Status CheckParentDir(const std::string& path) {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return Status::OK();
    CTFS_ASSIGN_OR_RETURN(FileAttr parent, Stat(path.substr(0, slash)));
    if (!parent.IsDir()) return Status::NotDirectory(Show(Key(path.substr(0, slash))));
    return Status::OK();
  }

  // Runs a request that must answer 2xx.
  Result<Reply> Expect2xx(const Request& req) {
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status < 200 || reply.status >= 300) return Error(req, reply);
    return reply;
  }

  Status Delete(const std::string& key) {
    Request req = NewRequest("DELETE", key);
    req.method = "DELETE";
    return Expect2xx(req).status();
  }

  static std::string XmlField(const std::string& xml, const std::string& tag) {
    const size_t b = xml.find("<" + tag + ">");
    const size_t e = xml.find("</" + tag + ">");
    if (b == std::string::npos || e == std::string::npos || e < b) return "";
    return xml.substr(b + tag.size() + 2, e - b - tag.size() - 2);
  }

  // Uploads the staging file `fd` as the object of `path`: one PUT, or a multipart upload
  // with parts in parallel for a file over multipart_bytes. A 404 here (NoSuchUpload when a
  // retried complete finds the upload already gone, NoSuchBucket) is a failed upload: EIO,
  // not "no such file".
  // S3FileHost: what a staged file asks of its backend.
  Status UploadStaged(const std::string& path, int fd) override { return Upload(path, fd); }
  Result<size_t> ReadObject(const std::string& path, const FileVersion& version, uint64_t offset,
                            size_t len, char* buf) override {
    return Read(path, version, offset, len, buf);
  }
  std::string ShowPath(const std::string& path) const override { return Show(Key(path)); }

  Status Upload(const std::string& path, int fd) {
    Status s = UploadOnce(path, fd);
    if (s.IsNotFound()) return Status::IOError(s.message());
    return s;
  }

  Status UploadOnce(const std::string& path, int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0)
      return Status::IOError("s3 upload " + path + ": fstat of the staging file failed");
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    const std::string key = Key(path);
    if (size <= opts_.multipart_bytes) {
      Request req = NewRequest("PUT", key);
      req.method = "PUT";
      req.upload_fd = fd;
      req.upload_len = size;
      return Expect2xx(req).status();
    }
    Request init = NewRequest("POST", key);
    init.method = "POST";
    init.url += "?uploads=";
    CTFS_ASSIGN_OR_RETURN(Reply started, Expect2xx(init));
    Result<std::string> upload_id = s3::XmlUnescape(XmlField(started.text, "UploadId"));
    if (!upload_id.ok() || upload_id->empty())
      return Status::IOError("s3 POST " + Show(key) + "?uploads: no UploadId in the reply");
    // S3 allows 10,000 parts; grow the part size for files beyond that.
    uint64_t part = opts_.multipart_bytes;
    while ((size + part - 1) / part > 10000) part *= 2;
    const size_t parts = static_cast<size_t>((size + part - 1) / part);
    std::vector<std::string> etags(parts);
    std::vector<Status> errors(parts);
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t i = next++; i < parts; i = next++) {
        Request req = NewRequest("PUT", key);
        req.method = "PUT";
        req.url += "?partNumber=" + std::to_string(i + 1) +
                   "&uploadId=" + s3::UriEncode(*upload_id, false);
        req.upload_fd = fd;
        req.upload_offset = i * part;
        req.upload_len = std::min<uint64_t>(part, size - i * part);
        Result<Reply> r = Expect2xx(req);
        const std::string* etag = r.ok() ? r->Header("etag") : nullptr;
        if (!r.ok()) {
          errors[i] = r.status();
        } else if (etag == nullptr) {
          errors[i] = Status::IOError("s3 PUT " + Show(key) + " part: no ETag in the reply");
        } else {
          etags[i] = *etag;
        }
      }
    };
    RunOnThreads(static_cast<int>(std::min<size_t>({parts, 8, opts_.max_connections})), worker);
    Status failure;
    for (const Status& e : errors)
      if (!e.ok() && failure.ok()) failure = e;
    const std::string query = "?uploadId=" + s3::UriEncode(*upload_id, false);
    if (failure.ok()) {
      Request done = NewRequest("POST", key);
      done.method = "POST";
      done.url += query;
      done.body = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < parts; ++i)
        done.body += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
                     etags[i] + "</ETag></Part>";
      done.body += "</CompleteMultipartUpload>";
      Result<Reply> r = Expect2xx(done);
      // S3 may answer 200 with an <Error> body when completing fails late.
      if (r.ok() && r->text.find("<Error>") != std::string::npos)
        r = Status::IOError("s3 POST " + Show(key) + ": " + s3::ErrorSummary(r->text));
      if (r.ok()) return Status::OK();
      failure = r.status();
    }
    Request abort = NewRequest("DELETE", key);
    abort.method = "DELETE";
    abort.url += query;
    Status ignored = Expect2xx(abort).status();  // best effort: the parts would linger
    (void)ignored;
    return failure;
  }

  Request NewRequest(const char* op, const std::string& key) const {
    Request req;
    req.op = op;
    req.key = key;
    req.url = s3::ObjectUrl(endpoint_, opts_.bucket, opts_.path_style, key);
    return req;
  }

  Status Error(const Request& req, const Reply& reply) const {
    return s3::HttpError(req.op, opts_.bucket, req.key, reply.status, reply.text);
  }
  Status StaleError(const std::string& key) const {
    return Status::Stale("s3 GET " + Show(key) + ": the object changed in the store");
  }

  FileAttr DirAttr() const {
    FileAttr a;
    a.mode = S_IFDIR | 0755;
    a.nlink = 2;
    a.uid = uid_;
    a.gid = gid_;
    a.atime_ns = a.mtime_ns = a.ctime_ns = start_ns_;
    return a;
  }

  FileAttr FileAttrOf(uint64_t size, int64_t last_modified_s, std::string_view etag,
                      bool from_store = true) const {
    FileAttr a;
    a.mode = S_IFREG | 0644;
    a.size = size;
    a.nlink = 1;
    a.uid = uid_;
    a.gid = gid_;
    if (from_store && etag.empty() && !etagless_.exchange(true))
      CTFS_LOG(kInfo) << "s3: " << opts_.endpoint << " gave an object without an ETag (a CubeFS "
                      << "ObjectNode does for files written through its file interface): "
                      << "versions come from Last-Modified and the size alone from now on";
    a.atime_ns = a.mtime_ns = a.ctime_ns =
        s3::ObjectMtimeNs(last_modified_s, etagless_.load() ? std::string_view() : etag);
    a.blocks = (size + 511) / 512;
    return a;
  }

  FileAttr FileAttrOf(const Reply& reply, uint64_t size) const {
    int64_t last_modified = 0;
    if (const std::string* lm = reply.Header("last-modified")) {
      Result<int64_t> t = s3::ParseHttpDate(*lm);
      if (t.ok()) last_modified = t.value();
    }
    const std::string* etag = reply.Header("etag");
    return FileAttrOf(size, last_modified, etag ? std::string_view(*etag) : std::string_view());
  }

  // The object's whole size, from a GET reply: Content-Range's total for 206, else
  // Content-Length.
  Result<uint64_t> ObjectSize(const Request& req, const Reply& reply) const {
    if (reply.status == 206) {
      const std::string* cr = reply.Header("content-range");
      if (!cr) return Status::IOError("s3 GET " + Show(req.key) + ": 206 without Content-Range");
      Result<s3::ContentRange> r = s3::ParseContentRange(*cr);
      if (!r.ok()) return Status::IOError("s3 GET " + Show(req.key) + ": " + r.status().message());
      return r->total;
    }
    const std::string* length = reply.Header("content-length");
    if (!length) return Status::IOError("s3 GET " + Show(req.key) + ": no Content-Length");
    return static_cast<uint64_t>(std::strtoull(length->c_str(), nullptr, 10));
  }

  // No object at `key`: a directory if some key starts with "key/", else NotFound.
  Result<FileAttr> StatMissingObject(const std::string& key, const Reply& reply) {
    CTFS_ASSIGN_OR_RETURN(s3::ListPage page, FetchListPage(key + "/", "", 1));
    if (!page.objects.empty() || !page.common_prefixes.empty()) return DirAttr();
    // A store may leave a directory's own marker out of the listing of its prefix (a CubeFS
    // ObjectNode does): an empty directory is then found by a HEAD of the marker.
    CTFS_ASSIGN_OR_RETURN(bool marker, MarkerExists(key));
    if (marker) return DirAttr();
    return Status::NotFound("s3 HEAD " + Show(key) + ": HTTP " + std::to_string(reply.status) +
                            " (no such object or prefix)");
  }

  static std::string Parent(const std::string& path) {
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string() : path.substr(0, slash);
  }

  // Whether the marker object "key/" of a directory exists.
  Result<bool> MarkerExists(const std::string& key) {
    Request req = NewRequest("HEAD", key + "/");
    req.head = true;
    req.retry_server_errors = false;  // "file/child/": see UnderAFile
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status == 200) return true;
    if (reply.status == 404 || reply.status >= 500) return false;
    return Error(req, reply);
  }

  // NotDirectory if a component above `path` is a file (a HEAD of a key under a file may
  // answer 500), else nothing.
  std::optional<Status> UnderAFile(const std::string& path) {
    for (std::string up = Parent(path); !up.empty(); up = Parent(up)) {
      Request req = NewRequest("HEAD", Key(up));
      req.head = true;
      req.retry_server_errors = false;
      Result<Reply> r = transport_->Execute(req);
      if (r.ok() && r->status == 200)
        return Status::NotDirectory("s3 HEAD " + Show(Key(path)) + ": " + Show(Key(up)) +
                                    " is a file");
    }
    return std::nullopt;
  }

  // Deleting a directory's last object may take the directory with it: on S3 a directory with
  // no marker object is only the prefix of its objects, and a CubeFS ObjectNode removes an
  // emptied directory itself. A file system keeps it, so its marker is put back then. A
  // failure is logged, not returned: the change asked for was made.
  void KeepDir(const std::string& dir) {
    if (dir.empty()) return;
    const std::string marker = Key(dir) + "/";
    Result<s3::ListPage> page = FetchListPage(marker, "", 1);
    if (page.ok() && (!page->objects.empty() || !page->common_prefixes.empty())) return;
    Result<bool> exists = MarkerExists(Key(dir));
    if (exists.ok() && *exists) return;
    Status put = !page.ok() ? page.status() : !exists.ok() ? exists.status() : Status::OK();
    if (put.ok()) {
      Request req = NewRequest("PUT", marker);
      req.method = "PUT";
      put = Expect2xx(req).status();
    }
    if (!put.ok())
      CTFS_LOG(kWarn) << "s3: directory " << Show(marker)
                      << " emptied and may be gone: " << put.ToString();
  }

  Result<s3::ListPage> FetchListPage(const std::string& prefix, const std::string& token,
                                     int max_keys) {
    const bool encode = !plain_listing_.load();
    Request req = NewRequest("LIST", prefix);
    req.url = BucketUrl() + "?" + s3::ListQuery(prefix, token, max_keys, encode);
    CTFS_ASSIGN_OR_RETURN(Reply reply, transport_->Execute(req));
    if (reply.status != 200) return Error(req, reply);
    Result<s3::ListPage> page = s3::ParseListObjectsV2(reply.text);
    if (!page.ok())
      return Status::IOError("s3 LIST " + Show(prefix) + ": " + page.status().message());
    if (encode && !page->url_encoded &&
        (!page->objects.empty() || !page->common_prefixes.empty())) {
      // Asked for url-encoded keys, the store did not say it encoded them: it ignores the
      // request, or (a CubeFS ObjectNode) encodes some names without saying so. Either way
      // only plain listings can be read right: ask for those from now on.
      if (!plain_listing_.exchange(true))
        CTFS_LOG(kInfo) << "s3: " << opts_.endpoint << " does not answer encoding-type=url "
                        << "listings as S3 does; listing keys unencoded from now on";
      return FetchListPage(prefix, token, max_keys);
    }
    return page;
  }

  // Runs `req`, retrying connection errors, timeouts, 5xx and 429 with backoff. Returns the
  // last reply (whatever its HTTP status) or the last transport error.
  const conf::S3Options opts_;
  const s3::Endpoint endpoint_;
  std::unique_ptr<s3::Transport> transport_;
  const uid_t uid_;
  const gid_t gid_;
  const int64_t start_ns_;  // directories show this time: S3 has none for them
  // What the store turned out to be; each is set once and never unset (see the top).
  mutable std::atomic<bool> etagless_{false};  // an object came without an ETag
  std::atomic<bool> plain_listing_{false};     // url-encoded listings are not to be trusted
};

Result<std::unique_ptr<S3Backend>> MakeS3Backend(const conf::S3Options& opts) {
  Result<s3::Endpoint> endpoint = s3::ParseEndpoint(opts.endpoint);
  if (!endpoint.ok())
    return Status::InvalidArgument("backend.endpoint: " + endpoint.status().message());
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  std::string access_key = opts.access_key, secret_key = opts.secret_key, token;
  if (access_key.empty()) {
    access_key = env("AWS_ACCESS_KEY_ID");
    secret_key = env("AWS_SECRET_ACCESS_KEY");
    token = env("AWS_SESSION_TOKEN");
    if (access_key.empty() != secret_key.empty())
      return Status::InvalidArgument(
          "backend.access_key: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together");
  }
  // An existing staging directory is checked (and narrowed to 0700) at start, so a bad one
  // stops the mount with a clear error rather than failing the first write.
  CTFS_RETURN_IF_ERROR(PrivateStagingDir(opts.staging_dir, /*create=*/false));
  CTFS_ASSIGN_OR_RETURN(
      std::unique_ptr<s3::Transport> transport,
      s3::Transport::New(opts, {std::move(access_key), std::move(secret_key), std::move(token)}));
  return std::make_unique<S3Backend>(opts, std::move(endpoint).value(), std::move(transport));
}

}  // namespace

Result<std::unique_ptr<Backend>> NewS3Backend(const conf::S3Options& opts) {
  CTFS_ASSIGN_OR_RETURN(std::unique_ptr<S3Backend> b, MakeS3Backend(opts));
  return std::unique_ptr<Backend>(std::move(b));
}

Status CheckS3Backend(const conf::S3Options& opts) {
  conf::S3Options quick = opts;  // an unreachable endpoint must not hold up the start for long
  quick.retries = std::min<uint32_t>(opts.retries, 1);
  quick.timeout_ms = std::min<uint64_t>(opts.timeout_ms, 10000);
  CTFS_ASSIGN_OR_RETURN(std::unique_ptr<S3Backend> b, MakeS3Backend(quick));
  return b->Probe();
}

}  // namespace cubetorchfs::cfs_client
