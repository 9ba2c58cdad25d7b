// The loader library below the C ABI: save/load round trips, the parallel read with
// decryption and the integrity check, the device pipeline with a host copier, and finding a
// cubetorchfs mount.
#include "loader/model_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "crypto/aes_ctr.h"
#include "crypto/encrypted_header.h"
#include "crypto/integrity.h"
#include "loader/daemon_fd.h"
#include "loader/device_load.h"
#include "loader/model_writer.h"

namespace cubetorchfs::loader {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

class ModelFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ctfs_model_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    ::unsetenv("VETURBOIO_KEY");
    ::unsetenv("VETURBOIO_IV");
    ::unsetenv("DATAPIPE_SOCKET_PATH");
  }
  void TearDown() override {
    std::filesystem::remove_all(dir_);
    ::unsetenv("VETURBOIO_KEY");
    ::unsetenv("VETURBOIO_IV");
  }

  // Tensors of the given byte sizes (F32 where the size allows, else U8), random contents.
  std::vector<SaveTensor> MakeTensors(const std::vector<uint64_t>& sizes) {
    std::vector<SaveTensor> ts;
    for (size_t i = 0; i < sizes.size(); ++i) {
      data_.push_back(RandomBytes(sizes[i], static_cast<uint32_t>(i + 1)));
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      SaveTensor t;
      t.name = "t";
      t.name += std::to_string(i);
      const bool f32 = sizes[i] % 4 == 0;
      t.dtype = f32 ? Dtype::kF32 : Dtype::kU8;
      t.shape = {f32 ? sizes[i] / 4 : sizes[i]};
      t.data = data_[i].data();
      t.len = sizes[i];
      ts.push_back(t);
    }
    return ts;
  }
  std::vector<uint8_t> Expected() const {
    std::vector<uint8_t> all;
    for (const auto& d : data_) all.insert(all.end(), d.begin(), d.end());
    return all;
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
  std::vector<std::vector<uint8_t>> data_;
};

std::vector<uint8_t> LoadAll(const std::string& path, int threads, const OpenOptions& o = {}) {
  auto f = ModelFile::Open(path, o);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return {};
  std::vector<uint8_t> out((*f)->data_size());
  ReadOptions ro;
  ro.threads = threads;
  ro.chunk_bytes = 1 << 20;
  Status s = (*f)->ReadData(out.data(), out.size(), ro);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

TEST_F(ModelFileTest, PlainRoundTripManyTensorsAnyThreadCount) {
  std::vector<uint64_t> sizes;
  for (int i = 0; i < 500; ++i)
    sizes.push_back(static_cast<uint64_t>((i * 7919) % 20000) + (i % 3));
  sizes[3] = 3 << 20;  // one tensor spanning several read units
  sizes[10] = 0;       // an empty one
  auto ts = MakeTensors(sizes);
  ASSERT_TRUE(SaveSafetensors(Path("m.safetensors"), ts, {{"format", "pt"}}, {}).ok());
  auto f = ModelFile::Open(Path("m.safetensors"), {});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->header().tensors.size(), 500u);
  EXPECT_EQ((*f)->header().metadata.at("format"), "pt");
  EXPECT_FALSE((*f)->encrypted());
  EXPECT_EQ((*f)->header().data_offset % 8, 0u);  // the writer pads the header
  for (int threads : {1, 3, 16}) EXPECT_EQ(LoadAll(Path("m.safetensors"), threads), Expected());
  OpenOptions direct;
  direct.direct_io = true;  // O_DIRECT where possible, buffered where not: same bytes
  EXPECT_EQ(LoadAll(Path("m.safetensors"), 4, direct), Expected());
}

TEST_F(ModelFileTest, SaveRejectsBadInputAndLeavesNoFile) {
  auto ts = MakeTensors({16});
  ts[0].len = 12;  // does not match shape {4} of F32
  Status s = SaveSafetensors(Path("bad.safetensors"), ts, {}, {});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("t0"), std::string::npos) << s.ToString();
  ts = MakeTensors({8});
  ts.push_back(ts[0]);
  EXPECT_NE(SaveSafetensors(Path("dup.safetensors"), ts, {}, {}).message().find("twice"),
            std::string::npos);
  for (const auto& e : std::filesystem::directory_iterator(dir_)) ADD_FAILURE() << e.path();
}

