"""The in-process engine (no Ray): rows and their cache slots, the model runner (cache, CUDA
graphs), continuous batching, sampling, and the strategy interface a round runs through."""
