#include "aio.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace zinf::aio {
namespace {

void complete_request(Request& r) {
  if (r.fd_direct >= 0) ::close(r.fd_direct);
  if (r.fd_buffered >= 0) ::close(r.fd_buffered);
  r.fd_direct = r.fd_buffered = -1;
  std::lock_guard<std::mutex> lk(r.mu);
  // only a file this request created: one that existed holds other records (a swap file), still live
  if (r.failed.load() && r.created) r.unlinked = (::unlink(r.path.c_str()) == 0);
  r.done = true;
  r.cv.notify_all();
}

std::string describe(const Request& r) {
  return std::string(r.op == Op::kRead ? "read" : "write") + " of " + std::to_string(r.nbytes) +
         " bytes at offset " + std::to_string(r.offset) + " of '" + r.path + "'";
}

// ---------------------------------------------------------------- thread backend
class ThreadBackend final : public Backend {
 public:
  explicit ThreadBackend(int num_threads) {
    for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  void enqueue(std::vector<Block> blocks) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& b : blocks) queue_.push_back(std::move(b));
    }
    cv_.notify_all();
  }
  std::string name() const override { return "threads"; }

 private:
  void loop() {
    for (;;) {
      Block b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      run_block_sync(b);
      finish_block(b);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

void fail_block(const Block& b, int err, int64_t file_offset, bool short_read, size_t got_bytes) {
  Request& r = *b.req;
  std::lock_guard<std::mutex> lk(r.mu);
  if (r.failed.exchange(true)) return;  // keep the first failure
  r.err = err;
  r.short_read = short_read;
  r.err_offset = file_offset;
  r.short_got_bytes = got_bytes;
  if (short_read) {
    r.message = "short read: " + describe(r) + " reached end of file at offset " +
                std::to_string(file_offset);
  } else {
    r.message = describe(r) + " failed at offset " + std::to_string(file_offset) + ": " + std::strerror(err);
  }
}

void RateLimit::pass(size_t nbytes) {
  using clock = std::chrono::steady_clock;
  clock::time_point until;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // at most a year a block: a tiny rate must not overflow the clock's integer ticks into no wait at all
    const double seconds = std::min(static_cast<double>(nbytes) / bytes_per_s_, 365.0 * 24 * 3600);
    const auto span = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
    next_free_ = std::max(clock::now(), next_free_) + span;
    until = next_free_;
  }
  std::this_thread::sleep_until(until);
}

void finish_block(const Block& b) {
  if (b.req->limit != nullptr && b.len > 0 && !b.req->failed.load()) b.req->limit->pass(b.len);
  if (b.req->blocks_left.fetch_sub(1) == 1) complete_request(*b.req);
}

void run_block_sync(const Block& b) {
  Request& r = *b.req;
  if (r.failed.load()) return;
  char* buf = r.buf + b.begin;
  const int64_t base = r.offset + static_cast<int64_t>(b.begin);
  size_t done = 0;
  while (done < b.len) {
    const ssize_t n = (r.op == Op::kRead) ? ::pread(b.fd, buf + done, b.len - done, base + done)
                                          : ::pwrite(b.fd, buf + done, b.len - done, base + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_block(b, errno, base + static_cast<int64_t>(done), false, 0);
      return;
    }
    if (n == 0) {
      if (r.op == Op::kRead) fail_block(b, EIO, base + static_cast<int64_t>(done), true, done);
      else fail_block(b, EIO, base + static_cast<int64_t>(done), false, 0);
      return;
    }
    done += static_cast<size_t>(n);
  }
}

std::unique_ptr<Backend> make_thread_backend(int num_threads) {
  return std::make_unique<ThreadBackend>(num_threads);
}

// ---------------------------------------------------------------- engine
Engine::Engine(size_t block_size, unsigned queue_depth, int num_threads, bool direct, const std::string& backend,
               double bytes_per_s)
    : block_size_(block_size), queue_depth_(queue_depth), num_threads_(num_threads), direct_(direct),
      bytes_per_s_(bytes_per_s) {
  if (!(bytes_per_s >= 0.0) || std::isinf(bytes_per_s))
    throw std::invalid_argument("bytes_per_s must be a finite number >= 0 (0: no cap), got " +
                                std::to_string(bytes_per_s));
  if (bytes_per_s > 0.0) limit_ = std::make_unique<RateLimit>(bytes_per_s);
  if (block_size == 0 || block_size % kDirectAlignBytes != 0)
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes, got " +
                                std::to_string(block_size));
  if (queue_depth == 0) throw std::invalid_argument("queue_depth must be >= 1");
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  if (backend == "io_uring" || backend == "auto") backend_ = make_uring_backend(queue_depth);
  if (!backend_ && backend == "io_uring")
    throw std::runtime_error("io_uring is not available on this kernel (io_uring_setup failed)");
  if (!backend_ && backend != "threads" && backend != "auto")
    throw std::invalid_argument("backend must be 'auto', 'io_uring' or 'threads', got '" + backend + "'");
  if (!backend_) backend_ = make_thread_backend(num_threads);
}

