// The packer behind retain-pack: reads the inputs, tokenizes them on many threads (the result
// does not depend on the thread count), spills the documents to a temporary file next to the
// output, then packs them into sequences of seq_len tokens (concat or best-fit-decreasing) and
// writes the HDF5 dataset atomically. Memory stays bounded by the batch sizes plus 24 bytes per
// document (the spill index and the order; about 50 bytes per piece while bfd plans); the tokens live in the
// memory-mapped spill file, so corpora larger than RAM stream through. docs/data-format.md
// pins the packing rules.
#pragma once
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/document.h"
#include "data/input_file.h"
#include "data/tokenizer/tokenizer.h"

namespace retain::data {

enum class Packing { concat, bfd };
enum class DocOrder { shuffle, input };

struct PackProgress {
  const char* phase = "tokenize";  // "tokenize", then "pack"
  uint64_t done = 0, total = 0;    // tokenize: input bytes; pack: sequences
  int64_t documents = 0, tokens = 0;
  double seconds = 0;              // since the start
};

struct PackOptions {
  std::vector<std::filesystem::path> inputs;
  std::filesystem::path out;
  int64_t seq_len = 0;
  Packing packing = Packing::concat;
  DocOrder order = DocOrder::shuffle;
  uint64_t seed = 0;
  Targets targets = Targets::all;
  InputFormat format = InputFormat::automatic;
  TxtMode txt_mode = TxtMode::file;
  int threads = 1;
  int compression_level = 4;  // deflate 1..9, 0 = no filters
  bool skip_bad = false;       // count and skip bad records instead of failing
  int32_t eos_id = 0;          // the separator (resolve_separator)
  std::string created_by = "retain-pack";
  std::function<void(const PackProgress&)> progress;  // called at most every 0.1 s, and at the end
  std::function<void(const std::string&)> warn;        // skipped bad records (at most 20)
  const std::atomic<bool>* interrupted = nullptr;      // set by a signal handler: stop, clean up
};

struct PackSummary {
  int64_t documents = 0, tokens = 0, sequences = 0, padding_tokens = 0, split_documents = 0;
  int64_t blank_lines = 0, empty_documents = 0, bad_records = 0, invalid_utf8 = 0;
  double tokenize_seconds = 0, total_seconds = 0;
};

// A model's eos_token_id as its caller read it (data/ stands below the model: retain-pack reads
// DIR/config.json with formats::read_config_token_id), and where it came from, for errors.
struct ModelEos {
  std::optional<int64_t> id;  // nullopt: the config names none
  std::string source;         // e.g. "DIR/config.json"
};

// The separator id (DESIGN §7): `eos_token` if given (it must be a token of the tokenizer),
// else <|endoftext|> when the tokenizer has it, else the model's eos_token_id when one was
// given (it must be inside the tokenizer's vocabulary); otherwise an error.
int32_t resolve_separator(const Tokenizer& tok, const std::string& eos_token, const std::optional<ModelEos>& model_eos);

PackSummary pack(const Tokenizer& tok, const PackOptions& opt);

}  // namespace retain::data
