"""``knapspec bench``: every strategy on the same long-document prompts, side by side.

    knapspec bench --model smollm2 --contexts 1024,2048,4096,8192 \\
        --strategies ar,clasp,knapspec,knapspec:coupled,knapspec:alpha,knapspec:once \\
        --new-tokens 128 --prompts 2 --out bench/

One process, one model; for each context length and each prompt every strategy runs in turn
(the order rotates from prompt to prompt, so a drifting machine does not favour one strategy).
Greedy decoding throughout: every strategy must emit exactly ``ar``'s tokens. Every token is
compared, and each divergence classified by the full model's logit gap
(:mod:`knapspec_dist.tools.ties`, ``check_run``: after a near-tie the strategy runs again from
``ar``'s token, untimed, and the comparison goes on): a near-tie (bf16 kernels flipping an
argmax between two nearly equal logits) is reported and recorded with its margin; anything
else, and any mismatch in fp32 on a CPU, is a BUG (reported, recorded in the results, exit
status 1). The report gives near-ties per 1,000 tokens and the bound's false-acceptance rate.
``ar`` is always run, as the reference, even when not listed.

Strategy specs (comma-separated in ``--strategies``):

* a name from :data:`knapspec_dist.speculation.options.NAMES` (``static`` needs a skip list);
* ``knapspec:FLAG[+FLAG...]`` (also ``clasp:``) with the ablation flags ``coupled``
  (attention and MLP of a layer skipped together), ``alpha`` (maximize acceptance instead of
  TPT) and ``once`` (select after prefill only);
* ``static:a3,m5@4``: the draft skips attention of layer 3 and MLP of layer 5 (0-based), draft
  length 4 (``+`` may replace the commas inside the skip list); ``clasp@4`` sets clasp's gamma.

Prompts: document ``j`` (0-based, ``--prompts K`` of them) starts at a chapter of book
``AUSTEN_BOOKS[j % 6]`` of the corpus (:func:`knapspec_dist.tools.corpus.document_of_tokens`) and is
cut to the context length, so every context uses the same K documents, longer or shorter.
With a chat template (SmolLM2) the document is wrapped as a user message asking for a summary
(``--prompt-style summarize``, the default), and the whole prompt has the context's length; a
model without a tokenizer (the random test checkpoints) gets the documents' UTF-8 bytes as
token ids (modulo its vocabulary). A context that leaves no room for ``--new-tokens`` in the
model's window is shortened to fit (logged; the JSON keeps the real prompt length).

Every run emits ``--new-tokens`` tokens (EOS does not stop it unless ``--stop-at-eos``), so
rates compare like with like. Outputs in ``--out``: ``results.json`` (every run: strategy,
context, prompt, stats), ``results.md`` (a table per context, and the top plans of each
strategy whose selection priced them), ``speedup.png`` and
``skipped.png``. Rates are given end to end (prefill included: ``stats.tokens_per_s``) and for
decoding only (tokens after the first / seconds after prefill); all strategies share the same
prefill, so the decode rate is where strategies differ.
"""
