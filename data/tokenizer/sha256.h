// SHA-256 (OpenSSL's libcrypto) as lowercase hex: the identity of a tokenizer.json that a
// packed dataset records and the trainer checks against the model's.
#pragma once
#include <filesystem>
#include <string>
#include <string_view>

namespace retain::data {

std::string sha256_hex(std::string_view bytes);
// The digest of a file's bytes; a file that cannot be read is an error naming it.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace retain::data
