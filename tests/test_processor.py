"""The Ray Data processor (runtime/processor.py) on Datasets a user builds, chained with the
user's own ``map`` before and after; one local Ray, the embedded SmolLM2 with ``knapspec`` (its
rows checked against plain ``ar`` decoding) and with ``ar`` (trees)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.errors import UserError
from knapspec_dist.llm import generate_texts
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.runtime.processor import (
    ProcessorConfig,
    build_processor,
    stages,
    with_cores,
)
from knapspec_dist.speculation.options import StrategyOptions

pytestmark = pytest.mark.processes  # a local Ray and its actors

DOCS = ["The cat sat on the mat.", "Emma Woodhouse, handsome, clever, and rich.",
        "A single man in possession of a good fortune."]
PARQUET = 10  # the Parquet rows' ids: 10 + the document's index


@pytest.fixture(scope="module")
def local_ray():
    with pytest.MonkeyPatch.context() as env:
        # One actor reads the Parquet footers: Ray Data's default asks for 32, each a worker
        # process this 2-CPU Ray starts a few at a time, to read one small file's footer.
        env.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def test_processor_chains_with_the_users_maps_on_items_and_parquet(local_ray, smollm2, tmp_path):
    """Items (a user's ``map`` before) and a Parquet file through one processor execution, a
    user's ``map`` after. Knapspec is lossless: each row's tokens are those of plain ``ar``
    decoding, computed here in this process as a replica decodes (the same model, chat
    template, paged batch and threads)."""
    config = ProcessorConfig(model="smollm2", strategy="knapspec", max_num_seqs=4,
                             sampling={"max_new_tokens": 8}, should_continue_on_error=True)
    processor = build_processor(
        config,
        preprocess=lambda row: {**row, "messages": [{"role": "user", "content": row["text"]}]},
        postprocess=lambda row: {"id": row["id"], "summary": row["generated_text"],
                                 "tokens": row["generated_tokens"], "n": row["num_input_tokens"],
                                 "error": row["error"], "rounds": row["rounds"],
                                 "drafted": row["drafted"], "accepted": row["accepted"]})
    too_long = " ".join(["word"] * 9000)  # past the model's window: that row's error
    items = [{"id": i, "text": t} for i, t in enumerate(DOCS + [too_long])]
    before = ray.data.from_items(items).map(lambda r: {**r, "text": r["text"].upper()})
    pq.write_table(pa.table({"id": [PARQUET + i for i in range(3)],
                             "text": [d.upper() for d in DOCS]}), tmp_path / "docs.parquet")
    both = before.union(ray.data.read_parquet(str(tmp_path / "docs.parquet")))
    after = processor(both).map(
        lambda r: {**r, "source": "parquet" if r["id"] >= PARQUET else "items"})
    got = {r["id"]: r for r in after.take_all()}
    assert sorted(got) == [0, 1, 2, 3, PARQUET, PARQUET + 1, PARQUET + 2]
    assert [got[i]["source"] for i in sorted(got)] == ["items"] * 4 + ["parquet"] * 3
    assert got[3]["error"] and got[3]["summary"] is None
    prompts = [encode(smollm2.tokenizer, doc.upper(), chat=True) for doc in DOCS]
    threads = torch.get_num_threads()
    torch.set_num_threads(with_cores(config)[0].cpus_per_rank)  # a rank's threads
    try:
        want = generate_texts(smollm2, prompts, StrategyOptions(name="ar"),
                              config.generation_config(), max_num_seqs=config.max_num_seqs)
    finally:
        torch.set_num_threads(threads)
    for i in range(3):
        assert got[i]["error"] is None and list(got[i]["tokens"]) == want[i].token_ids
        assert got[i]["summary"] == want[i].text and got[i]["n"] == len(prompts[i])
        assert 0 <= got[i]["accepted"] <= got[i]["drafted"] and got[i]["rounds"] >= 1
        again = got[PARQUET + i]  # the same document from Parquet: the same row
        assert again["error"] is None and list(again["tokens"]) == want[i].token_ids
        assert again["summary"] == want[i].text and again["n"] == len(prompts[i])


def test_documents_past_the_window_are_summarized_through_trees(local_ray):
    """A document column, as the batch job's text mode: the long one through a tree of chunk
    summaries (the processor keeps no node table), the short one whole."""
    long_doc = " ".join(DOCS * 12)  # about 380 tokens: 4 chunks of a 256-token window
    config = ProcessorConfig(model="smollm2", strategy="ar", max_num_seqs=4, max_model_len=256,
                             document_column="text", sampling={"max_new_tokens": 8})
    got = {r["id"]: r for r in build_processor(config)(ray.data.from_items(
        [{"id": 0, "text": DOCS[0]}, {"id": 1, "text": long_doc}])).take_all()}
    assert got[0]["error"] is None and got[0]["document_path"] == "whole"
    assert got[0]["tree_generations"] is None
    tree = got[1]
    assert tree["error"] is None and tree["document_path"] == "tree"
    assert tree["tree_generations"] > tree["tree_chunks"] > 1 and tree["tree_depth"] >= 2
    assert tree["num_generated_tokens"] == tree["tree_generated_tokens"] > 8
    assert 0 < len(tree["generated_tokens"]) <= 8 and tree["generated_text"]
    assert "chunk_prompts" not in tree and "prompt_ids" not in tree
    with pytest.raises(UserError, match="long_documents"):
        ProcessorConfig(long_documents="tree")  # a tree needs a document column


def test_a_bad_model_fails_when_the_processor_is_built():
    with pytest.raises(UserError):
        build_processor(ProcessorConfig(model="/nonexistent/model", strategy="ar"))


def test_the_prefill_budget_is_part_of_the_rows_generation_config():
    config = ProcessorConfig(strategy="ar", max_num_batched_tokens=256,
                             sampling={"max_new_tokens": 16})
    assert config.generation_config() == GenerationConfig.of(max_new_tokens=16,
                                                             max_num_batched_tokens=256)
    with pytest.raises(UserError, match="--max-num-batched-tokens"):
        ProcessorConfig(strategy="ar", max_num_batched_tokens=0)


def test_an_unknown_sampling_key_is_named():
    with pytest.raises(UserError, match="unknown key.*'temprature'.*temperature"):
        ProcessorConfig(strategy="ar", sampling={"temprature": 0.5})


def test_the_ranks_share_the_clusters_cores_unless_told(local_ray):
    """Decided once for every replica (the fixture's Ray has 2 CPUs): threads on the ranks'
    share of every core less the tokenize stage's, a reservation that leaves the Dataset's
    own tasks a CPU (the maps around the stages above would wait forever without it); a
    number given is kept for both."""
    def cores(**options) -> tuple[int, float | None]:
        config, reserved = with_cores(ProcessorConfig(strategy="ar", **options))
        return config.cpus_per_rank, reserved

    assert cores() == (2, 1.0)
    assert cores(concurrency=(1, 2)) == (1, 0.5)  # the most replicas: 2 ranks
    assert cores(tokenizer_cpus=1) == (1, 0.01)  # Ray refuses an empty bundle
    assert cores(cpus_per_rank=2, concurrency=3) == (2, None)
    engine_stage = stages(ProcessorConfig(strategy="ar"))[-1]
    assert engine_stage.args[0].cpus_per_rank == 2 and engine_stage.args[1] == 1.0
