// Where the core's copies spend their time, below Python: per-thread CPU time of each way to load a
// tmpfs file, to prepare a new buffer, and to copy small records. docs/performance.md quotes it.
//
// Build (no CMake needed; the same CRC32C code as the extension):
//   g++ -O3 -std=c++17 -Icsrc benchmarks/core_profile.cpp csrc/crc32c.cpp -o /tmp/core_profile -pthread
// Run:
//   /tmp/core_profile load FILE MIB THREADS ROUNDS   # every load method, interleaved ROUNDS times
//   /tmp/core_profile create DIR MIB ROUNDS          # a new buffer ready for writing, several ways
//   /tmp/core_profile small MIB ROUNDS LO HI         # records of LO..HI bytes: cached vs streaming stores
// Figures are medians; CPU time counts user and kernel time of the threads doing the work, so
// other processes on the machine distort them far less than wall-clock time.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "crc32c.hpp"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

using namespace flashpoint;

namespace {

constexpr int kPopulateRead = 22;
constexpr int kPopulateWrite = 23;
constexpr uint64_t kPiece = uint64_t(4) << 20;
constexpr size_t kHuge = size_t(2) << 20;

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

double wall_now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

long minor_faults() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A mapping on a 2 MiB boundary, as csrc/mappings.cpp makes them.
uint8_t* map_aligned(int fd, size_t size, int prot) {
  void* r = mmap(nullptr, size + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  const uintptr_t a = (reinterpret_cast<uintptr_t>(r) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  void* p = mmap(reinterpret_cast<void*>(a), size, prot, MAP_SHARED | MAP_FIXED, fd, 0);
  if (reinterpret_cast<uintptr_t>(r) < a) munmap(r, a - reinterpret_cast<uintptr_t>(r));
  const uintptr_t end = reinterpret_cast<uintptr_t>(r) + size + kHuge;
  if (a + size < end) munmap(reinterpret_cast<void*>(a + size), end - a - size);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  return static_cast<uint8_t*>(p);
}

void pread_fully(int fd, uint8_t* dst, uint64_t n, uint64_t off) {
  while (n) {
    const ssize_t got = pread(fd, dst, n, static_cast<off_t>(off));
    if (got <= 0) {
      perror("pread");
      exit(1);
    }
    dst += got;
    n -= got;
    off += got;
  }
}

struct Sample {
  double wall = 0, cpu = 0, phase_a = 0, phase_b = 0;
  long faults = 0;
  uint32_t crc = 0;
};

// fn(offset, length, phase_a, phase_b) -> CRC over 4 MiB pieces on `threads` threads.
using PieceFn = std::function<uint32_t(uint64_t, uint64_t, double&, double&)>;

Sample run_pieces(uint64_t size, int threads, const PieceFn& fn) {
  const size_t n = (size + kPiece - 1) / kPiece;
  std::vector<uint32_t> crcs(n);
  std::atomic<size_t> next{0};
  std::vector<double> cpu(threads), a(threads), b(threads);
  const long faults = minor_faults();
  const double start = wall_now();
  auto worker = [&](int id) {
    const double c0 = cpu_now();
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      const uint64_t off = i * kPiece;
      crcs[i] = fn(off, std::min(kPiece, size - off), a[id], b[id]);
    }
    cpu[id] = cpu_now() - c0;
  };
  std::vector<std::thread> helpers;
  for (int i = 1; i < threads; ++i) helpers.emplace_back(worker, i);
  worker(0);
  for (auto& h : helpers) h.join();
  Sample s;
  s.wall = wall_now() - start;
  s.faults = minor_faults() - faults;
  for (int i = 0; i < threads; ++i) {
    s.cpu += cpu[i];
    s.phase_a += a[i];
    s.phase_b += b[i];
  }
  s.crc = crcs[0];
  for (size_t i = 1; i < n; ++i) s.crc = crc32c_combine(s.crc, crcs[i], std::min(kPiece, size - i * kPiece));
  return s;
}

int load(const char* path, uint64_t size, int threads, int rounds) {
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    perror("open");
    return 1;
  }
  {
    std::vector<uint8_t> block(8 << 20);
    std::mt19937_64 rng(1);
    for (auto& byte : block) byte = static_cast<uint8_t>(rng());
    for (uint64_t off = 0; off < size; off += block.size())
      if (pwrite(fd, block.data(), std::min<uint64_t>(block.size(), size - off), off) < 0) perror("pwrite");
  }
  struct stat st;
  fstat(fd, &st);
  close(fd);
  fd = open(path, O_RDONLY);
  auto* dst = static_cast<uint8_t*>(aligned_alloc(4096, size));
  memset(dst, 1, size);  // touched, like the loads' pre-allocated destinations

  // phase_a: making the source bytes reachable (page tables, or pread's kernel copy);
  // phase_b: the copy + CRC32C into the destination.
  auto mapped = [&](int populate) {
    return [=]() {
      uint8_t* src = map_aligned(fd, size, PROT_READ);
      Sample s = run_pieces(size, threads, [&](uint64_t off, uint64_t n, double& a, double& b) {
        const double c0 = cpu_now();
        if (populate) madvise(src + off, n, populate);
        const double c1 = cpu_now();
        const uint32_t crc = crc32c_copy(dst + off, src + off, n);
        a += c1 - c0;
        b += cpu_now() - c1;
        return crc;
      });
      munmap(src, size);
      return s;
    };
  };
  auto whole_populate = [&]() {
    const double c0 = cpu_now(), w0 = wall_now();
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    const double populate_cpu = cpu_now() - c0, populate_wall = wall_now() - w0;
    const auto* src = static_cast<const uint8_t*>(p);
    Sample s = run_pieces(size, threads, [&](uint64_t off, uint64_t n, double&, double& b) {
      const double c1 = cpu_now();
      const uint32_t crc = crc32c_copy(dst + off, src + off, n);
      b += cpu_now() - c1;
      return crc;
    });
    s.wall += populate_wall;
    s.cpu += populate_cpu;
    s.phase_a += populate_cpu;
    munmap(p, size);
    return s;
  };
  auto bounced = [&](uint64_t chunk) {
    return [=]() {
      return run_pieces(size, threads, [&](uint64_t off, uint64_t n, double& a, double& b) {
        thread_local std::vector<uint8_t> bounce;
        if (bounce.size() < chunk) bounce.resize(chunk);
        uint32_t crc = 0;
        for (uint64_t done = 0; done < n; done += chunk) {
          const uint64_t m = std::min(chunk, n - done);
          const double c0 = cpu_now();
          pread_fully(fd, bounce.data(), m, off + done);
          const double c1 = cpu_now();
          crc = crc32c_copy(dst + off + done, bounce.data(), m, crc);
          a += c1 - c0;
          b += cpu_now() - c1;
        }
        return crc;
      });
    };
  };
  auto direct = [&](uint64_t chunk) {
    return [=]() {
      return run_pieces(size, threads, [&](uint64_t off, uint64_t n, double& a, double& b) {
        uint32_t crc = 0;
        for (uint64_t done = 0; done < n; done += chunk) {
          const uint64_t m = std::min(chunk, n - done);
          const double c0 = cpu_now();
          pread_fully(fd, dst + off + done, m, off + done);
          const double c1 = cpu_now();
          crc = crc32c(dst + off + done, m, crc);
          a += c1 - c0;
          b += cpu_now() - c1;
        }
        return crc;
      });
    };
  };
  uint8_t* warm = map_aligned(fd, size, PROT_READ);
  madvise(warm, size, kPopulateRead);
  auto warm_copy = [&]() {
    return run_pieces(size, threads, [&](uint64_t off, uint64_t n, double&, double& b) {
      const double c1 = cpu_now();
      const uint32_t crc = crc32c_copy(dst + off, warm + off, n);
      b += cpu_now() - c1;
      return crc;
    });
  };

  const std::vector<std::pair<std::string, std::function<Sample()>>> methods = {
      {"map + MADV_POPULATE_READ", mapped(kPopulateRead)},
      {"map, faults as it copies", mapped(0)},
      {"map + MAP_POPULATE", whole_populate},
      {"pread 256K in place + crc", direct(256 << 10)},
      {"pread 1M in place + crc", direct(1 << 20)},
      {"pread 128K bounce + copy", bounced(128 << 10)},
      {"pread 256K bounce + copy", bounced(256 << 10)},
      {"pread 512K bounce + copy", bounced(512 << 10)},
      {"pread 1M bounce + copy", bounced(1 << 20)},
      {"already mapped (reference)", warm_copy},
  };
  std::map<std::string, std::vector<Sample>> samples;
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < methods.size(); ++k) {
      const auto& m = methods[(k + r) % methods.size()];
      samples[m.first].push_back(m.second());
    }
  const uint32_t reference = samples[methods.back().first][0].crc;
  printf("%s: %.0f MiB, st_blksize %ld, %d threads, %d rounds, load average at end %.1f\n", path, size / 1048576.0,
         static_cast<long>(st.st_blksize), threads, rounds, [] {
           double l[3];
           return getloadavg(l, 3) > 0 ? l[0] : -1.0;
         }());
  printf("%-28s %9s %9s %9s %10s %9s %8s %6s\n", "method", "cpu ms", "x ref", "reach ms", "copy ms", "wall ms",
         "faults", "crc");
  const double ref_cpu = [&] {
    std::vector<double> c;
    for (const auto& s : samples[methods.back().first]) c.push_back(s.cpu);
    return median(c);
  }();
  for (const auto& m : methods) {
    std::vector<double> cpu, wall, a, b;
    bool same = true;
    for (const auto& s : samples[m.first]) {
      cpu.push_back(s.cpu);
      wall.push_back(s.wall);
      a.push_back(s.phase_a);
      b.push_back(s.phase_b);
      same = same && s.crc == reference;
    }
    printf("%-28s %9.1f %9.2f %9.1f %10.1f %9.1f %8ld %6s\n", m.first.c_str(), median(cpu) * 1e3,
           median(cpu) / ref_cpu, median(a) * 1e3, median(b) * 1e3, median(wall) * 1e3, samples[m.first].back().faults,
           same ? "ok" : "WRONG");
  }
  munmap(warm, size);
  unlink(path);
  return 0;
}

