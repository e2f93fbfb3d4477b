// The fuzz targets' main() when they are not built with libFuzzer (every compiler): runs
// LLVMFuzzerTestOneInput once on each file named on the command line, or found (recursively) in a
// directory named there, so that ctest replays the seed corpora and the regression inputs.
//
// A crash or an uncaught exception fails as it would under libFuzzer. So does an input that takes
// longer than --max-seconds or, outside sanitizer builds (whose shadow memory and quarantine
// inflate it), one after which the peak RSS exceeds --max-rss-mb: what libFuzzer's -timeout and
// -rss_limit_mb would report.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

long peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024;  // kilobytes on Linux
}

std::vector<fs::path> inputs_in(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  return files;
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: fuzz-target [--max-seconds S] [--max-rss-mb M] FILE_OR_DIR...\n"
               "runs the fuzz target once on every input (a directory: every file under it)\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  double max_seconds = 10;
  long max_rss_mb = 256;
  std::vector<fs::path> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string_view argument = argv[i];
    if ((argument == "--max-seconds" || argument == "--max-rss-mb") && i + 1 < argc) {
      const double value = std::atof(argv[++i]);
      if (argument == "--max-seconds") {
        max_seconds = value;
      } else {
        max_rss_mb = static_cast<long>(value);
      }
    } else if (argument.starts_with("-")) {
      usage();
    } else {
      paths.emplace_back(argument);
    }
  }
  if (paths.empty()) usage();
  std::size_t count = 0;
  for (const fs::path& path : paths) {
    if (!fs::exists(path)) {
      std::fprintf(stderr, "%s: does not exist\n", path.c_str());
      return 1;
    }
    for (const fs::path& file : inputs_in(path)) {
      std::ifstream in(file, std::ios::binary);
      const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      const auto start = std::chrono::steady_clock::now();
      (void)LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                   bytes.size());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (seconds > max_seconds) {
        std::fprintf(stderr, "%s: took %.1f s, more than %.1f s\n", file.c_str(), seconds,
                     max_seconds);
        return 1;
      }
      if (!kSanitized && peak_rss_mb() > max_rss_mb) {
        std::fprintf(stderr, "%s: peak RSS %ld MB, more than %ld MB\n", file.c_str(), peak_rss_mb(),
                     max_rss_mb);
        return 1;
      }
      ++count;
    }
  }
  std::printf("ran %zu inputs\n", count);
  return 0;
}
