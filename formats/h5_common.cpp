#include "formats/h5_common.h"

#include <cstdio>
#include <ctime>

#include "formats/error.h"

namespace kvcc::h5 {

std::string utc_now_iso8601() {
  std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

std::string default_producer() { return std::string("kvcc ") + KVCC_VERSION; }

std::string process_command_line() {
  FILE* f = std::fopen("/proc/self/cmdline", "rb");
  if (!f) return "";
  std::string raw;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) raw.append(buf, got);
  std::fclose(f);
  std::string out, arg;
  auto flush = [&] {
    const bool plain =
        !arg.empty() &&
        arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") ==
            std::string::npos;
    if (!out.empty()) out += ' ';
    if (plain) {
      out += arg;
    } else {
      out += '\'';
      for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
    arg.clear();
  };
  for (char c : raw) {
    if (c == '\0') flush();
    else arg += c;
  }
  if (!arg.empty()) flush();
  return out;
}

std::string detect_format(const std::string& path) {
  File file = File::open(path);
  if (!file.has_attr("format"))
    throw Error(path + ": HDF5 file without a root 'format' attribute (not a kvcc artifact or stats file)");
  return file.attr_string("format");
}

void write_root_header(const File& file, const std::string& format, int major, int minor, const std::string& producer,
                       const std::string& created, const std::string& command) {
  file.set_attr("format", format);
  file.set_attr("format_version", std::to_string(major) + "." + std::to_string(minor));
  file.set_attr("producer", producer.empty() ? default_producer() : producer);
  file.set_attr("created", created.empty() ? utc_now_iso8601() : created);
  file.set_attr("command", command);
}

std::string check_root_header(const File& file, const std::string& format, int major) {
  return check_root_header(file, format, major, major);
}

std::string check_root_header(const File& file, const std::string& format, int oldest_major, int major) {
  if (!file.has_attr("format"))
    throw Error(file.file_name() + ": not a " + format + " file (no root attribute 'format')");
  const std::string found = file.attr_string("format");
  if (found != format) throw Error(file.file_name() + ": is a " + found + " file, expected " + format);
  const std::string version = file.attr_string("format_version");
  const auto [file_major, file_minor] = parse_version(version, file.file_name());
  if (file_major < oldest_major || file_major > major) {
    std::string reads;
    for (int m = oldest_major; m <= major; ++m) reads += (reads.empty() ? "" : " and ") + std::to_string(m) + ".x";
    throw Error(file.file_name() + ": " + format + " format_version " + version +
                " is not supported (this kvcc reads " + reads + ")");
  }
  if (has_attribute_checksums(file_major, file_minor)) file.require_sealed_attributes();
  return version;
}

void write_fingerprint(const Group& parent, const ModelFingerprint& fp) {
  Group g = parent.create_group("fingerprint");
  g.set_attr("id", fp.id);
  g.set_attr("weights_sha256", fp.weights_sha256);
  std::string names;
  for (const auto& [name, value] : fp.fields) {
    KVCC_REQUIRE(name.find(',') == std::string::npos && name != "id" && name != "weights_sha256" && name != "fields",
                 "invalid fingerprint field name \"" + name + "\"");
    names += (names.empty() ? "" : ",") + name;
    g.set_attr(name, value);
  }
  g.set_attr("fields", names);
}

ModelFingerprint read_fingerprint(const Group& parent) {
  Group g = parent.group("fingerprint");
  ModelFingerprint fp;
  fp.id = g.attr_string("id");
  fp.weights_sha256 = g.attr_string("weights_sha256");
  const std::string names = g.attr_string("fields");
  size_t start = 0;
  while (start < names.size()) {
    size_t comma = names.find(',', start);
    if (comma == std::string::npos) comma = names.size();
    const std::string name = names.substr(start, comma - start);
    fp.fields.emplace_back(name, g.attr_string(name));
    start = comma + 1;
  }
  if (fingerprint_id(fp.fields, fp.weights_sha256) != fp.id)
    g.fail("fingerprint id does not match its fields (edited or corrupt)");
  return fp;
}

}  // namespace kvcc::h5