int create(const std::string& dir, size_t size, int rounds) {
  struct Way {
    const char* name;
    bool truncate_first, advise, collapse;
  };
  const Way ways[] = {
      {"fallocate, map, populate", false, false, false},
      {"ftruncate, map+HUGEPAGE, populate, fallocate", true, true, false},
      {"fallocate, map, MADV_COLLAPSE, populate", false, false, true},
  };
  std::vector<uint8_t> src(size, 7);
  printf("%s: a new %.0f MiB buffer, CPU ms (median of %d)\n", dir.c_str(), size / 1048576.0, rounds);
  printf("%-46s %10s %10s %10s %8s\n", "way", "prepare", "1st copy", "2nd copy", "huge");
  for (const Way& way : ways) {
    std::vector<double> prepare, first, second;
    bool huge = false;
    int collapse_errno = 0;
    for (int r = 0; r < rounds; ++r) {
      const std::string path = dir + "/core_profile_buffer";
      unlink(path.c_str());
      const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      const double c0 = cpu_now();
      uint8_t* p;
      if (way.truncate_first) {
        if (ftruncate(fd, static_cast<off_t>(size)) != 0) perror("ftruncate");
        p = map_aligned(fd, size, PROT_READ | PROT_WRITE);
        if (way.advise) madvise(p, size, MADV_HUGEPAGE);
        madvise(p, size, kPopulateWrite);
        posix_fallocate(fd, 0, static_cast<off_t>(size));
      } else {
        posix_fallocate(fd, 0, static_cast<off_t>(size));
        p = map_aligned(fd, size, PROT_READ | PROT_WRITE);
        if (way.collapse && madvise(p, size, MADV_COLLAPSE) != 0) collapse_errno = errno;
        madvise(p, size, kPopulateWrite);
      }
      const double c1 = cpu_now();
      crc32c_copy(p, src.data(), size);
      const double c2 = cpu_now();
      crc32c_copy(p, src.data(), size);
      const double c3 = cpu_now();
      prepare.push_back(c1 - c0);
      first.push_back(c2 - c1);
      second.push_back(c3 - c2);
      // A 2 MiB range of huge pages populates with a single fault.
      munmap(p, size);
      p = map_aligned(fd, size, PROT_READ);
      const long f0 = minor_faults();
      madvise(p, kHuge, kPopulateRead);
      huge = minor_faults() - f0 <= 2;
      munmap(p, size);
      close(fd);
      unlink(path.c_str());
    }
    printf("%-46s %10.1f %10.1f %10.1f %8s%s%s\n", way.name, median(prepare) * 1e3, median(first) * 1e3,
           median(second) * 1e3, huge ? "yes" : "no", collapse_errno ? "  collapse: " : "",
           collapse_errno ? strerror(collapse_errno) : "");
  }
  return 0;
}

