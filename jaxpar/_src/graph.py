"""The operator graph: what tracing produces and every later stage reads.

Nodes are operators (one per jaxpr equation after inlining nested calls) plus the pseudo-operators
that make a function's boundary and control flow visible to the search:

* ``input`` / ``const``: a flattened argument or closed-over constant (one output value);
* ``output``: a flattened result (one input, no outputs);
* ``op``: a primitive application, with its equation for lowering;
* ``enter`` / ``exit``: values crossing into / out of a ``scan``, ``while`` or ``cond`` body,
  each with a :class:`Crossing` saying which control node, in which :class:`Role`, at which
  position.  A loop carry is an ``enter`` node with two inputs (the initial value and the
  body's next value, a back edge), which is how a carry's layout stays the same around the loop;
* ``control``: the ``scan``/``while``/``cond`` itself, with its :class:`ScanRegion`,
  :class:`WhileRegion` or :class:`CondRegion` (the body's nodes, its carries, its exits).  It
  is not searched; lowering uses it to rebuild the loop around the constrained body.

The body of a ``jax.checkpoint`` (``remat2``) is inlined: its operators are ordinary nodes (so
the recomputed forward pass is searched and priced), and a :class:`RematBlock` remembers them so
that lowering keeps the recomputation.

Values are tensors, each produced by exactly one node; literals in equations are :class:`Const`
operands and carry no edge.  An :class:`Edge` joins a value's producer to one of its readers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np


class NodeKind(enum.StrEnum):
    """What a node is (a ``str``: ``NodeKind.OP == "op"``)."""

    INPUT = "input"  # a flattened argument
    CONST = "const"  # a closed-over constant
    OUTPUT = "output"  # a flattened result
    OP = "op"  # a primitive application
    ENTER = "enter"  # a value crossing into a control-flow body
    EXIT = "exit"  # a value crossing out of one
    CONTROL = "control"  # the scan, while or cond itself


class Role(enum.StrEnum):
    """What a value crossing into or out of a control-flow body is to it."""

    CONST = "const"  # a loop-invariant operand of a scan or while body
    CARRY = "carry"  # a loop carry (enter), with the body's next value as a back edge
    XS = "xs"  # a scanned operand: one slice per iteration
    OPERAND = "operand"  # an operand of a cond's branches
    CARRY_OUT = "carry_out"  # a loop's final carry (exit)
    YS = "ys"  # a scan's stacked per-iteration result (exit)
    MERGE = "merge"  # a cond's result: one input per branch (exit)


@dataclasses.dataclass(frozen=True, slots=True)
class Crossing:
    """Where an ``enter`` or ``exit`` node crosses a control-flow boundary."""

    control: int  # the control node
    role: Role
    index: int  # position among the control equation's operands (enter) or results (exit)


@dataclasses.dataclass(frozen=True, slots=True)
class ScanRegion:
    """A ``lax.scan``: its body runs ``length`` times (the equation has the parameters).  Each
    tuple lists node ids; the enter groups are in operand order."""

    body: tuple[int, ...]  # in evaluation order, its enter nodes first
    consts: tuple[int, ...]  # enter nodes: loop-invariant operands
    carries: tuple[int, ...]  # enter nodes: the carries (their second input: the next value)
    xs: tuple[int, ...]  # enter nodes: the scanned operands
    exits: tuple[int, ...]  # by result position: the final carries, then the stacked ys


@dataclasses.dataclass(frozen=True, slots=True)
class WhileRegion:
    """A ``lax.while_loop``: ``cond`` computes ``predicate`` from the carries, ``body`` the
    next carries (each carry enter node's second input)."""

    carries: tuple[int, ...]  # enter nodes shared by cond and body
    cond_consts: tuple[int, ...]  # enter nodes of cond's loop-invariant operands
    body_consts: tuple[int, ...]  # enter nodes of body's
    cond: tuple[int, ...]  # in evaluation order (its const enter nodes first)
    body: tuple[int, ...]
    predicate: Operand
    exits: tuple[int, ...]  # by result position


@dataclasses.dataclass(frozen=True, slots=True)
class CondRegion:
    """A ``lax.cond``/``lax.switch``: the index (the control node's first input) picks a
    branch; each exit merges the branches' values (its input ``k`` is branch ``k``'s)."""

    operands: tuple[int, ...]  # enter nodes, in operand order
    branches: tuple[tuple[int, ...], ...]  # each in evaluation order
    exits: tuple[int, ...]  # by result position


Region = ScanRegion | WhileRegion | CondRegion


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
    kind: NodeKind
    name: str  # primitive name; a pseudo-operator's kind or role ("input", "carry", "xs", ...)
    inputs: tuple[Operand, ...]
    outputs: tuple[int, ...]
    source: str = "?"  # "file.py:12 (fn)" of the user's code
    weight: float = 1.0  # how many times it runs per call (loop trip counts)
    region: int | None = None  # the enclosing control node, if any
    eqn: Any = None  # the jaxpr equation (op and control nodes)
    label: str = ""  # argument path for inputs/outputs, e.g. "params.w1"
    remat: int | None = None  # the innermost checkpoint block it belongs to, if any
    crossing: Crossing | None = None  # enter and exit nodes
    structure: Region | None = None  # control nodes
    constant: Any = None  # const nodes: the value
    backward: bool = False  # made by JAX's transpose (the backward pass), see compat.transposed

    @property
    def role(self) -> Role | None:
        return self.crossing.role if self.crossing is not None else None

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.kind}:{self.name}, in={self.inputs}, out={self.outputs})"


