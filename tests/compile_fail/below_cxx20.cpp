// Below C++20, including mrr stops at one sentence (a PyTorch extension builder compiles C++14 or
// C++17 unless told otherwise), not the hundreds of errors a C++20 library would cascade into.
#include <mrr/mrr.hpp>
int main() { return 0; }
