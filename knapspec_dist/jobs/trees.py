"""The output's node table (``DIR/nodes/``): every summary tree node kept as soon as it is
generated, and read back on a rerun so that no finished node is generated again.

It is also what a user reads to see how a book was summarized: one row per node with its
level, index, the nodes below it, its input digest and summary, under the pass that made it
(``rows``, or a baseline pass). A rerun reuses a node whose pass, configuration, document,
place and input digest match. The trees themselves run through the dispatcher as
runtime/tree_tasks.py says.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.engine.generation import (
    GenerationResult,
    GenerationStats,
    PlanTally,
    Split,
)
from knapspec_dist.jobs.output import NODES, OutputDir, PartWriter
from knapspec_dist.runtime.dispatch import Dispatcher
from knapspec_dist.runtime.prompts import PromptBuilder
from knapspec_dist.runtime.tree import DocumentTree, Node, StoredNode
from knapspec_dist.runtime.tree_tasks import TreeDispatch

log = logging.getLogger(__name__)


def node_schema(id_column: str, id_type: pa.DataType) -> pa.Schema:
    """One row per finished node. ``node`` (first: the part files' key) names it whole."""
    return pa.schema([
        pa.field("node", pa.string(), nullable=False), (id_column, id_type),
        ("pass", pa.string()),
        ("config", pa.string()),  # the job's configuration (its fingerprint's hash)
        ("level", pa.int32()), ("index", pa.int32()),
        ("children", pa.list_(pa.int32())),  # [first, end) of the level below; null: a chunk
        ("digest", pa.string()), ("generated_text", pa.string()),
        ("generated_tokens", pa.list_(pa.int32())), ("finish_reason", pa.string()),
        ("num_input_tokens", pa.int64()), ("num_generated_tokens", pa.int64()),
        ("time_taken_llm", pa.float64()), ("replica", pa.int32()),
        ("stats", pa.string()),  # the GenerationStats as JSON: the row's sums on resume
        ("error", pa.string()), ("finished_at", pa.timestamp("us", tz="UTC"))])


def node_key(pass_name: str, row_id, level: int, index: int) -> str:
    return f"{pass_name}|{row_id!r}|{level}|{index}"


def _stats_json(stats: GenerationStats) -> str:
    return json.dumps(dataclasses.asdict(stats), allow_nan=False, default=str)


def _stats_of(text: str) -> GenerationStats:
    data = json.loads(text)
    data["split"] = Split(**data.get("split") or {})
    data["plans"] = {k: PlanTally(**v) for k, v in (data.get("plans") or {}).items()}
    names = {f.name for f in dataclasses.fields(GenerationStats)}
    return GenerationStats(**{k: v for k, v in data.items() if k in names})


def read_known(out: OutputDir, schema: pa.Schema, pass_name: str, config: str) -> dict:
    """The nodes earlier runs of this configuration finished in ``pass_name``: row id ->
    (level, index) -> StoredNode."""
    table = out.read_rows(NODES, schema)
    id_column = schema.names[1]
    known: dict = {}
    if not table.num_rows:
        return known
    table = table.filter(pc.and_(pc.equal(table.column("pass"), pass_name),
                                 pc.equal(table.column("config"), config)))
    for row in table.to_pylist():
        result = GenerationResult(row["generated_tokens"] or [], _stats_of(row["stats"]),
                                  row["finish_reason"], row["generated_text"] or "",
                                  row["replica"])
        known.setdefault(row[id_column], {})[(row["level"], row["index"])] = StoredNode(
            row["digest"], result)
    if known:
        log.info("%s: %d node(s) of %d document tree(s) done by an earlier run", pass_name,
                 sum(map(len, known.values())), len(known))
    return known


def tree_dispatch(builder: PromptBuilder, dispatcher: Dispatcher, pass_name: str,
                  config: str, writer: PartWriter, known: dict,
                  on_start: Callable[[DocumentTree], None] | None = None) -> TreeDispatch:
    """The trees of one pass: the nodes ``known`` from earlier runs reused, every node
    generated now added to the node table (``writer``) under ``pass_name`` and ``config``;
    ``on_start``: TreeDispatch's."""
    id_column = writer.schema.names[1]

    def on_node(tree: DocumentTree, node: Node, result: GenerationResult) -> None:
        s = result.stats
        writer.add({"node": node_key(pass_name, tree.key, node.level, node.index),
                    id_column: tree.key, "pass": pass_name, "config": config,
                    "level": node.level, "index": node.index,
                    "children": None if node.children is None else list(node.children),
                    "digest": node.digest, "generated_text": result.text,
                    "generated_tokens": list(result.token_ids),
                    "finish_reason": result.finish_reason, "num_input_tokens": s.prompt_tokens,
                    "num_generated_tokens": s.new_tokens, "time_taken_llm": s.wall_s,
                    "replica": result.replica, "stats": _stats_json(s), "error": None,
                    "finished_at": dt.datetime.now(dt.timezone.utc)})

    return TreeDispatch(builder, dispatcher, lambda key: known.pop(key, {}), on_node, on_start)
