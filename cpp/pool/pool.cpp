#include "pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <new>
#include <stdexcept>
#include <string>

namespace zinf::pool {

namespace {

size_t checked_capacity(size_t total_bytes, size_t alignment) {
  if (alignment < 64 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("alignment must be a power of two >= 64, got " + std::to_string(alignment));
  const size_t capacity = total_bytes / alignment * alignment;
  if (capacity == 0)
    throw std::invalid_argument("total_bytes must be at least the alignment (" + std::to_string(alignment) +
                                "), got " + std::to_string(total_bytes));
  return capacity;
}

}  // namespace

BufferPool::BufferPool(size_t total_bytes, size_t alignment)
    : capacity_(checked_capacity(total_bytes, alignment)), alignment_(alignment) {
  void* p = nullptr;
  if (::posix_memalign(&p, alignment, capacity_) != 0) throw std::bad_alloc();
  base_ = static_cast<char*>(p);
#ifdef MADV_HUGEPAGE
  ::madvise(base_, capacity_, MADV_HUGEPAGE);
#endif
  carve();
}

BufferPool::BufferPool(uintptr_t address, size_t total_bytes, size_t alignment)
    : owned_(false), capacity_(checked_capacity(total_bytes, alignment)), alignment_(alignment) {
  if (address == 0 || address % alignment != 0)
    throw std::invalid_argument("the pool's memory must start at a multiple of the alignment (" +
                                std::to_string(alignment) + "), got address " + std::to_string(address));
  base_ = reinterpret_cast<char*>(address);
  carve();
}

void BufferPool::carve() {
  const size_t units = capacity_ / alignment_;
  int max_order = 0;
  while ((size_t{1} << (max_order + 1)) <= units) ++max_order;
  free_.resize(static_cast<size_t>(max_order) + 1);
  size_t offset = 0;
  for (int k = max_order; k >= 0; --k) {
    if (units & (size_t{1} << k)) {
      chunk_order_[offset] = k;
      free_[k].insert(offset);
      offset += block_bytes(k);
    }
  }
}

BufferPool::~BufferPool() {
  if (owned_) std::free(base_);
}

int BufferPool::order_for(size_t nbytes) const {
  int k = 0;
  while (block_bytes(k) < nbytes) ++k;
  return k;
}

size_t BufferPool::block_size_for(size_t nbytes) const { return block_bytes(order_for(nbytes == 0 ? 1 : nbytes)); }

int BufferPool::chunk_order_at(size_t offset) const {
  auto it = chunk_order_.upper_bound(offset);
  --it;
  return it->second;
}

std::optional<size_t> BufferPool::allocate(size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  std::lock_guard<std::mutex> lk(mu_);
  if (nbytes > capacity_) return std::nullopt;
  const int want = order_for(nbytes);
  int k = want;
  while (k < static_cast<int>(free_.size()) && free_[k].empty()) ++k;
  if (k >= static_cast<int>(free_.size())) return std::nullopt;
  const size_t offset = *free_[k].begin();  // lowest address first keeps the arena compact
  free_[k].erase(free_[k].begin());
  while (k > want) {  // split, keeping the lower half
    --k;
    free_[k].insert(offset + block_bytes(k));
  }
  used_[offset] = {want, nbytes};
  in_use_ += block_bytes(want);
  requested_ += nbytes;
  if (in_use_ > peak_) peak_ = in_use_;
  return offset;
}

void BufferPool::free(size_t offset) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = used_.find(offset);
  if (it == used_.end())
    throw std::invalid_argument("offset " + std::to_string(offset) +
                                " is not the start of a buffer acquired from this pool");
  int k = it->second.first;
  in_use_ -= block_bytes(k);
  requested_ -= it->second.second;
  used_.erase(it);
  const auto chunk = chunk_order_.upper_bound(offset);
  const size_t chunk_start = std::prev(chunk)->first;
  const int chunk_k = std::prev(chunk)->second;
  size_t off = offset;
  while (k < chunk_k) {  // merge with the buddy while it is free and inside the same chunk
    const size_t rel = off - chunk_start;
    const size_t buddy = chunk_start + (rel ^ block_bytes(k));
    auto b = free_[k].find(buddy);
    if (b == free_[k].end()) break;
    free_[k].erase(b);
    off = std::min(off, buddy);
    ++k;
  }
  free_[k].insert(off);
}

size_t BufferPool::bytes_in_use() const { std::lock_guard<std::mutex> lk(mu_); return in_use_; }
size_t BufferPool::requested_bytes_in_use() const { std::lock_guard<std::mutex> lk(mu_); return requested_; }
size_t BufferPool::peak_bytes_in_use() const { std::lock_guard<std::mutex> lk(mu_); return peak_; }
size_t BufferPool::num_blocks_in_use() const { std::lock_guard<std::mutex> lk(mu_); return used_.size(); }

size_t BufferPool::largest_free_block() const {
  std::lock_guard<std::mutex> lk(mu_);
  for (int k = static_cast<int>(free_.size()) - 1; k >= 0; --k)
    if (!free_[k].empty()) return block_bytes(k);
  return 0;
}

}  // namespace zinf::pool
