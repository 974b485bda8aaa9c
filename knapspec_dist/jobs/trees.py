"""The summary trees of a pass's long documents: their nodes as dispatcher tasks, each node
kept in the output's node table (``DIR/nodes/``) as soon as it is done, and a tree's row once
its root is.

A tree's nodes flow through the same dispatcher as ordinary rows, so the chunks of every
document share continuous batching with them; a node that completes a group is put at the
front of the queue (the nodes that finish a document first, so few trees are half done). A
node's sampling key is (row id, level, index): its text depends on the row's seed and its
place in the tree, not on batching, replicas or resumes.

The node table is also what a user reads to see how a book was summarized: one row per node
with its level, index, input digest and summary, under the pass that made it (``rows``, or a
baseline pass). A rerun of the job reuses a node whose pass, document, place and input digest
match (the job's configuration is fixed by job.json: a changed one is refused before this).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.engine.generation import (
    GenerationResult,
    GenerationStats,
    PlanTally,
    Split,
)
from knapspec_dist.jobs.output import NODES, OutputDir, PartWriter
from knapspec_dist.jobs.tree import DocumentTree, Node, StoredNode, merged_result, tree_columns
from knapspec_dist.runtime.dispatch import Outcome, Task
from knapspec_dist.runtime.prompts import PromptBuilder

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


@dataclass
class TreeTask(Task):
    """A row that needs a tree: its chunks' prompts and digests (``prompt_ids`` is empty)."""

    chunks: list[tuple[list[int], str]] | None = None


@dataclass
class NodeTask(Task):
    """One node of a tree, on its way to a replica."""

    tree: DocumentTree | None = None
    node: Node | None = None


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


class TreeRows:
    """One pass's trees in flight (see the module docstring)."""

    def __init__(self, builder: PromptBuilder, pass_name: str, config: str, writer: PartWriter,
                 known: dict, push: Callable[[Task], None], drop: Callable[[Callable], None]):
        """``config``: the job configuration's hash; ``push(task)``: a task to the front of
        the dispatcher's queue; ``drop(pred)``: the queued tasks for which ``pred`` holds
        taken out (a failed tree's)."""
        self.builder, self.pass_name, self.config, self.writer = builder, pass_name, config, writer
        self.known, self.push, self.drop = known, push, drop
        self.id_column = writer.schema.names[1]

    def expand(self, tasks: Iterator[Task], on_done: Callable[[DocumentTree, Task], None]
               ) -> Iterator[Task]:
        """``tasks`` with every TreeTask replaced by its tree's ready nodes; a tree an earlier
        run finished whole goes straight to ``on_done``."""
        for task in tasks:
            if not isinstance(task, TreeTask):
                yield task
                continue
            tree = DocumentTree(task.key, task.chunks, self.builder.combine_prompt,
                                self.builder.limit, self.builder.tree.max_depth,
                                self.known.pop(task.key, {}))
            if tree.done:
                on_done(tree, task)
                continue
            yield from self._tasks(tree)

    def _tasks(self, tree: DocumentTree) -> list[NodeTask]:
        return [NodeTask((tree.key, n.level, n.index), n.prompt_ids, tree=tree, node=n)
                for n in tree.ready()]

    def landed(self, outcome: Outcome) -> DocumentTree | None:
        """A node's outcome: kept, and its tree advanced; the tree when it just ended."""
        task: NodeTask = outcome.task
        tree, node = task.tree, task.node
        if tree.done:  # failed before this node came back
            return None
        if outcome.error is not None:
            tree.fail(node, outcome.error)
            tree.error_kind = outcome.kind
            self.drop(lambda t: isinstance(t, NodeTask) and t.tree is tree)
            return tree
        self.writer.add(self._node_row(tree, node, outcome.result))
        tree.finish(node, outcome.result)
        if tree.done:
            return tree
        for new in sorted(self._tasks(tree), key=lambda t: (t.node.level, -t.node.index)):
            self.push(new)  # pushed to the front: the highest level ends up first
        return None

    def _node_row(self, tree: DocumentTree, node: Node, result: GenerationResult) -> dict:
        s = result.stats
        return {"node": node_key(self.pass_name, tree.key, node.level, node.index),
                self.id_column: tree.key, "pass": self.pass_name, "config": self.config,
                "level": node.level, "index": node.index, "children": None if node.children is None
                else list(node.children), "digest": node.digest,
                "generated_text": result.text, "generated_tokens": list(result.token_ids),
                "finish_reason": result.finish_reason, "num_input_tokens": s.prompt_tokens,
                "num_generated_tokens": s.new_tokens, "time_taken_llm": s.wall_s,
                "replica": result.replica, "stats": _stats_json(s), "error": None,
                "finished_at": dt.datetime.now(dt.timezone.utc)}


def tree_row_columns(tree: DocumentTree) -> tuple[GenerationResult | None, dict]:
    """A finished tree's merged result (None when it failed) and its own columns."""
    columns = {"document_path": "tree", **tree_columns(tree)}
    return (None if tree.error is not None else merged_result(tree)), columns