TEST_F(ModelFileTest, EncryptedRoundTripVerifiesAndDetectsTampering) {
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", 1);  // 32 bytes
  // 10 MiB: several 4 MiB integrity chunks, the first holding the safetensors header.
  auto ts = MakeTensors({5 << 20, 101, 5 << 20, 4096});
  SaveOptions so;
  so.encrypt = true;
  const std::string path = Path("enc.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, ts, {}, so).ok());
  {
    auto f = ModelFile::Open(path, {});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE((*f)->encrypted());
    EXPECT_TRUE((*f)->has_integrity_tag());
  }
  for (int threads : {1, 5}) EXPECT_EQ(LoadAll(path, threads), Expected());

  OpenOptions plain;
  plain.cipher = CipherChoice::kOff;
  EXPECT_EQ(ModelFile::Open(path, plain).status().code(), Status::Code::kInvalidArgument);

  const auto size = std::filesystem::file_size(path);
  // Flip one byte in the safetensors header part, in the data, and in the last byte.
  for (uint64_t at : {uint64_t{262144 + 3}, uint64_t{262144 + 200}, uint64_t{6 << 20}, size - 1}) {
    std::string copy = Path("tampered.safetensors");
    std::filesystem::copy_file(path, copy, std::filesystem::copy_options::overwrite_existing);
    int fd = ::open(copy.c_str(), O_RDWR);
    uint8_t b;
    ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(at)), 1);
    b ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(at)), 1);
    ::close(fd);
    auto f = ModelFile::Open(copy, {});
    Status s;
    if (!f.ok()) {
      s = f.status();  // a flipped length or JSON byte fails the header rules
    } else {
      std::vector<uint8_t> out((*f)->data_size());
      s = (*f)->ReadData(out.data(), out.size(), {});
    }
    EXPECT_EQ(s.code(), Status::Code::kCorruption) << "byte " << at << ": " << s.ToString();
  }
  // A wrong key: the header no longer decrypts to a valid safetensors header.
  ::setenv("VETURBOIO_KEY", "ZmVkY2JhOTg3NjU0MzIxMGZlZGNiYTk4NzY1NDMyMTA=", 1);
  auto wrong = ModelFile::Open(path, {});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("wrong key"), std::string::npos)
      << wrong.status().ToString();
}

// A copier whose "device" is host memory: the pipeline's logic without a GPU. Called from
// many read threads at once, as a real copier is.
class HostCopier : public cuda::Copier {
 public:
  Status CopyAsync(void* dst, const void* src, size_t len, int slot) override {
    std::memcpy(dst, src, len);
    copies++;
    int seen = max_slot.load();
    while (slot > seen && !max_slot.compare_exchange_weak(seen, slot)) {
    }
    return Status::OK();
  }
  Status WaitSlot(int) override {
    waits++;
    return Status::OK();
  }
  Status Sync() override { return Status::OK(); }
  Status DecryptOnDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                         void* dst, size_t len) override {
    auto k = crypto::Key::FromBytes(key, key_len);
    if (!k.ok()) return k.status();
    crypto::Iv v;
    std::memcpy(v.data(), iv, v.size());
    decrypted += len;
    return crypto::CtrXorAt(*k, v, offset, static_cast<uint8_t*>(dst), len);
  }
  std::atomic<int> copies{0}, waits{0}, max_slot{0};
  uint64_t decrypted = 0;  // by DecryptOnDevice, after the copies, on one thread
};

