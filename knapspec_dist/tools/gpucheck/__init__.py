"""``knapspec gpu-check``: one command that measures what the GPU path depends on.

Decode steps against the memory bound, verify(q) / decode, draft time against the bytes a
skip set saves and graph capture cost, on random-weight Llama shapes built on the device
(shapes.py, measure.py); greedy identity / near-tie checks and a sampling run per strategy
(correct.py), rejection sampling against the coupling and the bf16 spread by batch size
(bf16.py), and SmolLM2 on long documents and in continuous batching when installed
(correct.py, batched.py); last, the riskiest: the attention backend A/B and per-sublayer
draft graphs (late.py). Everything runs under one time budget (budget.py), row by row, each
row isolated from the others' failures (rows.py), and lands in DIR/gpu-check.json (after
every row) and .md (report.py). ``--device cpu --quick`` runs the same program on tiny
shapes, for CI.
"""
