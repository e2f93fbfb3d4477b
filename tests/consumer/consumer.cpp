// Smoke test for the installed kvevict package (built by the kvevict.consumer.* ctest tests).
#include <cstdio>
#include <kvevict/kvevict.hpp>

int main() {
  std::puts("kvevict consumer OK");
  return 0;
}