TEST_F(ModelFileTest, DevicePipelineThroughStagingSlots) {
  auto ts = MakeTensors({3 << 20, 77, (9 << 20) + 5});
  ASSERT_TRUE(SaveSafetensors(Path("p.safetensors"), ts, {}, {}).ok());
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZg==", 1);
  SaveOptions enc;
  enc.encrypt = true;
  ASSERT_TRUE(SaveSafetensors(Path("e.safetensors"), ts, {}, enc).ok());
  const uint64_t slot_bytes = 4 << 20;
  std::vector<std::vector<uint8_t>> storage(3, std::vector<uint8_t>(slot_bytes));
  std::vector<uint8_t*> slots;
  for (auto& s : storage) slots.push_back(s.data());
  for (const char* name : {"p.safetensors", "e.safetensors"}) {
    for (bool gpu_decrypt : {false, true}) {
      auto f = ModelFile::Open(Path(name), {});
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      std::vector<uint8_t> device((*f)->data_size());
      HostCopier copier;
      DeviceLoadOptions o;
      o.threads = 4;  // more than slots - 1: capped so a copy always overlaps
      o.gpu_decrypt = gpu_decrypt;
      Status s = LoadToDevice(**f, copier, slots, slot_bytes, device.data(), o);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(device, Expected()) << name << " gpu_decrypt=" << gpu_decrypt;
      EXPECT_GE(copier.copies.load(), 4);  // 12 MiB in slots of at most 4 MiB
      EXPECT_LE(copier.max_slot.load(), 2);
      EXPECT_GT(copier.waits.load(), 0);  // slots were reused
      EXPECT_EQ(copier.decrypted, gpu_decrypt && (*f)->encrypted() ? device.size() : 0u);
    }
  }
  // Slots smaller than the file's read unit (4 MiB integrity chunks) are refused clearly.
  auto f = ModelFile::Open(Path("e.safetensors"), {});
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> device((*f)->data_size());
  HostCopier copier;
  EXPECT_EQ(LoadToDevice(**f, copier, slots, 1 << 20, device.data(), {}).code(),
            Status::Code::kInvalidArgument);
}

TEST_F(ModelFileTest, RequireIntegrityAndBoundedChunkSize) {
  auto ts = MakeTensors({(1 << 20) + 3, 64});
  ASSERT_TRUE(SaveSafetensors(Path("plain.safetensors"), ts, {}, {}).ok());
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZg==", 1);
  SaveOptions enc;
  enc.encrypt = true;
  ASSERT_TRUE(SaveSafetensors(Path("enc.safetensors"), ts, {}, enc).ok());
  OpenOptions strict;
  strict.require_integrity = true;
  auto plain = ModelFile::Open(Path("plain.safetensors"), strict);
  EXPECT_EQ(plain.status().code(), Status::Code::kCorruption);
  EXPECT_NE(plain.status().message().find("no integrity tag"), std::string::npos);
  EXPECT_EQ(LoadAll(Path("enc.safetensors"), 2, strict), Expected());

  // The outer header is not authenticated: a rewritten chunk_size must not make the reader
  // do a MAC per byte (or allocate a tag per byte).
  std::fstream io(Path("enc.safetensors"), std::ios::in | std::ios::out | std::ios::binary);
  std::vector<uint8_t> raw(crypto::kEncryptedHeaderSize);
  io.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
  auto header = crypto::ParseEncryptedHeader(raw.data(), raw.size());
  ASSERT_TRUE(header.ok());
  auto field = crypto::GetIntegrityField(*header);
  ASSERT_TRUE(field.ok() && field->has_value());
  for (uint64_t bad : {uint64_t{1}, uint64_t{4096}, uint64_t{(1 << 20) + 1}}) {
    crypto::IntegrityField f = **field;
    f.chunk_size = bad;
    crypto::SetIntegrityField(&*header, f);
    auto bytes = crypto::SerializeEncryptedHeader(*header);
    ASSERT_TRUE(bytes.ok());
    io.seekp(0);
    io.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    io.flush();
    auto opened = ModelFile::Open(Path("enc.safetensors"), {});
    EXPECT_EQ(opened.status().code(), Status::Code::kCorruption) << bad;
    EXPECT_NE(opened.status().message().find("out of range"), std::string::npos) << bad;
  }
}

