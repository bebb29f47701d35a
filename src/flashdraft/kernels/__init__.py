"""How the arithmetic runs: the CPU's hand-written C++ operators and how they are built, the quantized linear
layers, the attention for short queries, and the compiled graphs (`--compile`) with the GEMM micro-kernels they use.
Nothing outside this package tests a CPU feature."""
