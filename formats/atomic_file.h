// Atomic file output: write to a temporary file beside the target, then rename it into place, so
// a crash or an error never leaves a half-written file under the target's name. Every kvcc writer
// (stats, artifacts, zoo index) goes through here.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace kvcc {

// Calls write(tmp_path) with a fresh temporary path in the target's directory
// ("<path>.tmp-XXXXXX"), flushes it to disk, then renames it to `path` (replacing any old file).
// If write throws, the temporary file is removed and the exception propagates. Throws Error when
// the target's directory does not exist or is not writable.
void write_file_atomically(const std::string& path, const std::function<void(const std::string& tmp_path)>& write);

// Convenience for byte contents.
void write_bytes_atomically(const std::string& path, const std::string& bytes);

// Throws Error, naming both, when `output` names the same file as one of `inputs` (by
// std::filesystem::equivalent when both exist, else by weakly_canonical path; an empty input is
// skipped): a writer would otherwise replace its own input. Call it before any work.
void require_output_is_not_input(const std::string& output, const std::vector<std::string>& inputs);

// The marker every temporary name carries (tests use it to check nothing is left behind).
inline constexpr const char* kTempMarker = ".tmp-";

}  // namespace kvcc
