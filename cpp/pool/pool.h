// A fixed-capacity, aligned host buffer pool: one allocation carved by a buddy allocator.
// Block sizes are alignment * 2^k; freed blocks merge with their buddies, so after any sequence
// of acquire/release the free space coalesces back (no external fragmentation that grows over a
// long run). Capacity need not be a power of two: it is split into power-of-two top-level chunks
// (largest first), each its own buddy tree, so every block stays aligned to min(its size, chunk).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace zinf::pool {

class BufferPool {
 public:
  BufferPool(size_t total_bytes, size_t alignment);
  // Carves memory the caller owns and keeps mapped for the pool's life (`address` aligned to `alignment`): a
  // segment shared with other processes (zinf/runtime/shared_pool.py). Nothing is allocated or freed here.
  BufferPool(uintptr_t address, size_t total_bytes, size_t alignment);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // Offset of a block of at least nbytes (rounded to alignment * 2^k), or nullopt when no free
  // block is large enough.
  std::optional<size_t> allocate(size_t nbytes);
  // Returns the block that starts at `offset`; throws std::invalid_argument for an unknown offset.
  void free(size_t offset);

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(base_); }
  size_t capacity_bytes() const { return capacity_; }
  size_t alignment() const { return alignment_; }
  size_t bytes_in_use() const;       // sum of block sizes handed out
  size_t requested_bytes_in_use() const;
  size_t peak_bytes_in_use() const;
  size_t largest_free_block() const;
  size_t num_blocks_in_use() const;
  size_t block_size_for(size_t nbytes) const;

 private:
  int order_for(size_t nbytes) const;
  int chunk_order_at(size_t offset) const;
  size_t block_bytes(int order) const { return alignment_ << order; }

  void carve();

  char* base_ = nullptr;
  bool owned_ = true;  // allocated here (freed by the destructor), not handed in
  size_t capacity_ = 0;
  size_t alignment_ = 0;
  std::vector<std::set<size_t>> free_;         // free block offsets per order
  std::map<size_t, int> chunk_order_;          // top-level chunk start -> its order
  std::map<size_t, std::pair<int, size_t>> used_;  // offset -> (order, requested bytes)
  size_t in_use_ = 0, requested_ = 0, peak_ = 0;
  mutable std::mutex mu_;
};

}  // namespace zinf::pool
