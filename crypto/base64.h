// Standard base64 (RFC 4648, with '=' padding) over OpenSSL's EVP_EncodeBlock/DecodeBlock.
// Thread safety: reentrant.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace cubetorchfs::crypto {

std::string Base64Encode(std::string_view bytes);

// Decodes padded base64; surrounding ASCII whitespace is ignored. InvalidArgument (naming
// `what`, never echoing the input, which may be a key) for bad characters or a length that is
// not a multiple of 4.
Result<std::string> Base64Decode(std::string_view text, std::string_view what);

}  // namespace cubetorchfs::crypto
