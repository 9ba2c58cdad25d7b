// Where the data key (and, for headerless files, the IV) of an encrypted model file comes from
// (docs/formats.md, "Encrypted model files"). Sources, in the documented order:
//   1. the header's `meta_data_key` through a KMS — no KMS is available here, so a header that
//      carries one gets a clear NotSupported error naming it;
//   2. the unix socket named by DATAPIPE_SOCKET_PATH (when the variable is set and the socket
//      exists): HTTP GET with `X-Datapipe-Task-Type: encrypt-key`, reply {"Key": b64, "IV": b64};
//   3. the environment: VETURBOIO_KEY (base64 of 16 or 32 bytes) and VETURBOIO_IV (base64 of
//      16 bytes; optional when the file has a header).
// Keys are never logged or put in error messages; temporary copies are wiped.
//
// Thread safety: reentrant; each call makes its own curl handle. The default environment
// lookup reads the process environment (do not setenv concurrently).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "common/status.h"
#include "crypto/aes_ctr.h"
#include "crypto/encrypted_header.h"

namespace cubetorchfs::crypto {

struct KeySourceOptions {
  // Reads an environment variable; nullopt when unset. Default: ::getenv.
  std::function<std::optional<std::string>(const std::string& name)> getenv;
  // URL requested over the datapipe socket (the host part is ignored by the server).
  // Default: "http://localhost/".
  std::string socket_url = "http://localhost/";
  // Whole-request timeout for the socket source. Default: 5000 ms.
  long socket_timeout_ms = 5000;
};

struct KeyMaterial {
  Key key;
  std::optional<Iv> iv;  // absent when the source gave none
  std::string source;    // "DATAPIPE_SOCKET_PATH" or "VETURBOIO_KEY" (for messages, not secret)
};

// What a reader needs to decrypt a payload.
struct CipherParams {
  Key key;
  Iv iv{};
};

// Asks the datapipe unix socket at `socket_path` for a key. IOError if the request fails,
// Corruption if the reply is not the documented JSON.
Result<KeyMaterial> KeyFromDatapipeSocket(const std::string& socket_path,
                                          const KeySourceOptions& options = {});

// Reads VETURBOIO_KEY / VETURBOIO_IV. NotFound if VETURBOIO_KEY is unset.
Result<KeyMaterial> KeyFromEnv(const KeySourceOptions& options = {});

// Walks the sources in order. `header` is null for a headerless file.
Result<KeyMaterial> ResolveKey(const EncryptedHeader* header, const KeySourceOptions& options = {});

// ResolveKey plus the checks a reader needs: the IV is the header's when there is a header,
// else the source's (InvalidArgument if it gave none); with a header, the key size must match
// its mode (InvalidArgument naming both).
Result<CipherParams> ResolveCipherParams(const EncryptedHeader* header,
                                         const KeySourceOptions& options = {});

}  // namespace cubetorchfs::crypto
