#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer/regex.h"

#include <pcre2.h>

#include "kernels/base/error.h"

namespace retain::data {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: match data (one ovector pair suffices) and a JIT stack large
// enough for long whitespace runs; one per thread, shared by every pattern.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  ThreadMatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(const std::string& pattern, const std::string& where) : code_(std::make_unique<Code>()), where_(where) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  const std::string translated = onig_to_pcre2(pattern);
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
  if (!code_->code) fail("{}: pattern '{}' at offset {}: {}", where, printable(pattern), offset, pcre2_message(err));
  code_->jit = pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& out) const {
  ThreadMatchState& st = thread_state();
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t from = 0;
  size_t last_match_end = SIZE_MAX;
  while (from <= subject.size()) {
    const int rc = code_->jit ? pcre2_jit_match(code_->code, s, subject.size(), from, 0, st.data, st.context)
                              : pcre2_match(code_->code, s, subject.size(), from, PCRE2_NO_UTF_CHECK, st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) fail("{}: regex match failed: {}", where_, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    if (ov[0] == ov[1] && ov[1] == last_match_end) {
      // As the Rust `onig` crate's find_iter: an empty match right where the last match
      // ended is skipped, and the search resumes one character further.
      ++from;
      while (from < subject.size() && (static_cast<unsigned char>(subject[from]) & 0xC0) == 0x80) ++from;
      continue;
    }
    out.emplace_back(ov[0], ov[1]);
    from = last_match_end = ov[1];
  }
}

bool Regex::search(std::string_view subject) const {
  ThreadMatchState& st = thread_state();
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0,
                             PCRE2_NO_UTF_CHECK, st.data, st.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) fail("{}: regex match failed: {}", where_, pcre2_message(rc));
  return true;
}

// Unicode's White_Space property, which is Oniguruma's \s. PCRE2's \s differs (it lacks
// U+0085 and, in some versions, has U+180E), so it is spelled out.
constexpr const char* kWhiteSpace = R"(\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string Regex::onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  int class_depth = 0;  // inside [...]
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      ++i;
      if (e == 's') {
        out += class_depth ? std::string(kWhiteSpace) : fmt::format("[{}]", kWhiteSpace);
      } else if (e == 'h' || (e == 'H' && !class_depth)) {  // Oniguruma: hex digit
        out += e == 'H' ? "[^0-9a-fA-F]" : class_depth ? "0-9a-fA-F" : "[0-9a-fA-F]";
      } else if (e == 'S' && !class_depth) {
        out += fmt::format("[^{}]", kWhiteSpace);
      } else {
        out += '\\';
        out += e;
      }
      continue;
    }
    if (c == '[') {
      ++class_depth;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is literal
      continue;
    }
    if (c == ']' && class_depth) --class_depth;
    out += c;
  }
  return out;
}

std::string Regex::escape(std::string_view literal) {
  std::string out;
  for (const char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}/-#").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace retain::data
