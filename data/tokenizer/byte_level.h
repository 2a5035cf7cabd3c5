// GPT-2's byte-level alphabet: every byte has a printable code point, so any byte string is
// a string of "characters" a BPE vocabulary can hold. Printable bytes ('!'..'~', 0xA1..0xAC,
// 0xAE..0xFF) keep their value; the other 68 bytes map to 256, 257, ... in byte order.
#pragma once
#include <array>
#include <string>

namespace retain::data::byte_level {

// Code point of each byte.
const std::array<char32_t, 256>& byte_to_code_point();
// UTF-8 text of each byte's code point.
const std::array<std::string, 256>& byte_to_utf8();
// Byte of a code point of the alphabet, or -1 if it is not one.
int code_point_to_byte(char32_t cp);

}  // namespace retain::data::byte_level
