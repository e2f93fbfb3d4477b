// The decoder's threads: a fixed set of workers that share one loop at a time with the calling
// thread. run(tasks, fn) calls fn(task, thread) for every task in [0, tasks) and returns when all
// have returned; `thread` in [0, threads()) names the thread running the task (0 = the caller), so
// that a task can use that thread's scratch.
//
// Which thread runs which task is not fixed (an atomic counter hands tasks out, so a preempted
// thread delays nobody), so callers make a task's result independent of its thread: the decoder
// splits products by rows of W and attention by KV heads, each computed exactly as on one thread.
//
// Workers sleep in std::atomic::wait between loops (a futex on Linux, after a short spin). One
// loop at a time: run() must not be called from inside a task or from two threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace kvevict::model {

class ThreadPool {
 public:
  /// `threads` >= 1 threads in all: the caller and threads - 1 workers.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  [[nodiscard]] int threads() const { return static_cast<int>(workers_.size()) + 1; }

  /// fn(task, thread) for every task in [0, tasks). The first exception a task throws is rethrown
  /// here once every task has finished.
  template <class Fn>
  void run(int tasks, Fn&& fn) {
    if (tasks <= 0) return;
    if (workers_.empty() || tasks == 1) {
      for (int task = 0; task < tasks; ++task) fn(task, 0);
      return;
    }
    run_erased(tasks, const_cast<void*>(static_cast<const void*>(&fn)),
               [](void* context, int task, int thread) {
                 (*static_cast<std::remove_reference_t<Fn>*>(context))(task, thread);
               });
  }

 private:
  using Call = void (*)(void* context, int task, int thread);
  void run_erased(int tasks, void* context, Call call);
  void drain(int thread);
  void work(int thread);

  std::vector<std::thread> workers_;
  // The loop being run: written by run_erased() before generation_ is incremented (release),
  // read by the workers after they see the new generation (acquire).
  int tasks_ = 0;
  void* context_ = nullptr;
  Call call_ = nullptr;
  std::atomic<int> next_task_{0};
  std::atomic<int> finished_workers_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

/// [begin, end) of part `part` of `count` items cut into `parts` nearly equal contiguous parts.
struct Range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
[[nodiscard]] inline Range part_of(std::int64_t count, int parts, int part) {
  return {count * part / parts, count * (part + 1) / parts};
}

}  // namespace kvevict::model