Engine::~Engine() { close(); }

void Engine::close() {
  if (!backend_) return;
  wait_all();
  backend_.reset();
}

int64_t Engine::submit(Op op, uintptr_t addr, size_t nbytes, const std::string& path, int64_t offset) {
  if (!backend_) throw std::runtime_error("AsyncIO engine is closed");
  if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
  auto req = std::make_shared<Request>();
  req->op = op;
  req->path = path;
  req->buf = reinterpret_cast<char*>(addr);
  req->nbytes = nbytes;
  req->offset = offset;
  req->limit = limit_.get();

  int open_err = 0;
  if (op == Op::kWrite) {
    // Whether this request creates the file (O_EXCL), so that a failure removes it and nothing else; the opens
    // below find it. Not with O_DIRECT: a file system without it may create the file and still refuse the open.
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      req->created = true;
      ::close(fd);
    } else if (errno != EEXIST) {
      open_err = errno;
    }
  }
  const int flags = (op == Op::kRead) ? O_RDONLY : O_WRONLY;
  const bool aligned = addr % kDirectAlignBytes == 0 && static_cast<size_t>(offset) % kDirectAlignBytes == 0;
  const size_t body = (direct_ && aligned) ? nbytes / kDirectAlignBytes * kDirectAlignBytes : 0;
  if (!open_err && body > 0) {
    req->fd_direct = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
    if (req->fd_direct < 0 && errno != EINVAL) open_err = errno;
  }
  req->direct = req->fd_direct >= 0;
  const size_t direct_bytes = req->direct ? body : 0;
  if (!open_err && (direct_bytes < nbytes || nbytes == 0)) {
    req->fd_buffered = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    if (req->fd_buffered < 0) open_err = errno;
  }
  last_direct_.store(req->direct);

  std::vector<Block> blocks;
  if (!open_err) {
    for (size_t pos = 0; pos < direct_bytes; pos += block_size_)
      blocks.push_back({req, req->fd_direct, pos, std::min(block_size_, direct_bytes - pos)});
    for (size_t pos = direct_bytes; pos < nbytes; pos += block_size_)
      blocks.push_back({req, req->fd_buffered, pos, std::min(block_size_, nbytes - pos)});
  }
  int64_t handle;
  {
    std::lock_guard<std::mutex> lk(mu_);
    handle = next_handle_++;
    pending_.emplace(handle, req);
  }
  if (open_err) {
    // The open itself failed (e.g. missing directory): nothing was written; a file this request created (empty)
    // is removed, any other left alone.
    req->blocks_left.store(1);
    Block b{req, -1, 0, 0};
    fail_block(b, open_err, offset, false, 0);
    req->message = "cannot open '" + path + "' for " + (op == Op::kRead ? "reading" : "writing") +
                   " (request at offset " + std::to_string(offset) + "): " + std::strerror(open_err);
    finish_block(b);
  } else if (blocks.empty()) {
    req->blocks_left.store(1);
    finish_block(Block{req, -1, 0, 0});
  } else {
    req->blocks_left.store(blocks.size());
    backend_->enqueue(std::move(blocks));
  }
  return handle;
}

std::shared_ptr<Request> Engine::find(int64_t handle, bool erase) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pending_.find(handle);
  if (it == pending_.end())
    throw std::invalid_argument("unknown or already waited AsyncIO handle " + std::to_string(handle));
  std::shared_ptr<Request> req = it->second;
  if (erase) pending_.erase(it);
  return req;
}

WaitResult Engine::wait(int64_t handle) {
  std::shared_ptr<Request> req = find(handle, /*erase=*/true);
  std::unique_lock<std::mutex> lk(req->mu);
  req->cv.wait(lk, [&] { return req->done; });
  WaitResult w;
  w.path = req->path;
  if (req->failed.load()) {
    w.err = req->err;
    w.short_read = req->short_read;
    w.err_offset = req->err_offset;
    w.message = req->message;
    w.unlinked = req->unlinked;
    w.nbytes = 0;
  } else {
    w.nbytes = req->nbytes;
  }
  return w;
}

bool Engine::done(int64_t handle) {
  std::shared_ptr<Request> req = find(handle, /*erase=*/false);
  std::lock_guard<std::mutex> lk(req->mu);
  return req->done;
}

std::vector<std::pair<int64_t, WaitResult>> Engine::wait_all() {
  std::vector<int64_t> handles;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& kv : pending_) handles.push_back(kv.first);
  }
  std::vector<std::pair<int64_t, WaitResult>> failures;
  for (int64_t h : handles) {
    try {
      WaitResult w = wait(h);
      if (w.err) failures.emplace_back(h, std::move(w));
    } catch (const std::invalid_argument&) {
      // waited concurrently by another thread
    }
  }
  return failures;
}

size_t Engine::num_pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_.size();
}

}  // namespace zinf::aio
