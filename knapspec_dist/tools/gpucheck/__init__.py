"""``knapspec gpu-check``: one command that measures what the GPU path depends on.

Decode steps against the memory bound, verify(q) / decode, draft time against the bytes a
skip set saves, the attention backend A/B and graph capture cost, on random-weight Llama
shapes built on the device (shapes.py, measure.py); greedy identity / near-tie checks and a
sampling run per strategy, and SmolLM2 on long documents when installed (correct.py).
Everything runs under one time budget (budget.py) and lands in DIR/gpu-check.json and .md
(report.py). ``--device cpu --quick`` runs the same program on tiny shapes, for CI.
"""
