// Asynchronous file I/O for offload: requests (buffer address, bytes, path, offset) are split
// into blocks of `block_size` bytes and run by an io_uring ring (when the kernel allows it) or by
// a pool of pread/pwrite threads. O_DIRECT is used for the block-aligned body of a request when
// the buffer and the file offset are 4096-aligned; the unaligned tail goes through the page cache.
// File systems that refuse O_DIRECT (EINVAL at open, e.g. tmpfs) fall back to buffered I/O and
// report it through Engine::last_direct().
//
// Failure policy for writes: a write request that fails unlinks its target file if the request created it (its
// contents are undefined), so a failed request never leaves a new file that looks valid; a file that existed
// before is left as it is (it holds other records: a swap file). WaitResult::unlinked says which.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zinf::aio {

constexpr size_t kDirectAlignBytes = 4096;

enum class Op : int { kRead = 0, kWrite = 1 };

// Caps the bytes per second an Engine moves, reads and writes together (a drive shared with other work, or a
// slower drive's behaviour seen on a fast one): each block's completion is held until its bytes fit under the rate,
// on one clock of the next free moment that every block of the engine advances.
class RateLimit {
 public:
  explicit RateLimit(double bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  // Blocks the calling thread until `nbytes` more fit under the rate.
  void pass(size_t nbytes);

 private:
  double bytes_per_s_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_free_{};
};

struct Request {
  Op op = Op::kRead;
  RateLimit* limit = nullptr;  // the engine's cap, or none
  std::string path;
  char* buf = nullptr;
  size_t nbytes = 0;
  int64_t offset = 0;
  int fd_direct = -1;
  int fd_buffered = -1;
  bool direct = false;
  std::atomic<size_t> blocks_left{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // Filled on the first failure (under mu).
  int err = 0;
  bool short_read = false;
  int64_t err_offset = 0;
  size_t short_got_bytes = 0;
  std::string message;
  bool created = false;  // a write that created its file (set at submit, before any block runs)
  bool unlinked = false;
};

struct Block {
  std::shared_ptr<Request> req;
  int fd = -1;
  size_t begin = 0;  // byte offset inside the request
  size_t len = 0;
};

struct WaitResult {
  size_t nbytes = 0;
  int err = 0;            // errno of the failure, 0 on success
  bool short_read = false;
  int64_t err_offset = 0;  // file offset where the failure happened
  std::string message;
  std::string path;
  bool unlinked = false;
};

// Runs blocks; calls Engine::finish_block when each one is done.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual void enqueue(std::vector<Block> blocks) = 0;
  virtual std::string name() const = 0;
};

// Performs one block with pread/pwrite (looping over partial transfers); used by the thread backend.
void run_block_sync(const Block& b);
// Records the outcome of (part of) a block; completes the request when its last block is done.
void fail_block(const Block& b, int err, int64_t file_offset, bool short_read, size_t got_bytes);
void finish_block(const Block& b);

std::unique_ptr<Backend> make_thread_backend(int num_threads);
// nullptr when io_uring is unavailable (kernel too old, disabled, seccomp).
std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth);
bool uring_available();

class Engine {
 public:
  // backend: "auto" (io_uring if available, else threads), "io_uring" or "threads"; bytes_per_s: a cap on the
  // bytes moved per second (RateLimit), 0 for none.
  Engine(size_t block_size, unsigned queue_depth, int num_threads, bool direct, const std::string& backend,
         double bytes_per_s = 0.0);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t submit(Op op, uintptr_t addr, size_t nbytes, const std::string& path, int64_t offset);
  WaitResult wait(int64_t handle);
  // Whether the request has finished (successfully or not); never blocks, and the handle still
  // has to be waited for its result.
  bool done(int64_t handle);
  // Waits for every outstanding request; returns (handle, result) of the failed ones.
  std::vector<std::pair<int64_t, WaitResult>> wait_all();
  void close();

  std::string backend_name() const { return backend_ ? backend_->name() : "closed"; }
  bool last_direct() const { return last_direct_.load(); }
  size_t block_size() const { return block_size_; }
  unsigned queue_depth() const { return queue_depth_; }
  int num_threads() const { return num_threads_; }
  bool direct_requested() const { return direct_; }
  double bytes_per_s() const { return limit_ ? bytes_per_s_ : 0.0; }
  size_t num_pending() const;

 private:
  size_t block_size_;
  unsigned queue_depth_;
  int num_threads_;
  bool direct_;
  double bytes_per_s_;
  std::unique_ptr<RateLimit> limit_;  // declared before backend_: blocks in flight use it until the backend is gone
  std::unique_ptr<Backend> backend_;
  std::atomic<bool> last_direct_{false};
  mutable std::mutex mu_;
  int64_t next_handle_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<Request>> pending_;
  // The pending request of `handle` (removed from the table when `erase`); throws for an unknown one.
  std::shared_ptr<Request> find(int64_t handle, bool erase);
};

}  // namespace zinf::aio