TEST_F(ModelFileTest, HeaderlessEncryptedNeedsUseCipher) {
  auto ts = MakeTensors({1000, 24});
  ASSERT_TRUE(SaveSafetensors(Path("plain.safetensors"), ts, {}, {}).ok());
  // Encrypt the whole file as the headerless format does (key and IV from the environment).
  std::ifstream in(Path("plain.safetensors"), std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  auto key = crypto::Key::FromBytes("0123456789abcdef");
  crypto::Iv iv;
  for (size_t i = 0; i < iv.size(); ++i) iv[i] = static_cast<uint8_t>(0xf0 + i);  // carries soon
  ASSERT_TRUE(crypto::CtrXorAt(*key, iv, 0, bytes.data(), bytes.size()).ok());
  std::ofstream(Path("enc.bin"), std::ios::binary)
      .write(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZg==", 1);
  ::setenv("VETURBOIO_IV", "8PHy8/T19vf4+fr7/P3+/w==", 1);
  EXPECT_EQ(ModelFile::Open(Path("enc.bin"), {}).status().code(), Status::Code::kCorruption);
  OpenOptions on;
  on.cipher = CipherChoice::kOn;
  EXPECT_EQ(LoadAll(Path("enc.bin"), 2, on), Expected());
}

TEST(DaemonFdTest, FindsTheInnermostCubetorchfsMount) {
  const std::string mountinfo =
      "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
      "40 22 0:40 / /cfs rw,nosuid - fuse.cubetorchfs cubetorchfs:outer rw\n"
      "41 40 0:41 / /cfs/inner\\040dir rw shared:7 - fuse.cubetorchfs cubetorchfs:in\\040ner rw\n"
      "42 22 0:42 / /other rw - fuse.bindfs bindfs rw\n"
      "43 22 0:43 / /fake rw - fuse.cubetorchfs something-else rw\n";
  auto m = FindCubetorchfsMount("/cfs/a/b.safetensors", mountinfo);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->mount_point, "/cfs");
  EXPECT_EQ(m->vol_name, "outer");
  m = FindCubetorchfsMount("/cfs/inner dir/m.safetensors", mountinfo);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->mount_point, "/cfs/inner dir");
  EXPECT_EQ(m->vol_name, "in ner");
  EXPECT_FALSE(FindCubetorchfsMount("/cfsx/m", mountinfo).has_value());
  EXPECT_FALSE(FindCubetorchfsMount("/other/m", mountinfo).has_value());
  EXPECT_FALSE(FindCubetorchfsMount("/fake/m", mountinfo).has_value());
  // Paths go to the daemon relative to the volume's root, also for a bind mount of a
  // subdirectory (mountinfo's root field) at another place.
  EXPECT_EQ(
      FindCubetorchfsMount("/cfs/a/b.safetensors", mountinfo)->StorePath("/cfs/a/b.safetensors"),
      "a/b.safetensors");
  const std::string bind =
      "50 22 0:40 /team-a /models rw - fuse.cubetorchfs cubetorchfs:outer rw\n";
  m = FindCubetorchfsMount("/models/m.safetensors", bind);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->root, "/team-a");
  EXPECT_EQ(m->StorePath("/models/m.safetensors"), "team-a/m.safetensors");
  const MountOf at_root{"/", "v", "/"};
  EXPECT_EQ(at_root.StorePath("/x/y"), "x/y");
}

TEST(DaemonFdTest, NoDaemonIsAClearError) {
  auto r = OpenViaDaemon("/nonexistent/ctfs.sock", "/x", 1000);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/ctfs.sock"), std::string::npos);
  ::setenv("CUBE_TORCH_CONFIG_DIR", "/nonexistent", 1);
  EXPECT_TRUE(ControlSocketOf("vol").status().IsNotFound());
  ::unsetenv("CUBE_TORCH_CONFIG_DIR");
}

}  // namespace
}  // namespace cubetorchfs::loader
