// Command-line options of the benchmarks, declared once with their help: `--help` prints the
// usage (exit 0); an unknown option, a missing value, a malformed number or one below its
// minimum is an error (exit 2), so that a mistyped flag cannot run a default measurement that
// looks like the one asked for.
#pragma once
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

namespace kvcc::bench {

class Args {
 public:
  // name: the program; summary: what it measures (printed first by --help).
  Args(std::string name, std::string summary) : name_(std::move(name)), summary_(std::move(summary)) {}

  Args& option(const std::string& flag, std::string* v, const std::string& help) {
    return add(flag, "TEXT", help, *v, [v](const std::string& s) {
      *v = s;
      return std::string();
    });
  }
  // An integer of at least `min`.
  Args& option(const std::string& flag, int* v, const std::string& help, int min) {
    return add(flag, "N", help + " (>= " + std::to_string(min) + ")", std::to_string(*v),
               [v, min](const std::string& s) {
                 long x = 0;
                 if (!parse_long(s, x)) return "an integer, not '" + s + "'";
                 if (x < min) return "at least " + std::to_string(min) + ", not " + s;
                 if (x > 2147483647L) return "at most 2147483647, not " + s;
                 *v = int(x);
                 return std::string();
               });
  }
  // A number in [min, max].
  Args& option(const std::string& flag, double* v, const std::string& help, double min, double max) {
    return add(flag, "X", help + " (" + fmt(min) + " to " + fmt(max) + ")", fmt(*v),
               [v, min, max](const std::string& s) {
                 char* end = nullptr;
                 errno = 0;
                 const double x = std::strtod(s.c_str(), &end);
                 if (s.empty() || *end != '\0' || errno == ERANGE || !(x == x)) return "a number, not '" + s + "'";
                 if (x < min || x > max) return "between " + fmt(min) + " and " + fmt(max) + ", not " + s;
                 *v = x;
                 return std::string();
               });
  }
  // 0 or 1.
  Args& option(const std::string& flag, bool* v, const std::string& help) {
    return add(flag, "0|1", help, *v ? "1" : "0", [v](const std::string& s) {
      if (s != "0" && s != "1") return "0 or 1, not '" + s + "'";
      *v = s == "1";
      return std::string();
    });
  }
  // Arguments without a flag, collected in order; `what` names them in the usage line.
  Args& positional(std::vector<std::string>* v, const std::string& what, const std::string& help) {
    positional_ = v;
    positional_what_ = what;
    positional_help_ = help;
    return *this;
  }
  Args& example(const std::string& line) {
    examples_.push_back(line);
    return *this;
  }

  // The error of argv, or "" when it parsed (--help: "help"). Values are set as they parse.
  std::string parse_or_error(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") return "help";
      if (a.rfind("--", 0) != 0) {
        if (!positional_) return "unexpected argument '" + a + "'";
        positional_->push_back(a);
        continue;
      }
      const Opt* o = nullptr;
      for (const Opt& x : opts_)
        if (x.flag == a) o = &x;
      if (!o) return "unknown option " + a;
      if (i + 1 >= argc) return a + " needs a value";
      const std::string err = o->set(argv[++i]);
      if (!err.empty()) return a + " takes " + err;
    }
    return "";
  }
  // parse_or_error, exiting: 0 after --help (the usage on stdout), 2 on an error (on stderr).
  void parse(int argc, char** argv) {
    const std::string err = parse_or_error(argc, argv);
    if (err == "help") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    if (!err.empty()) {
      std::fprintf(stderr, "%s: %s (%s --help lists the options)\n", name_.c_str(), err.c_str(), name_.c_str());
      std::exit(2);
    }
  }
  std::string usage() const {
    std::string u = summary_ + "\n\nusage: " + name_ + (opts_.empty() ? "" : " [OPTIONS]") +
                    (positional_ ? " [" + positional_what_ + "]" : "") + "\n";
    if (positional_) u += "  " + pad(positional_what_) + positional_help_ + "\n";
    for (const Opt& o : opts_) u += "  " + pad(o.flag + " " + o.meta) + o.help + " [default: " + o.def + "]\n";
    u += "  " + pad("--help") + "this text\n";
    for (const std::string& e : examples_) u += (&e == &examples_[0] ? "\nexamples:\n  " : "  ") + e + "\n";
    return u;
  }

