"""The peer's half of ``knapspec peer``: vLLM generates the same prompt token ids, run by the
Python of vLLM's own venv (``make vllm-venv``), so it imports vLLM and the standard library
only, never this package.

    <vllm venv>/bin/python vllm_side.py request.json result.json

``request.json``: model folder, dtype, threads, window, rows at once, new tokens, vLLM's n-gram
speculation (``ngram``: [K drafted tokens, N the longest n-gram], or none), and the prompts as
token ids (the engine's own prompt builder made them, so both engines read the same
tokens). Its environment (the caller's, compare.py ``vllm_env``) binds vLLM's threads, since
vLLM reads it at import. Timed, in one process: the start-up (``LLM(...)``: load, compile, KV
allocation), then a run with one new token per row (prefill alone), then the full run, driven
step by step as ``LLM.generate`` drives it but with each step's new tokens seen, so that its
decode window (from the step after which every row has its first token to the end) is timed
alone. ``result.json``: the seconds of each, the window's seconds and tokens, every row's
generated token ids and the versions.
"""

import json
import os
import sys
import time

import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        req = json.load(f)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[req["dtype"]]
    start = time.perf_counter()
    ngram = req.get("ngram")  # [K, N]: vLLM's own copied drafts (n-gram prompt lookup)
    spec = None if not ngram else {"method": "ngram", "num_speculative_tokens": int(ngram[0]),
                                   "prompt_lookup_max": int(ngram[1]), "prompt_lookup_min": 1}
    llm = LLM(model=req["model"], tokenizer=req["model"], dtype=dtype,
              max_model_len=int(req["max_model_len"]), max_num_seqs=int(req["max_num_seqs"]),
              seed=0, generation_config="vllm", enable_prefix_caching=False,
              speculative_config=spec)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]

    def timed(new_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    def streamed(new_tokens: int):
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=False,
                                output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):  # outputs name a request by the id given here
            engine.add_request(str(i), p, params)
        tokens = [[] for _ in prompts]
        opened = None  # (time, tokens so far) once every row has its first token
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[int(out.request_id)].extend(out.outputs[0].token_ids)
            if opened is None and all(tokens):
                opened = (time.perf_counter(), sum(map(len, tokens)))
        end = time.perf_counter()
        generated = sum(map(len, tokens))
        opened = opened or (end, generated)
        return end - t0, tokens, end - opened[0], generated - opened[1]

    prefill_s, _ = timed(1)
    full_s, tokens, decode_s, decoded = streamed(int(req["new_tokens"]))
    with open(result_path, "w") as f:
        json.dump({"startup_s": startup, "prefill_s": prefill_s, "full_s": full_s,
                   "decode_window_s": decode_s, "decode_window_tokens": decoded,
                   "tokens": tokens, "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                   "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
