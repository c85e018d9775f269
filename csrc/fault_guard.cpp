#include "fault_guard.hpp"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include <cstring>
#include <mutex>

namespace flashpoint {
namespace {

// What the handler needs of the thread it interrupts; lives on that thread's stack for the call.
struct Guard {
  sigjmp_buf resume;
  uintptr_t begin;
  uintptr_t end;
  volatile sig_atomic_t active;
};

// The guard of the current thread, found through a pthread key: unlike C++ thread_local in a
// shared library, pthread_getspecific never allocates, so the handler may call it.
pthread_key_t guard_key;
std::once_flag key_once;

std::mutex install_mutex;
struct sigaction previous_action;  // what SIGBUS did before ours; written under install_mutex

void on_sigbus(int sig, siginfo_t* info, void* context) {
  auto* guard = static_cast<Guard*>(pthread_getspecific(guard_key));
  // si_code > 0: raised by the kernel for a fault, so si_addr is the address touched.
  if (guard != nullptr && guard->active && info != nullptr && info->si_code > 0) {
    const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
    if (address >= guard->begin && address < guard->end) {
      guard->active = 0;
      siglongjmp(guard->resume, 1);
    }
  }
  // Not ours. A fault goes back to SIGBUS's previous owner: its action is restored, and the
  // fault happens again when this handler returns (the instruction is retried) and reaches that
  // owner with its own context. A SIGBUS sent with kill() or raise() is not retried: it ends the
  // process by the default action (or stays ignored if it was). It is not handed to a previous
  // handler: one that hands signals back to the handler it replaced, as Python's faulthandler
  // does once it has printed its traceback, would hand it back to us, and so on forever.
  if (info != nullptr && info->si_code > 0) {
    sigaction(SIGBUS, &previous_action, nullptr);
    return;
  }
  if ((previous_action.sa_flags & SA_SIGINFO) == 0 && previous_action.sa_handler == SIG_IGN) return;
  signal(SIGBUS, SIG_DFL);
  raise(sig);
  (void)context;
}

bool handler_is_ours(const struct sigaction& action) {
  return (action.sa_flags & SA_SIGINFO) != 0 && action.sa_sigaction == on_sigbus;
}

}  // namespace

void install_fault_guard() {
  std::call_once(key_once, [] { pthread_key_create(&guard_key, nullptr); });
  std::lock_guard<std::mutex> lock(install_mutex);
  struct sigaction current;
  if (sigaction(SIGBUS, nullptr, &current) != 0 || handler_is_ours(current)) return;
  previous_action = current;
  struct sigaction ours;
  std::memset(&ours, 0, sizeof ours);
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGBUS, &ours, nullptr);
}

bool run_guarded(const void* begin, size_t n, void (*fn)(void*), void* arg) {
  Guard guard;
  guard.begin = reinterpret_cast<uintptr_t>(begin);
  guard.end = guard.begin + n;
  guard.active = 0;
  void* outer = pthread_getspecific(guard_key);
  pthread_setspecific(guard_key, &guard);
  // savemask=1: the jump out of the handler also unblocks SIGBUS again for this thread.
  if (sigsetjmp(guard.resume, 1) != 0) {
    pthread_setspecific(guard_key, outer);
    return false;
  }
  guard.active = 1;
  fn(arg);
  guard.active = 0;
  pthread_setspecific(guard_key, outer);
  return true;
}

}  // namespace flashpoint
