// The gather buffer cache: a c10::Allocator that keeps freed blocks for the next allocation of the same size.
// See [Note: gather buffer cache] in core/zinf/native/buffer_cache.py, which builds this file (against the installed
// torch's c10 headers, the one part of zinf that links torch) and calls it through a plain C interface.
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <cstdlib>
#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kAlignment = 64;  // c10's own CPU alignment

struct Cached {
  void* ptr;
  size_t nbytes;
};

// Blocks come from posix_memalign and go back to free; a freed block is kept while the blocks in use and the blocks
// kept together stay within the bound: a quarter more than the most ever in use at once, plus the largest block.
// The least recently freed kept blocks make room for a newly freed one.
class BufferCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
    void* ptr = take(nbytes);
    if (ptr == nullptr) {
      if (posix_memalign(&ptr, kAlignment, nbytes) != 0) throw std::bad_alloc();
      std::lock_guard<std::mutex> lock(mu_);
      ++misses_;
      note_live(ptr, nbytes);
    }
    return {ptr, ptr, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static void release(void* ptr) {
    if (ptr != nullptr) instance()->give_back(ptr);
  }

  static BufferCache* instance() {
    static BufferCache* cache = new BufferCache();  // never destroyed: storages may be freed during exit
    return cache;
  }

  // gives every kept block back and starts counting the most in use at once again (an engine closed)
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    trim_to(0);
    peak_live_ = live_bytes_;
    largest_ = 0;
  }

  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out[0] = cached_bytes_;
    out[1] = live_bytes_;
    out[2] = peak_live_;
    out[3] = hits_;
    out[4] = misses_;
    out[5] = dropped_;
  }

 private:
  void* take(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_size_.find(nbytes);
    if (it == by_size_.end() || it->second.empty()) return nullptr;
    auto pos = it->second.back();
    it->second.pop_back();
    void* ptr = pos->ptr;
    lru_.erase(pos);
    cached_bytes_ -= nbytes;
    ++hits_;
    note_live(ptr, nbytes);
    return ptr;
  }

  void note_live(void* ptr, size_t nbytes) {
    sizes_[ptr] = nbytes;
    live_bytes_ += nbytes;
    if (live_bytes_ > peak_live_) peak_live_ = live_bytes_;
    if (nbytes > largest_) largest_ = nbytes;
  }

  // without the slack, blocks of the sizes a step needs next are evicted at its peak (measured: a few misses a step)
  uint64_t bound() const { return peak_live_ + peak_live_ / 4 + largest_; }

  void give_back(void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) {  // not ours (cannot happen: only this allocator's DataPtrs carry this deleter)
      std::free(ptr);
      return;
    }
    const size_t nbytes = it->second;
    sizes_.erase(it);
    live_bytes_ -= nbytes;
    const uint64_t limit = bound();
    if (nbytes > limit) {
      ++dropped_;
      std::free(ptr);
      return;
    }
    // the least recently freed blocks go first, to make room for this one
    trim_to(limit - nbytes > live_bytes_ ? limit - nbytes - live_bytes_ : 0);
    if (live_bytes_ + cached_bytes_ + nbytes > limit) {
      ++dropped_;
      std::free(ptr);
      return;
    }
    lru_.push_back(Cached{ptr, nbytes});
    by_size_[nbytes].push_back(std::prev(lru_.end()));
    cached_bytes_ += nbytes;
  }

  // frees kept blocks, least recently freed first, until at most `keep` bytes are kept
  void trim_to(uint64_t keep) {
    while (cached_bytes_ > keep && !lru_.empty()) {
      Cached oldest = lru_.front();
      auto& same = by_size_[oldest.nbytes];
      for (auto pos = same.begin(); pos != same.end(); ++pos) {
        if (*pos == lru_.begin()) {
          same.erase(pos);
          break;
        }
      }
      lru_.pop_front();
      cached_bytes_ -= oldest.nbytes;
      ++dropped_;
      std::free(oldest.ptr);
    }
  }

  std::mutex mu_;
  std::list<Cached> lru_;
  std::unordered_map<size_t, std::vector<std::list<Cached>::iterator>> by_size_;
  std::unordered_map<void*, size_t> sizes_;
  uint64_t cached_bytes_ = 0, live_bytes_ = 0, peak_live_ = 0, largest_ = 0;
  uint64_t hits_ = 0, misses_ = 0, dropped_ = 0;
};

}  // namespace

extern "C" {

// The storage (a c10::StorageImpl, Python's UntypedStorage._cdata) allocates through the cache from its next resize.
int zinf_buffer_cache_attach(void* storage_impl) {
  auto* storage = static_cast<c10::StorageImpl*>(storage_impl);
  if (storage == nullptr || !storage->resizable()) return 1;
  storage->set_allocator(BufferCache::instance());
  return 0;
}

void zinf_buffer_cache_clear() { BufferCache::instance()->clear(); }

// cached bytes, live bytes, peak live bytes, hits, misses, blocks freed
void zinf_buffer_cache_stats(uint64_t* out) { BufferCache::instance()->stats(out); }

}  // extern "C"
