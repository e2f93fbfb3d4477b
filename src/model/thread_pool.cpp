#include "thread_pool.hpp"

#include <string>

#include "kvevict/error.hpp"

namespace kvevict::model {

ThreadPool::ThreadPool(int threads) {
  KVEVICT_REQUIRE(threads >= 1 && threads <= 1024,
                  "threads must be in [1, 1024], got " + std::to_string(threads));
  workers_.reserve(static_cast<std::size_t>(threads - 1));
  for (int thread = 1; thread < threads; ++thread)
    workers_.emplace_back([this, thread] { work(thread); });
}

ThreadPool::~ThreadPool() {
  stopping_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::drain(int thread) {
  for (int task = next_task_.fetch_add(1, std::memory_order_relaxed); task < tasks_;
       task = next_task_.fetch_add(1, std::memory_order_relaxed)) {
    try {
      call_(context_, task, thread);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::work(int thread) {
  std::uint64_t seen = 0;
  for (;;) {
    generation_.wait(seen, std::memory_order_acquire);
    seen = generation_.load(std::memory_order_acquire);
    if (stopping_.load(std::memory_order_relaxed)) return;
    drain(thread);
    const int finished = finished_workers_.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (finished == static_cast<int>(workers_.size())) finished_workers_.notify_one();
  }
}

void ThreadPool::run_erased(int tasks, void* context, Call call) {
  tasks_ = tasks;
  context_ = context;
  call_ = call;
  next_task_.store(0, std::memory_order_relaxed);
  finished_workers_.store(0, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  drain(0);
  const int workers = static_cast<int>(workers_.size());
  for (int finished = finished_workers_.load(std::memory_order_acquire); finished != workers;
       finished = finished_workers_.load(std::memory_order_acquire)) {
    finished_workers_.wait(finished, std::memory_order_acquire);
  }
  if (error_) {
    std::exception_ptr error;
    std::swap(error, error_);
    std::rethrow_exception(error);
  }
}

}  // namespace kvevict::model
