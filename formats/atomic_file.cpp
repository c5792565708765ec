#include "formats/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "formats/error.h"

namespace kvcc {
namespace {

// Best effort: a failing fsync (e.g. on a filesystem without it) is not worth failing the write.
void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

std::string directory_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(const std::string& tmp_path)>& write) {
  KVCC_REQUIRE(!path.empty(), "empty output path");
  std::vector<char> tmp_name(path.begin(), path.end());
  const std::string suffix = std::string(kTempMarker) + "XXXXXX";
  tmp_name.insert(tmp_name.end(), suffix.begin(), suffix.end());
  tmp_name.push_back('\0');
  int fd = ::mkstemp(tmp_name.data());
  if (fd < 0) {
    const int err = errno;
    throw Error(path + ": cannot create output in " + directory_of(path) + " (" + std::strerror(err) + ")");
  }
  // mkstemp makes the file 0600; give the output the permissions a plain create would.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  (void)::fchmod(fd, 0666 & ~mask);
  ::close(fd);
  const std::string tmp_path(tmp_name.data());
  try {
    write(tmp_path);
    fsync_path(tmp_path);
    if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
      const int err = errno;
      throw Error(path + ": cannot rename temporary output into place (" + std::strerror(err) + ")");
    }
  } catch (...) {
    std::remove(tmp_path.c_str());
    throw;
  }
  fsync_path(directory_of(path));
}

void require_output_is_not_input(const std::string& output, const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  if (output.empty()) return;
  for (const std::string& input : inputs) {
    if (input.empty()) continue;
    std::error_code ec;
    bool same = false;
    if (fs::exists(output, ec) && fs::exists(input, ec)) {
      same = fs::equivalent(output, input, ec) && !ec;
    } else {
      const fs::path a = fs::weakly_canonical(output, ec);
      const bool a_ok = !ec;
      const fs::path b = fs::weakly_canonical(input, ec);
      same = a_ok && !ec ? a == b : fs::path(output).lexically_normal() == fs::path(input).lexically_normal();
    }
    KVCC_REQUIRE(!same, "the output " + output + " is the input " + input +
                            "; writing it would replace the input: choose another output path");
  }
}

void write_bytes_atomically(const std::string& path, const std::string& bytes) {
  write_file_atomically(path, [&](const std::string& tmp) {
    FILE* f = std::fopen(tmp.c_str(), "wb");
    KVCC_REQUIRE(f != nullptr, tmp + ": cannot open for writing (" + std::strerror(errno) + ")");
    const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
    const bool closed = std::fclose(f) == 0;
    KVCC_REQUIRE(written == bytes.size() && closed, path + ": write failed (disk full?)");
  });
}

}  // namespace kvcc
