"""Summary trees on the dispatcher: a row that needs a tree (a :class:`TreeTask`) becomes its
nodes' tasks, and each node that lands advances its tree and puts the nodes it made ready at
the front of the queue (they bring a document nearest its end, so few trees are half done).

The chunks of every document thus share continuous batching with ordinary rows. A node's
sampling key is (row key, level, index): its text depends on the row's seed and its place in
the tree, not on batching, replicas or resumes. Used by the batch job (jobs/trees.py, which
also keeps every node for resume) and the Ray Data processor (runtime/processor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from knapspec_dist.engine.generation import GenerationResult
from knapspec_dist.runtime.dispatch import Dispatcher, Outcome, Task
from knapspec_dist.runtime.prompts import PromptBuilder
from knapspec_dist.runtime.tree import DocumentTree, Node, StoredNode, merged_result, tree_columns


@dataclass
class TreeTask(Task):
    """A row that needs a tree: its chunks' prompts and digests (``prompt_ids`` is empty)."""

    chunks: list[tuple[list[int], str]] | None = None


@dataclass
class NodeTask(Task):
    """One node of a tree, on its way to a replica."""

    tree: DocumentTree | None = None
    node: Node | None = None
    continues: bool = True  # its tree's row started: finished even once the run is stopping

    @property
    def row(self):
        return self.tree.key


class TreeDispatch:
    """The trees of one dispatcher run.

    ``known(key)``: the nodes an earlier run finished for that row ((level, index) ->
    StoredNode); ``on_node(tree, node, result)``: a node was generated (the job keeps it);
    ``on_start(tree)``: a tree with work left started (the job's progress counts its work)."""

    def __init__(self, builder: PromptBuilder, dispatcher: Dispatcher,
                 known: Callable[[object], dict[tuple[int, int], StoredNode]] = lambda key: {},
                 on_node: Callable[[DocumentTree, Node, GenerationResult], None] | None = None,
                 on_start: Callable[[DocumentTree], None] | None = None):
        self.builder, self.dispatcher = builder, dispatcher
        self.known, self.on_node, self.on_start = known, on_node, on_start

    def expand(self, tasks: Iterator[Task], on_done: Callable[[DocumentTree, Task], None]
               ) -> Iterator[Task]:
        """``tasks`` with every TreeTask replaced by its tree's ready nodes; a tree done at once
        (an earlier run finished it whole, or it cannot be built) goes straight to
        ``on_done``."""
        for task in tasks:
            if not isinstance(task, TreeTask):
                yield task
                continue
            tree = DocumentTree(task.key, task.chunks, self.builder.combine_prompt,
                                self.builder.limit, self.builder.tree.max_depth,
                                self.known(task.key), self.builder.tree.max_fan_in)
            if tree.done:
                on_done(tree, task)
                continue
            if self.on_start is not None:
                self.on_start(tree)
            first, *rest = self._tasks(tree)
            for node in rest:  # a started row's: finished even once the run is stopping
                self.dispatcher.push(node, first=False)
            yield first

    def _tasks(self, tree: DocumentTree) -> list[NodeTask]:
        return [NodeTask((tree.key, n.level, n.index), n.prompt_ids, tree=tree, node=n)
                for n in tree.ready()]

    def landed(self, outcome: Outcome) -> DocumentTree | None:
        """A node's outcome: its tree advanced; the tree when it just ended."""
        task: NodeTask = outcome.task
        tree, node = task.tree, task.node
        if tree.done:  # failed before this node came back
            return None
        if outcome.error is not None:
            tree.fail(node, outcome.error)
            tree.error_kind = outcome.kind
            self.dispatcher.drop(lambda t: isinstance(t, NodeTask) and t.tree is tree)
            return tree
        if self.on_node is not None:
            self.on_node(tree, node, outcome.result)
        tree.finish(node, outcome.result)
        if tree.done:
            return tree
        for new in sorted(self._tasks(tree), key=lambda t: (t.node.level, -t.node.index)):
            self.dispatcher.push(new)  # each to the front: the highest level ends up first
        return None


def tree_row(tree: DocumentTree) -> tuple[GenerationResult | None, dict]:
    """A finished tree's merged result (None when it failed) and its own columns."""
    columns = {"document_path": "tree", **tree_columns(tree)}
    return (None if tree.error is not None else merged_result(tree)), columns