 private:
  struct Opt {
    std::string flag, meta, help, def;
    std::function<std::string(const std::string&)> set;  // "" or what the value must be
  };
  Args& add(const std::string& flag, const std::string& meta, const std::string& help, const std::string& def,
            std::function<std::string(const std::string&)> set) {
    opts_.push_back({flag, meta, help, def.empty() ? "\"\"" : def, std::move(set)});
    return *this;
  }
  static bool parse_long(const std::string& s, long& x) {
    char* end = nullptr;
    errno = 0;
    x = std::strtol(s.c_str(), &end, 10);
    return !s.empty() && *end == '\0' && errno != ERANGE;
  }
  static std::string fmt(double x) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return b;
  }
  static std::string pad(const std::string& s) { return s.size() < 26 ? s + std::string(26 - s.size(), ' ') : s + " "; }

  std::string name_, summary_;
  std::vector<Opt> opts_;
  std::vector<std::string>* positional_ = nullptr;
  std::string positional_what_, positional_help_;
  std::vector<std::string> examples_;
};

// The fields of s between separators (none for an empty s).
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  for (size_t end; (end = s.find(sep, start)) != std::string::npos; start = end + 1)
    out.push_back(s.substr(start, end - start));
  out.push_back(s.substr(start));
  return out;
}
// s as n integers separated by sep (a shape such as 32:8:1:32768), or false.
inline bool split_ints(const std::string& s, char sep, size_t n, std::vector<long>& out) {
  out.clear();
  const std::vector<std::string> fields = split(s, sep);
  for (size_t i = 0; i < fields.size(); ++i) {  // (a range-for here: GCC 12 warns falsely, -Wfree-nonheap-object)
    const std::string& f = fields[i];
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(f.c_str(), &end, 10);
    if (f.empty() || *end != '\0' || errno == ERANGE || x < -2147483647L || x > 2147483647L) return false;
    out.push_back(x);
  }
  return out.size() == n;
}

// --configs' shapes: comma-separated Hq:Hkv:A:B integers (form names them, e.g. "Hq:Hkv:batch:ctx"),
// Hq a positive multiple of Hkv, A >= min_a, B >= min_b. Returns "" or the error.
inline std::string parse_shapes(const std::string& list, const std::string& form, long min_a, long min_b,
                                std::vector<std::vector<int>>& out) {
  for (const std::string& item : split(list, ',')) {
    std::vector<long> f;
    if (!split_ints(item, ':', 4, f) || f[0] < 1 || f[1] < 1 || f[0] % f[1] != 0 || f[2] < min_a || f[3] < min_b)
      return "--configs takes " + form + " (Hq a positive multiple of Hkv, then >= " + std::to_string(min_a) +
             " and >= " + std::to_string(min_b) + "), not '" + item + "'";
    out.push_back({int(f[0]), int(f[1]), int(f[2]), int(f[3])});
  }
  return "";
}
// A comma-separated list whose items are each one of `allowed`. Returns "" or the error.
inline std::string parse_choices(const std::string& flag, const std::string& list,
                                 std::initializer_list<const char*> allowed, std::vector<std::string>& out) {
  for (const std::string& item : split(list, ',')) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || item == a;
    if (!ok) {
      std::string all;
      for (const char* a : allowed) all += (all.empty() ? "" : ", ") + std::string(a);
      return flag + " takes " + all + " (comma-separated), not '" + item + "'";
    }
    out.push_back(item);
  }
  return "";
}

}  // namespace kvcc::bench
