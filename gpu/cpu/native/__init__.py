"""Small C kernels for the CPU path, compiled on first use with the machine's C compiler and loaded with
ctypes. Optional by design: without a compiler (or if a build fails) the portable torch path runs."""