int small(size_t total, int rounds, size_t lo, size_t hi) {
  std::mt19937 rng(5);
  std::vector<std::pair<size_t, size_t>> ops;  // (source offset, nbytes)
  size_t off = 0, sum = 0;
  while (sum < total) {
    const size_t n = (lo + rng() % (hi - lo)) / 4 * 4;
    ops.push_back({off, n});
    off += (n + 63) / 64 * 64;
    sum += n;
  }
  auto* src = static_cast<uint8_t*>(aligned_alloc(64, off + 4096));
  for (size_t i = 0; i < off; ++i) src[i] = static_cast<uint8_t>(i * 31);
  // Destinations spread over 1 GiB, as records among large tensors are: not in the cache.
  const size_t span = size_t(1) << 30;
  auto* dst = static_cast<uint8_t*>(
      mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  std::vector<size_t> where(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) where[i] = (span / ops.size()) * i / 64 * 64;
  std::vector<uint8_t> junk(64 << 20);
  std::vector<double> cached, streamed;
  for (int r = 0; r < rounds; ++r)
    for (int k = 0; k < 2; ++k) {
      const bool plain = (k + r) % 2 == 0;
      for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;  // evict
      const double c0 = cpu_now();
      for (size_t i = 0; i < ops.size(); ++i) {
        if (plain) {
          memcpy(dst + where[i], src + ops[i].first, ops[i].second);
          crc32c(dst + where[i], ops[i].second);
        } else {
          crc32c_copy(dst + where[i], src + ops[i].first, ops[i].second);
        }
      }
      (plain ? cached : streamed).push_back(cpu_now() - c0);
    }
  printf("%zu records of %zu-%zu bytes, %.1f MB: memcpy + crc32c %.2f ms (%.1f GB/s), crc32c_copy %.2f ms (%.1f GB/s)\n",
         ops.size(), lo, hi, sum / 1e6, median(cached) * 1e3, sum / median(cached) / 1e9, median(streamed) * 1e3,
         sum / median(streamed) / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "load" && argc == 6) return load(argv[2], strtoull(argv[3], nullptr, 10) << 20, atoi(argv[4]), atoi(argv[5]));
  if (mode == "create" && argc == 5) return create(argv[2], strtoull(argv[3], nullptr, 10) << 20, atoi(argv[4]));
  if (mode == "small" && argc == 6)
    return small(strtoull(argv[2], nullptr, 10) << 20, atoi(argv[3]), strtoull(argv[4], nullptr, 10),
                 strtoull(argv[5], nullptr, 10));
  fprintf(stderr,
          "usage: %s load FILE MIB THREADS ROUNDS | create DIR MIB ROUNDS | small MIB ROUNDS LO HI\n",
          argv[0]);
  return 2;
}
