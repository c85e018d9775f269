// Mappings of tmpfs files laid out so that the kernel can use huge pages for them.
//
// A 2 MiB page of a tmpfs file is mapped with one page-table entry only where the virtual
// address is 2 MiB-aligned like the file offset; mmap does not align mappings of a file on a
// tmpfs mounted without huge=, even when the file's pages are huge (made so by MADV_COLLAPSE or
// another process), so every mapping here is placed on a 2 MiB boundary itself.
// Huge pages cut the cost of filling page tables, which is what a fresh mapping of a 4 KiB-page
// file spends a third to a half of a load on (docs/performance.md, "Core").
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashpoint {

constexpr size_t kHugePageBytes = size_t(2) << 20;

// Linux 5.14; defined here for older headers (a kernel without them returns EINVAL).
constexpr int kMadvPopulateRead = 22;
constexpr int kMadvPopulateWrite = 23;

// mmap(MAP_SHARED) of [0, size) of fd at a 2 MiB-aligned address, with MADV_HUGEPAGE (a request
// honoured by tmpfs mounted with huge=advise, harmless elsewhere). Returns nullptr with errno set.
uint8_t* map_file_aligned(int fd, size_t size, int prot);

// mremap of a mapping made by map_file_aligned to new_size, kept 2 MiB-aligned. Returns nullptr
// with errno set (the old mapping is then unchanged).
uint8_t* remap_file_aligned(uint8_t* data, size_t old_size, size_t new_size);

// Minor page faults this thread took while populating [data, data+n) for reading or writing
// (MADV_POPULATE_*), or -1 if the kernel cannot populate (before Linux 5.14) or the populate
// failed (errno set: EFAULT when the range is past the end of the file).
// A 2 MiB range of huge pages takes one fault; of 4 KiB pages, one per fault-around window (16).
long populate_counting_faults(uint8_t* data, size_t n, bool write);

}  // namespace flashpoint
