"""The device kernels, together: each applied to a loaded model from outside (model/weights.py
calls them after loading), so the decoder itself stays plain torch.

- ``csrc/``: our CPU kernels' C sources, each written once against ``vec.h``'s vector type;
  ``build.py`` builds them for the machine's vector unit (AVX-512, AVX2, NEON or generic).
- ``paged_attention.py``: attention over the paged cache on a CPU (``paged_attention.c``).
- ``elementwise.py``: RMSNorm, rotary and ``silu * up`` in one pass each (``elementwise.c``).
- ``packed_linear.py``: a CPU model's products through oneDNN over weights packed at load.
- ``cuda.py``: on CUDA, the half-precision head's product through cuBLAS' fp32 output.
"""
