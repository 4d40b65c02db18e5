// The gather buffer cache: a c10::Allocator that keeps freed blocks for the next allocation of the same size.
// See [Note: gather buffer cache] in core/zinf/native/buffer_cache.py, which builds this file (against the installed
// torch's c10 headers, the one part of zinf that links torch) and calls it through a plain C interface.
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kAlignment = 64;  // c10's own CPU alignment
constexpr size_t kHugePage = size_t{2} << 20;  // x86-64's transparent huge page

// A block of at least one huge page is aligned to one and asks the kernel for huge pages (where transparent huge
// pages are "madvise", as on most distributions): its first touch faults in 2 MiB at a time instead of 4 KiB, 512
// times fewer faults. Smaller blocks keep c10's alignment.
void* allocate_block(size_t nbytes) {
  void* ptr = nullptr;
  const bool huge = nbytes >= kHugePage;
  if (posix_memalign(&ptr, huge ? kHugePage : kAlignment, nbytes) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
  if (huge) madvise(ptr, nbytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only: its failure changes nothing
#endif
  return ptr;
}

class BufferCache;

// One block of memory, in use or kept; its DataPtr's context, so that a freed block goes back to the cache that
// handed it out (each engine has its own).
struct Block {
  void* ptr;
  size_t nbytes;
  BufferCache* owner;
};

// Blocks come from posix_memalign and go back to free. The blocks in use and the blocks kept together stay within
// the bound at all times: a quarter more than the most ever in use at once, plus the largest block. A miss makes
// room for its fresh block before allocating it, and a freed block is kept only where it fits; the least recently
// freed kept blocks go first to make room. Once closed, the cache keeps nothing.
class BufferCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
    Block* block = take(nbytes);
    if (block == nullptr) {
      void* ptr = allocate_block(nbytes);
      if (ptr == nullptr) {
        std::lock_guard<std::mutex> lock(mu_);
        live_bytes_ -= nbytes;  // the room reserved by take()
        throw std::bad_alloc();
      }
      block = new Block{ptr, nbytes, this};
    }
    return {block->ptr, block, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static void release(void* ctx) {
    if (ctx != nullptr) {
      auto* block = static_cast<Block*>(ctx);
      block->owner->give_back(block);
    }
  }

  // gives every kept block back and starts counting the most in use at once again
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    trim_to(0);
    peak_live_ = live_bytes_;
    largest_ = 0;
  }

  // gives every kept block back and keeps none from now on (its engine closed; storages may still name this cache
  // as their allocator, so it is never destroyed)
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    trim_to(0);
  }

  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out[0] = cached_bytes_;
    out[1] = live_bytes_;
    out[2] = peak_live_;
    out[3] = hits_;
    out[4] = misses_;
    out[5] = dropped_;
    out[6] = largest_;
  }

 private:
  // a kept block of ``nbytes``, or none (a miss: its bytes are counted in use from now on, and kept blocks make
  // room for them before the caller allocates)
  Block* take(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_size_.find(nbytes);
    if (it == by_size_.end() || it->second.empty()) {
      ++misses_;
      note_live(nbytes);
      const uint64_t limit = bound();
      trim_to(limit > live_bytes_ ? limit - live_bytes_ : 0);
      return nullptr;
    }
    auto pos = it->second.back();
    it->second.pop_back();
    Block* block = *pos;
    lru_.erase(pos);
    cached_bytes_ -= nbytes;
    ++hits_;
    note_live(nbytes);
    return block;
  }

  void note_live(size_t nbytes) {
    live_bytes_ += nbytes;
    if (live_bytes_ > peak_live_) peak_live_ = live_bytes_;
    if (nbytes > largest_) largest_ = nbytes;
  }

  // without the slack, blocks of the sizes a step needs next are evicted at its peak (measured: a few misses a step)
  uint64_t bound() const { return peak_live_ + peak_live_ / 4 + largest_; }

  void give_back(Block* block) {
    std::lock_guard<std::mutex> lock(mu_);
    live_bytes_ -= block->nbytes;
    const uint64_t limit = bound();
    // the least recently freed blocks go first, to make room for this one
    const uint64_t room = live_bytes_ + block->nbytes <= limit ? limit - live_bytes_ - block->nbytes : 0;
    trim_to(room);
    if (closed_ || live_bytes_ + cached_bytes_ + block->nbytes > limit) {
      ++dropped_;
      std::free(block->ptr);
      delete block;
      return;
    }
    lru_.push_back(block);
    by_size_[block->nbytes].push_back(std::prev(lru_.end()));
    cached_bytes_ += block->nbytes;
  }

  // frees kept blocks, least recently freed first, until at most `keep` bytes are kept
  void trim_to(uint64_t keep) {
    while (cached_bytes_ > keep && !lru_.empty()) {
      Block* oldest = lru_.front();
      auto& same = by_size_[oldest->nbytes];
      for (auto pos = same.begin(); pos != same.end(); ++pos) {
        if (*pos == lru_.begin()) {
          same.erase(pos);
          break;
        }
      }
      lru_.pop_front();
      cached_bytes_ -= oldest->nbytes;
      ++dropped_;
      std::free(oldest->ptr);
      delete oldest;
    }
  }

  std::mutex mu_;
  std::list<Block*> lru_;
  std::unordered_map<size_t, std::vector<std::list<Block*>::iterator>> by_size_;
  uint64_t cached_bytes_ = 0, live_bytes_ = 0, peak_live_ = 0, largest_ = 0;
  uint64_t hits_ = 0, misses_ = 0, dropped_ = 0;
  bool closed_ = false;
};

}  // namespace

extern "C" {

// A new cache (one per engine), written to `out`. Never destroyed: storages it allocated for keep it as their
// allocator.
void zinf_buffer_cache_new(void** out) { *out = new BufferCache(); }

// The storage (a c10::StorageImpl, Python's UntypedStorage._cdata) allocates through `cache` from its next resize.
int zinf_buffer_cache_attach(void* cache, void* storage_impl) {
  auto* storage = static_cast<c10::StorageImpl*>(storage_impl);
  if (storage == nullptr || !storage->resizable()) return 1;
  storage->set_allocator(static_cast<BufferCache*>(cache));
  return 0;
}

void zinf_buffer_cache_clear(void* cache) { static_cast<BufferCache*>(cache)->clear(); }

void zinf_buffer_cache_close(void* cache) { static_cast<BufferCache*>(cache)->close(); }

// cached bytes, live bytes, peak live bytes, hits, misses, blocks freed, largest block's bytes
void zinf_buffer_cache_stats(void* cache, uint64_t* out) { static_cast<BufferCache*>(cache)->stats(out); }

}  // extern "C"
