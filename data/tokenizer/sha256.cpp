#include "data/tokenizer/sha256.h"

#include <openssl/evp.h>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::data {

std::string sha256_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr) != 1)
    fail("SHA-256 computation failed (OpenSSL EVP_Digest)");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

std::string sha256_file(const std::filesystem::path& path) { return sha256_hex(read_file(path.string())); }

}  // namespace retain::data
