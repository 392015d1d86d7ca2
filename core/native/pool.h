/*
 * A small thread pool for mlxchat's CPU kernels, as a header so that every kernel splits its work the same
 * way.
 *
 * run(n, task, ctx) runs task(ctx, 0..n-1) on the calling thread and (threads - 1) workers. A job is claimed
 * task by task with a compare-and-swap on one word holding (job number, next task), so a worker that wakes
 * late can never run a task of a job it did not read; jobs alternate between two slots for the same reason.
 * Workers spin a short while after a job (`spin`: a decode step issues one every few tens of microseconds),
 * then sleep on a futex. One job at a time: a second caller that finds the pool busy runs its tasks itself.
 * mlxchat._quantized and mlxchat._kernels each hold one.
 */
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mlxchat_pool {

/* The cores this process may run on. */
inline int cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

class Pool {
 public:
  using Task = void (*)(const void* ctx, int index);

  Pool(int threads, std::chrono::microseconds spin) : spin_(spin) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Pool() {
    stop_.store(true);
    posted_.fetch_add(1, std::memory_order_release);
    posted_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int threads() const {
    return int(workers_.size()) + 1;
  }

  /* `linger`: whether workers spin for the next job afterwards (not when the caller runs sgemm next, whose
   * own threads need the cores). */
  void run(int tasks, Task task, const void* ctx, bool linger = true) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (workers_.empty() || tasks <= 1 || !lock.owns_lock()) {
      for (int i = 0; i < tasks; ++i) task(ctx, i);
      return;
    }
    const uint32_t job = ++job_;
    Slot& slot = slots_[job & 1];
    slot.task.store(task, std::memory_order_relaxed);
    slot.ctx.store(ctx, std::memory_order_relaxed);
    slot.tasks.store(tasks, std::memory_order_relaxed);
    slot.done.store(0, std::memory_order_relaxed);
    linger_.store(linger, std::memory_order_relaxed);
    claim_.store(uint64_t(job) << 32, std::memory_order_release);
    posted_.fetch_add(1, std::memory_order_release);
    posted_.notify_all();
    help(job);
    while (slot.done.load(std::memory_order_acquire) < tasks) pause();
  }

 private:
  struct Slot {
    std::atomic<Task> task{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int> tasks{0};
    std::atomic<int> done{0};
  };

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  /* Claims and runs tasks of `job` until none is left (or a newer job was posted). */
  void help(uint32_t job) {
    Slot& slot = slots_[job & 1];
    uint64_t word = claim_.load(std::memory_order_acquire);
    while (true) {
      if (uint32_t(word >> 32) != job) return;
      const Task task = slot.task.load(std::memory_order_relaxed);
      const void* ctx = slot.ctx.load(std::memory_order_relaxed);
      const int tasks = slot.tasks.load(std::memory_order_relaxed);
      const int index = int(word & 0xffffffffu);
      if (index >= tasks) return;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) {
        task(ctx, index);
        slot.done.fetch_add(1, std::memory_order_release);
        word = claim_.load(std::memory_order_acquire);
      }
    }
  }

  void work() {
    uint32_t seen = posted_.load(std::memory_order_acquire);
    while (true) {
      uint32_t now = posted_.load(std::memory_order_acquire);
      const auto patience = linger_.load(std::memory_order_relaxed) ? spin_ : std::chrono::microseconds(0);
      const auto until = std::chrono::steady_clock::now() + patience;
      for (int i = 1; now == seen; ++i) {
        pause();
        now = posted_.load(std::memory_order_acquire);
        if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      if (now == seen) {
        posted_.wait(seen, std::memory_order_acquire);
        continue;
      }
      seen = now;
      if (stop_.load()) return;
      help(uint32_t(claim_.load(std::memory_order_acquire) >> 32));
    }
  }

  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  Slot slots_[2];
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint32_t> posted_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> linger_{true};
  std::mutex busy_;
  uint32_t job_ = 0;  // guarded by busy_
};

}  // namespace mlxchat_pool
