#include "mappings.hpp"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

namespace flashpoint {
namespace {

uintptr_t round_up(uintptr_t value, uintptr_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// An inaccessible reservation of size bytes starting on a 2 MiB boundary; nullptr if none.
uint8_t* reserve_aligned(size_t size) {
  void* raw = ::mmap(nullptr, size + kHugePageBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = round_up(begin, kHugePageBytes);
  if (aligned > begin) ::munmap(raw, aligned - begin);
  const uintptr_t end = begin + size + kHugePageBytes;
  if (end > aligned + size) ::munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  return reinterpret_cast<uint8_t*>(aligned);
}

void advise_huge(uint8_t* data, size_t size) {
  const int saved = errno;
  ::madvise(data, size, MADV_HUGEPAGE);  // EINVAL without transparent huge pages: nothing to do
  errno = saved;
}

long minor_faults_of_this_thread() {
  struct rusage usage;
  if (::getrusage(RUSAGE_THREAD, &usage) != 0) return 0;
  return usage.ru_minflt;
}

}  // namespace

uint8_t* map_file_aligned(int fd, size_t size, int prot) {
  void* p = MAP_FAILED;
  if (size >= kHugePageBytes) {
    // Our own reservation is replaced (MAP_FIXED), so no other mapping can be hit.
    uint8_t* where = reserve_aligned(size);
    if (where != nullptr) {
      p = ::mmap(where, size, prot, MAP_SHARED | MAP_FIXED, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::munmap(where, size);
        errno = err;
        return nullptr;
      }
    }
  }
  if (p == MAP_FAILED) p = ::mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return nullptr;
  advise_huge(static_cast<uint8_t*>(p), size);
  return static_cast<uint8_t*>(p);
}

uint8_t* remap_file_aligned(uint8_t* data, size_t old_size, size_t new_size) {
  void* p = MAP_FAILED;
  uint8_t* where = new_size >= kHugePageBytes ? reserve_aligned(new_size) : nullptr;
  if (where != nullptr) {
    // Moves the page tables into the reservation (replacing it); the old range is unmapped.
    p = ::mremap(data, old_size, new_size, MREMAP_MAYMOVE | MREMAP_FIXED, where);
    if (p == MAP_FAILED) ::munmap(where, new_size);
  }
  if (p == MAP_FAILED) p = ::mremap(data, old_size, new_size, MREMAP_MAYMOVE);
  if (p == MAP_FAILED) return nullptr;
  advise_huge(static_cast<uint8_t*>(p), new_size);
  return static_cast<uint8_t*>(p);
}

long populate_counting_faults(uint8_t* data, size_t n, bool write) {
  const long before = minor_faults_of_this_thread();
  if (::madvise(data, n, write ? kMadvPopulateWrite : kMadvPopulateRead) != 0) return -1;
  return minor_faults_of_this_thread() - before;
}

}  // namespace flashpoint