class Edge(NamedTuple):
    """A value from output ``out_index`` of ``producer`` read as input ``in_index`` of
    ``consumer``."""

    producer: int
    out_index: int
    consumer: int
    in_index: int


class Use(NamedTuple):
    """A value read as input ``in_index`` of ``consumer``."""

    consumer: int
    in_index: int


@dataclasses.dataclass(frozen=True, eq=False)
class OpGraph:
    """The traced program.

    Attributes:
      nodes: every node; ``nodes[i].id == i``.
      values: every value; ``values[i].id == i``.
      order: top-level node ids in evaluation order (control nodes stand for their bodies).
      inputs: ids of the ``input`` nodes, in flattened-argument order.
      outputs: ids of the ``output`` nodes, in flattened-result order.
      consumers: per value id, the :class:`Use` s that read it.
      remats: the checkpoint blocks; ``remats[b].id == b``.
    """

    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    order: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    consumers: tuple[tuple[Use, ...], ...]
    remats: tuple[RematBlock, ...] = ()

    def searchable(self) -> Iterator[Node]:
        """Nodes that get a strategy (everything but control nodes)."""
        return iter(self._searchable)

    def operand_shape(self, operand: Operand) -> tuple[int, ...]:
        return operand.shape if isinstance(operand, Const) else self.values[operand].shape

    def operand_dtype(self, operand: Operand) -> Any:
        return operand.dtype if isinstance(operand, Const) else self.values[operand].dtype

    def neighbours(self, node_id: int) -> Iterator[Edge]:
        """The edges touching a node: its inputs', then its outputs'."""
        return iter(self._around[node_id])

    def edges(self) -> Iterator[Edge]:
        """Every edge, by consumer."""
        return iter(self._edges)

    def priced_edges(self) -> Iterator[Edge]:
        """The edges a layout change can sit on: not into a control node (it only stands for
        its body), nor a loop carry's edge to itself."""
        return iter(self._priced)

    # The edge lists, made on the first ask and kept: a plan walks them a dozen times (issue
    # 14: the first call of a deep model), and the graph never changes.
    @functools.cached_property
    def _edges(self) -> tuple[Edge, ...]:
        out = []
        for node in self.nodes:
            for i, operand in enumerate(node.inputs):
                if isinstance(operand, int):
                    v = self.values[operand]
                    out.append(Edge(v.producer, v.index, node.id, i))
        return tuple(out)

    @functools.cached_property
    def _searchable(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind is not NodeKind.CONTROL)

    @functools.cached_property
    def _priced(self) -> tuple[Edge, ...]:
        nodes = self.nodes
        return tuple(e for e in self._edges
                     if e.producer != e.consumer and nodes[e.consumer].kind is not NodeKind.CONTROL)

    @functools.cached_property
    def _around(self) -> tuple[tuple[Edge, ...], ...]:
        around: list[list[Edge]] = [[] for _ in self.nodes]
        for e in self._edges:  # a node's inputs' edges, in input order
            around[e.consumer].append(e)
        for node in self.nodes:  # then its outputs', by output and use
            out = around[node.id]
            for j, vid in enumerate(node.outputs):
                for use in self.consumers[vid]:
                    out.append(Edge(node.id, j, use.consumer, use.in_index))
        return tuple(tuple(a) for a in around)

    def count(self, kind: str = "op") -> int:
        return sum(1 for n in self.nodes if n.kind == kind)


def build_consumers(nodes: Sequence[Node], num_values: int) -> tuple[tuple[Use, ...], ...]:
    table: list[list[Use]] = [[] for _ in range(num_values)]
    for node in nodes:
        for i, operand in enumerate(node.inputs):
            if isinstance(operand, int):
                table[operand].append(Use(node.id, i))
    return tuple(tuple(c) for c in table)
