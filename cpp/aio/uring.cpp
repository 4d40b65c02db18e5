// io_uring backend through raw syscalls (no liburing build dependency). One ring per engine,
// driven by one thread that keeps up to queue_depth block transfers in flight, reaps
// completions and resubmits the remainder of partial transfers.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "aio.h"

namespace zinf::aio {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

struct InFlight {
  Block block;
  size_t done = 0;  // bytes of the block already transferred
  iovec iov{};
};

class UringBackend final : public Backend {
 public:
  static std::unique_ptr<UringBackend> create(unsigned queue_depth) {
    auto b = std::unique_ptr<UringBackend>(new UringBackend());
    if (!b->init(queue_depth)) return nullptr;
    b->thread_ = std::thread([p = b.get()] { p->loop(); });
    return b;
  }
  ~UringBackend() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (sqes_) ::munmap(sqes_, sqes_bytes_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) ::munmap(cq_ptr_, cq_bytes_);
    if (sq_ptr_) ::munmap(sq_ptr_, sq_bytes_);
    if (ring_fd_ >= 0) ::close(ring_fd_);
  }
  void enqueue(std::vector<Block> blocks) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& b : blocks) queue_.push_back(std::move(b));
    }
    cv_.notify_all();
  }
  std::string name() const override { return "io_uring"; }

 private:
  UringBackend() = default;

  bool init(unsigned queue_depth) {
    io_uring_params p{};
    ring_fd_ = sys_setup(queue_depth, &p);
    if (ring_fd_ < 0) return false;
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ptr_ = ::mmap(nullptr, sq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) { sq_ptr_ = nullptr; return false; }
    cq_ptr_ = single ? sq_ptr_
                     : ::mmap(nullptr, cq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                              IORING_OFF_CQ_RING);
    if (cq_ptr_ == MAP_FAILED) { cq_ptr_ = nullptr; return false; }
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(
        ::mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_, IORING_OFF_SQES));
    if (sqes_ == MAP_FAILED) { sqes_ = nullptr; return false; }
    auto* sq = static_cast<char*>(sq_ptr_);
    auto* cq = static_cast<char*>(cq_ptr_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    capacity_ = std::min(queue_depth, p.sq_entries);
    return true;
  }

  void prep(InFlight* f) {
    Request& r = *f->block.req;
    const unsigned tail = *sq_tail_;  // only this thread writes the tail
    const unsigned idx = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    f->iov.iov_base = r.buf + f->block.begin + f->done;
    f->iov.iov_len = f->block.len - f->done;
    sqe->opcode = r.op == Op::kRead ? IORING_OP_READV : IORING_OP_WRITEV;
    sqe->fd = f->block.fd;
    sqe->addr = reinterpret_cast<uint64_t>(&f->iov);
    sqe->len = 1;
    sqe->off = static_cast<uint64_t>(r.offset + f->block.begin + f->done);
    sqe->user_data = reinterpret_cast<uint64_t>(f);
    sq_array_[idx] = idx;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++to_submit_;
    ++in_flight_;
  }

  void complete(InFlight* f, int res) {
    Request& r = *f->block.req;
    const int64_t at = r.offset + static_cast<int64_t>(f->block.begin + f->done);
    bool finished = true;
    if (res == -EINTR || res == -EAGAIN) {
      finished = false;
    } else if (res < 0) {
      fail_block(f->block, -res, at, false, 0);
    } else if (res == 0) {
      fail_block(f->block, EIO, at, r.op == Op::kRead, f->done);
    } else {
      f->done += static_cast<size_t>(res);
      finished = f->done >= f->block.len;
    }
    if (finished) {
      finish_block(f->block);
      delete f;
    } else {
      retry_.push_back(f);
    }
  }

  void loop() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (in_flight_ == 0 && retry_.empty())
          cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty() && in_flight_ == 0 && retry_.empty()) return;
        while (in_flight_ < capacity_ && !retry_.empty()) {
          prep(retry_.back());
          retry_.pop_back();
        }
        while (in_flight_ < capacity_ && !queue_.empty()) {
          Block b = std::move(queue_.front());
          queue_.pop_front();
          if (b.req->failed.load()) {  // skip the rest of a failed request
            finish_block(b);
            continue;
          }
          prep(new InFlight{std::move(b), 0, {}});
        }
      }
      if (in_flight_ == 0) continue;
      int rc = sys_enter(ring_fd_, to_submit_, 1, IORING_ENTER_GETEVENTS);
      if (rc < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        rc = -errno;  // ring broken: fail what is in flight by draining with the error
      }
      if (rc >= 0) to_submit_ -= std::min<unsigned>(to_submit_, static_cast<unsigned>(rc));
      unsigned head = *cq_head_;
      const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      while (head != tail) {
        const io_uring_cqe& cqe = cqes_[head & cq_mask_];
        auto* f = reinterpret_cast<InFlight*>(cqe.user_data);
        const int res = cqe.res;
        ++head;
        --in_flight_;
        complete(f, res);
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    }
  }

  int ring_fd_ = -1;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned capacity_ = 0;
  unsigned in_flight_ = 0;
  unsigned to_submit_ = 0;
  std::vector<InFlight*> retry_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth) {
  if (const char* env = std::getenv("ZINF_AIO_BACKEND"); env && std::string(env) == "threads") return nullptr;
  return UringBackend::create(queue_depth);
}

bool uring_available() {
  io_uring_params p{};
  const int fd = sys_setup(1, &p);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace zinf::aio
