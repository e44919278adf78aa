"""The operator graph: what tracing produces and every later stage reads.

Nodes are operators (one per jaxpr equation after inlining nested calls) plus the pseudo-operators
that make a function's boundary and control flow visible to the search:

* ``input`` / ``const``: a flattened argument or closed-over constant (one output value);
* ``output``: a flattened result (one input, no outputs);
* ``op``: a primitive application, with its equation for lowering;
* ``enter`` / ``exit``: values crossing into / out of a ``scan``, ``while`` or ``cond`` body.
  A loop carry is an ``enter`` node with two inputs (the initial value and the body's next value,
  a back edge), which is how a carry's layout stays the same around the loop;
* ``control``: the ``scan``/``while``/``cond`` itself.  It is not searched; lowering uses it to
  rebuild the loop around the constrained body.

The body of a ``jax.checkpoint`` (``remat2``) is inlined: its operators are ordinary nodes (so
the recomputed forward pass is searched and priced), and a :class:`RematBlock` remembers them so
that lowering keeps the recomputation.

Values are tensors, each produced by exactly one node; literals in equations are :class:`Const`
operands and carry no edge.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

NODE_KINDS = ("input", "const", "output", "op", "enter", "exit", "control")


def itemsize(dtype: Any) -> int:
    """Bytes per element; PRNG key arrays count their two uint32 words."""
    try:
        return _itemsize(dtype)
    except TypeError:  # an unhashable dtype
        return _itemsize.__wrapped__(dtype)


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: Any) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 8


@dataclasses.dataclass(frozen=True, slots=True)
class Const:
    """A literal operand of an equation (no producer, never sharded)."""

    value: Any
    shape: tuple[int, ...]
    dtype: Any


Operand = int | Const  # a value id, or a literal


@dataclasses.dataclass(frozen=True, slots=True)
class Value:
    """A tensor: produced by output ``index`` of node ``producer``."""

    id: int
    shape: tuple[int, ...]
    dtype: Any
    producer: int
    index: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class RematBlock:
    """The nodes of one inlined ``jax.checkpoint`` body (``node.remat`` is its id).

    They are contiguous in their sequence (``OpGraph.order`` or a loop body).  As JAX lowers a
    differentiated checkpoint, the block's ``inputs`` whose ``barrier`` is set pass an
    optimization barrier before the block runs, so XLA cannot merge the recomputation with the
    forward pass it repeats.
    """

    id: int
    inputs: tuple[Operand, ...]
    barrier: tuple[bool, ...]
    parent: int | None = None  # the enclosing block, when checkpoints nest


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One operator or pseudo-operator; see the module docstring for the kinds."""

    id: int
    kind: str
    name: str  # primitive name, or the pseudo-operator's role ("carry", "xs", ...)
    inputs: tuple[Operand, ...]
    outputs: tuple[int, ...]
    source: str = "?"  # "file.py:12 (fn)" of the user's code
    weight: float = 1.0  # how many times it runs per call (loop trip counts)
    region: int | None = None  # the enclosing control node, if any
    eqn: Any = None  # the jaxpr equation (op and control nodes)
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""  # argument path for inputs/outputs, e.g. "params.w1"
    remat: int | None = None  # the innermost checkpoint block it belongs to, if any

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.kind}:{self.name}, in={self.inputs}, out={self.outputs})"


@dataclasses.dataclass(frozen=True, eq=False)
class OpGraph:
    """The traced program.

    Attributes:
      nodes: every node; ``nodes[i].id == i``.
      values: every value; ``values[i].id == i``.
      order: top-level node ids in evaluation order (control nodes stand for their bodies).
      inputs: ids of the ``input`` nodes, in flattened-argument order.
      outputs: ids of the ``output`` nodes, in flattened-result order.
      consumers: per value id, the ``(node id, input index)`` pairs that read it.
      remats: the checkpoint blocks; ``remats[b].id == b``.
    """

    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    order: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    consumers: tuple[tuple[tuple[int, int], ...], ...]
    remats: tuple[RematBlock, ...] = ()

    def searchable(self) -> Iterator[Node]:
        """Nodes that get a strategy (everything but control nodes)."""
        return (n for n in self.nodes if n.kind != "control")

    def operand_shape(self, operand: Operand) -> tuple[int, ...]:
        return operand.shape if isinstance(operand, Const) else self.values[operand].shape

    def operand_dtype(self, operand: Operand) -> Any:
        return operand.dtype if isinstance(operand, Const) else self.values[operand].dtype

    def neighbours(self, node_id: int) -> Iterator[tuple[int, int, int, int]]:
        """Edges touching a node, as ``(producer, out index, consumer, in index)``."""
        node = self.nodes[node_id]
        for i, operand in enumerate(node.inputs):
            if isinstance(operand, int):
                v = self.values[operand]
                yield v.producer, v.index, node_id, i
        for j, vid in enumerate(node.outputs):
            for consumer, i in self.consumers[vid]:
                yield node_id, j, consumer, i

    def edges(self) -> Iterator[tuple[int, int, int, int]]:
        for node in self.nodes:
            for i, operand in enumerate(node.inputs):
                if isinstance(operand, int):
                    v = self.values[operand]
                    yield v.producer, v.index, node.id, i

    def count(self, kind: str = "op") -> int:
        return sum(1 for n in self.nodes if n.kind == kind)


def build_consumers(nodes: Sequence[Node], num_values: int
                    ) -> tuple[tuple[tuple[int, int], ...], ...]:
    table: list[list[tuple[int, int]]] = [[] for _ in range(num_values)]
    for node in nodes:
        for i, operand in enumerate(node.inputs):
            if isinstance(operand, int):
                table[operand].append((node.id, i))
    return tuple(tuple(c) for c in table)
