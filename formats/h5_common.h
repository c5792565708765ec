// Pieces the stats and artifact formats share: the root header (format name and version,
// producer, creation time, command) and the model fingerprint group.
#pragma once
#include <string>

#include "formats/h5.h"
#include "formats/model_config.h"

namespace kvcc::h5 {

// "2026-11-29T16:04:05Z"
std::string utc_now_iso8601();
// "kvcc 0.1.0"
std::string default_producer();

// The running process's command line, arguments shell-quoted where needed (from /proc/self/cmdline;
// empty where that is unavailable), for the `command` attribute writers record.
std::string process_command_line();

// The root `format` attribute of an HDF5 file ("kvcc-artifact", "kvcc-stats"); throws Error when the
// file is not HDF5 or has no such attribute.
std::string detect_format(const std::string& path);

// Root attributes format, format_version ("MAJOR.MINOR"), producer, created, command.
void write_root_header(const File& file, const std::string& format, int major, int minor, const std::string& producer,
                       const std::string& created, const std::string& command);
// Checks the root `format` attribute equals `format` (naming what was found instead) and that
// the major version is `major`; returns the version string. A newer minor is accepted: readers
// ignore what they do not know. From minor kSealedFromMinor on, files carry attribute checksums
// (Object::attributes_digest), and every attribute read afterwards checks its object's.
inline constexpr int kSealedFromMinor = 1;
std::string check_root_header(const File& file, const std::string& format, int major);
// The same for a format whose readers take majors [oldest_major, major] (every major above 1 is
// sealed).
std::string check_root_header(const File& file, const std::string& format, int oldest_major, int major);
// Whether files of this version carry attribute checksums: 1.1 and later.
inline bool has_attribute_checksums(int major, int minor) { return major > 1 || minor >= kSealedFromMinor; }

// Group `fingerprint` under `parent`: attributes id, weights_sha256, fields (the names, comma
// separated, canonical order) and one string attribute per field.
void write_fingerprint(const Group& parent, const ModelFingerprint& fp);
// Reads it back and checks the id against the fields and weights hash it was made from.
ModelFingerprint read_fingerprint(const Group& parent);

}  // namespace kvcc::h5
