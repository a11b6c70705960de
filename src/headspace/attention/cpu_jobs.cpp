// Background jobs of the CPU decode kernel, for the hybrid tier.
//
// A job is handed to one native thread and the caller returns at once. The thread waits
// until the job's flag (an int64 in host memory) reaches the job's value, which whoever
// produces the query writes after it (a GPU stream copies the query to host memory, then
// the flag), runs the kernel, and marks the job done; `hs_runner_wait` blocks until then.
// Neither the waiting nor the computing holds Python's GIL, so the thread that drives the
// GPU goes on launching work while the CPU attends, and the CPU starts the moment the
// query lands rather than when the interpreter lets a Python thread run.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" int hs_paged_decode(const float* q, const void* k, const void* v, int kv_dtype,
                               int64_t head_stride, const int32_t* tables,
                               int64_t table_stride, const int32_t* starts,
                               const int32_t* ends, int num_seqs, int num_kv_heads, int group,
                               int dim, int page_size, float scale, int block_tokens,
                               int num_threads, int allow_avx512, float* out, float* lse,
                               float* probs, int64_t probs_stride);

namespace {

struct Job {
  int64_t ticket;
  const int64_t* flag;
  int64_t value;
  const float* q;
  const void* k;
  const void* v;
  int kv_dtype;
  int64_t head_stride;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* ends;
  int num_seqs, num_kv_heads, group, dim, page_size;
  float scale;
  int block_tokens, num_threads;
  float* out;
  float* lse;
};

class Runner {
 public:
  Runner() : thread_([this] { loop(); }) {}

  int64_t submit(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job.ticket = next_ticket_++;
      queue_.push_back(job);
    }
    wake_.notify_one();
    return job.ticket;
  }

  // The job's status once done, or -1 if it is not done within `timeout_ms` (the caller
  // checks for errors and waits again); -2 for a ticket that was never queued or already
  // waited for.
  int wait(int64_t ticket, int timeout_ms) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (ticket < 0 || ticket >= next_ticket_) return -2;
    const auto done = [&] { return num_done_ > ticket; };
    if (!finished_.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) return -1;
    const auto found = statuses_.find(ticket);
    if (found == statuses_.end()) return -2;
    const int status = found->second;
    statuses_.erase(found);
    return status;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);  // the loop cannot miss the wake-up
      stopping_.store(true);
    }
    wake_.notify_all();
    thread_.join();
  }

 private:
  // Spin briefly, then yield, then sleep: the query lands within a layer's GPU work (a few
  // ms at most), but a GPU that faulted never writes the flag.
  bool wait_flag(const int64_t* flag, int64_t value) {
    for (int64_t spin = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < value; ++spin) {
      if (stopping_.load(std::memory_order_relaxed)) return false;
#if defined(__x86_64__)
      if (spin < 2048) {
        _mm_pause();
        continue;
      }
#endif
      if (spin < 20000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_.load() || !queue_.empty(); });
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      int status = 2;  // the flag never came (stopped)
      if (wait_flag(job.flag, job.value))
        status = hs_paged_decode(job.q, job.k, job.v, job.kv_dtype, job.head_stride,
                                 job.tables, job.table_stride, nullptr, job.ends, job.num_seqs,
                                 job.num_kv_heads, job.group, job.dim, job.page_size,
                                 job.scale, job.block_tokens, job.num_threads, 1, job.out,
                                 job.lse, nullptr, 0);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        statuses_[job.ticket] = status;
        num_done_ = job.ticket + 1;  // one thread, jobs in order
      }
      finished_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::deque<Job> queue_;
  std::unordered_map<int64_t, int> statuses_;
  int64_t next_ticket_ = 0, num_done_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace

extern "C" {

void* hs_runner_new() { return new Runner(); }

void hs_runner_free(void* runner) {
  auto* r = static_cast<Runner*>(runner);
  r->stop();
  delete r;
}

// Queue the kernel over `ends[s]` tokens of each sequence (arguments as hs_paged_decode's),
// to run once *flag >= value. Returns the job's ticket for hs_runner_wait.
int64_t hs_runner_submit(void* runner, const int64_t* flag, int64_t value, const float* q,
                         const void* k, const void* v, int kv_dtype, int64_t head_stride,
                         const int32_t* tables, int64_t table_stride, const int32_t* ends,
                         int num_seqs, int num_kv_heads, int group, int dim, int page_size,
                         float scale, int block_tokens, int num_threads, float* out,
                         float* lse) {
  Job job{0,       flag,       value, q,      k,         v,           kv_dtype,
          head_stride, tables, table_stride, ends, num_seqs, num_kv_heads, group,
          dim,     page_size,  scale, block_tokens, num_threads, out, lse};
  return static_cast<Runner*>(runner)->submit(job);
}

// Wait up to `timeout_ms` for job `ticket`: the kernel's status (0 ok, 1 shapes refused,
// 2 stopped), -1 not done yet, -2 no such job.
int hs_runner_wait(void* runner, int64_t ticket, int timeout_ms) {
  return static_cast<Runner*>(runner)->wait(ticket, timeout_ms);
}

}  // extern "C"
