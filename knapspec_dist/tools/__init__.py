"""Tools that measure the engine: benchmarks (bench/), the GPU check (gpucheck/), the corpus,
the Ray overhead run."""
