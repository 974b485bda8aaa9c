"""One long document's summary tree: which generations it needs, and when each may start.

Level 0 summarizes each chunk (runtime/chunking.py). Each higher level packs consecutive
summaries of the level below, in order and greedily, into groups whose combining prompt fits
the window (of at most ``max_fan_in`` summaries), and summarizes each group; the tree ends
when a level has one summary. A group is ready as soon as its own inputs are done and the
next summary (the first that does not fit it) is known, so nothing waits for a whole level,
and the packing depends on the texts alone: a rerun packs the same groups whatever order
the nodes finished in.

Pure state: the jobs layer (jobs/trees.py) submits :meth:`DocumentTree.ready` nodes to the
replicas and hands their summaries to :meth:`DocumentTree.finish`. A node found in ``known``
(a resumed job's node table) with the same input digest finishes without a generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from knapspec_dist.engine.generation import GenerationResult, GenerationStats, PlanTally
from knapspec_dist.runtime.chunking import text_digest


@dataclass
class Node:
    """One generation of a tree: a chunk's summary (level 0) or a group's (level >= 1)."""

    level: int
    index: int
    prompt_ids: list[int]
    digest: str
    children: tuple[int, int] | None = None  # [first, end) of the level below; None: a chunk
    result: GenerationResult | None = None  # None until done
    reused: bool = False  # taken from an earlier run's node table

    @property
    def text(self) -> str | None:
        return None if self.result is None else self.result.text


@dataclass
class StoredNode:
    """A node an earlier run finished: its input digest, summary and statistics."""

    digest: str
    result: GenerationResult


#: Tokens a summary's place in a combining prompt costs beyond its own (the blank line between
#: summaries): the packing's estimate, which one exact encoding per group then checks.
SEPARATOR = 2

#: Builds a combining prompt: (summaries in order, level, index) -> prompt token ids.
CombinePrompt = Callable[[list[str], int, int], list[int]]


@dataclass
class DocumentTree:
    """The tree of one document, grown as its nodes finish (see the module docstring).

    ``chunks``: each chunk's level-0 prompt ids and text digest; ``combine``: the combining
    prompt's builder; ``limit``: the most prompt tokens a node may have; ``max_depth``: the
    most levels (chunks' included); ``known``: (level, index) -> a node of an earlier run;
    ``max_fan_in``: the most summaries one group combines (None: as many as fit).
    """

    key: object
    chunks: list[tuple[list[int], str]]
    combine: CombinePrompt
    limit: int
    max_depth: int
    known: dict[tuple[int, int], StoredNode] = field(default_factory=dict)
    max_fan_in: int | None = None
    levels: list[list[Node]] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None  # a failed node's (dispatch.Outcome.kind)
    _closed: list[int] = field(default_factory=list)  # per level: summaries grouped above
    _complete: list[bool] = field(default_factory=list)  # per level: every node exists
    _ready: list[Node] = field(default_factory=list)

    def __post_init__(self):
        if not self.chunks:
            self.error = "the document has no text to summarize"
            return
        self._add_level()
        for i, (ids, chunk_digest) in enumerate(self.chunks):
            self._new(0, Node(0, i, ids, chunk_digest))
        self._complete[0] = True
        self._advance()

    # ------------------------------------------------------------------ state

    @property
    def root(self) -> Node | None:
        """The final summary's node, once done."""
        top = self.levels[-1] if self.levels else []
        if self._complete and self._complete[-1] and len(top) == 1 and top[0].result:
            return top[0]
        return None

    @property
    def done(self) -> bool:
        return self.error is not None or self.root is not None

    @property
    def nodes(self) -> list[Node]:
        return [n for level in self.levels for n in level]

    def ready(self) -> list[Node]:
        """Nodes to generate now (each returned once), the highest level first: they bring
        the document nearest its end."""
        out, self._ready = self._ready, []
        return sorted(out, key=lambda n: (-n.level, n.index))

    def finish(self, node: Node, result: GenerationResult) -> None:
        """A node's summary arrived: group what it completes, and start what is ready."""
        if self.error is not None:
            return
        node.result = result
        self._advance()

    def fail(self, node: Node, error: str) -> None:
        self.error = f"{_name(node)}: {error}"

    def work_bound(self, summary_tokens: int) -> tuple[int, int]:
        """The generations and prompt tokens this tree may still need, for a progress line:
        its chunks not yet done, and above them the packing's bound, every summary taken as
        ``summary_tokens`` long (the most a node generates): a group then holds at least as
        many summaries as fit the window at that length (two at least, ``max_fan_in`` at
        most), and each level above ``n`` summaries has at most ceil(n / that) groups."""
        if self.done:
            return 0, 0
        todo = [n for n in self.nodes if n.result is None]
        generations, prompt = len(todo), sum(len(n.prompt_ids) for n in todo)
        overhead = len(self.combine([], 1, 0))
        each = summary_tokens + SEPARATOR
        fan_in = max(2, (self.limit - overhead) // each)
        if self.max_fan_in:
            fan_in = min(fan_in, self.max_fan_in)
        n = len(self.levels[0])  # summaries of the level below
        for level in range(1, self.max_depth):
            if n <= 1:
                break
            groups = -(-n // fan_in)
            made = len(self.levels[level]) if level < len(self.levels) else 0
            left = max(0, groups - made)
            generations += left
            closed = self._closed[level - 1] if level - 1 < len(self._closed) else 0
            prompt += left * overhead + max(0, n - closed) * each
            n = max(groups, made)
        return generations, prompt

    # ------------------------------------------------------------------ growth

    def _add_level(self) -> None:
        self.levels.append([])
        self._closed.append(0)
        self._complete.append(False)

    def _new(self, level: int, node: Node) -> None:
        self.levels[level].append(node)
        stored = self.known.get((level, node.index))
        if stored is not None and stored.digest == node.digest:
            node.result, node.reused = stored.result, True
        else:
            self._ready.append(node)

    def _advance(self) -> None:
        """Close every group whose inputs are done, level by level, until nothing changes."""
        changed = True
        while changed and self.error is None:
            changed = False
            for level in range(len(self.levels)):
                if self._group_above(level):
                    changed = True

    def _group_above(self, level: int) -> bool:
        """Close the next group of ``level``'s summaries into level + 1, if it is ready."""
        below = self.levels[level]
        start = self._closed[level]
        if start >= len(below) or (self._complete[level] and len(below) == 1):
            return False  # nothing left to group; or this level's one node is the root
        if level + 1 >= self.max_depth:
            if len(below) < 2:
                return False  # this level's one node may yet be the root
            self.error = (f"the tree needs more than {self.max_depth} levels (--tree-depth); "
                          f"level {level} has {len(below)} summaries")
            return False
        index = len(self.levels[level + 1]) if level + 1 < len(self.levels) else 0
        room = self.limit - len(self.combine([], level + 1, index))
        fan_in = self.max_fan_in or len(below) + 1  # None: no bound
        end = start
        while (end < len(below) and end - start < fan_in and below[end].result is not None
               and (room := room - len(below[end].result.token_ids) - SEPARATOR) >= 0):
            end += 1
        last = self._complete[level] and end == len(below)
        full = end - start == fan_in or (  # as many as it may have, or the next did not fit
            end < len(below) and below[end].result is not None)
        if not (last or full):
            return False  # the group may still grow
        prompt = self.combine([n.text for n in below[start:end]], level + 1, index)
        while len(prompt) > self.limit and end - start > 1:  # the estimate was short
            end -= 1
            prompt = self.combine([n.text for n in below[start:end]], level + 1, index)
        last = self._complete[level] and end == len(below)
        if end == start or len(prompt) > self.limit or (end - start == 1 and not last):
            self.error = (f"level {level + 1} cannot combine two summaries: "
                          f"{_name(below[start])} and the next need more than the "
                          f"{self.limit} prompt tokens the window leaves (lower "
                          "--max-new-tokens or raise --max-model-len)")
            return False
        if level + 1 == len(self.levels):
            self._add_level()
        above = self.levels[level + 1]
        self._new(level + 1, Node(level + 1, len(above), prompt,
                                  text_digest([n.text for n in below[start:end]]), (start, end)))
        self._closed[level] = end
        if last:
            self._complete[level + 1] = True
        return True


def _name(node: Node) -> str:
    return f"{'chunk' if node.level == 0 else 'group'} {node.index} of level {node.level}"


def merged_result(tree: DocumentTree) -> GenerationResult:
    """The tree as one row's result: the final summary's tokens and text; the statistics of
    every generation it took (tokens, times, rounds, drafts, plans: summed; the batch:
    averaged over rounds), so a tree row's throughput and speedup are the whole tree's."""
    root = tree.root
    stats = [n.result.stats for n in tree.nodes]
    total = GenerationStats()
    for name in ("prompt_tokens", "new_tokens", "rounds", "drafted", "accepted",
                 "copied_drafted", "copied_accepted", "wall_s", "prefill_s", "draft_s",
                 "verify_s", "select_s", "selections", "fallbacks"):
        setattr(total, name, sum(getattr(s, name) for s in stats))
    for name in ("attention_skipped", "mlp_skipped"):  # means per drafted token
        total.__setattr__(name, sum(getattr(s, name) * s.drafted for s in stats)
                          / total.drafted if total.drafted else 0.0)
    batched = [(s.mean_batch, s.rounds) for s in stats if s.mean_batch is not None and s.rounds]
    rounds = sum(r for _, r in batched)
    total.mean_batch = sum(b * r for b, r in batched) / rounds if rounds else None
    total.admitted_at = min((s.admitted_at for s in stats if s.admitted_at), default=0.0)
    total.finished_at = max((s.finished_at for s in stats), default=0.0)
    for s in stats:
        for label, t in s.plans.items():
            acc = total.plans.setdefault(label, PlanTally())
            for name in ("rounds", "tokens", "seconds", "predicted_tokens", "priced_s"):
                setattr(acc, name, getattr(acc, name) + getattr(t, name))
    return GenerationResult(list(root.result.token_ids), total, root.result.finish_reason,
                            root.result.text, root.result.replica)


def tree_columns(tree: DocumentTree) -> dict:
    """The tree's own output columns: its chunks, depth, generations and tokens."""
    nodes = [n for n in tree.nodes if n.result is not None]
    return {"tree_chunks": len(tree.chunks), "tree_depth": len(tree.levels),
            "tree_generations": len(tree.nodes),
            "tree_prompt_tokens": sum(n.result.stats.prompt_tokens for n in nodes),
            "tree_generated_tokens": sum(n.result.stats.new_tokens for n in nodes)}
