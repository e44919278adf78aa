"""Search modes: one protocol, one registry.

Every search mode, MindSpore's and jaxpar's own, is one object with one signature: it takes a
:class:`SearchRequest` (the search space, the pins, the ties) and returns a
:class:`SearchResult` (a strategy for every node, and for the automatic searches a report and
per-node details).  Modes are registered by name, as JAX registers a lowering per primitive;
the planner looks the name up, and that is the only dispatch on it.

>>> @register_search("everything_replicated")
... def _replicated(request):
...     space = request.space
...     chosen = {n.id: space.candidates(n.id)[0] for n in space.graph.searchable()}
...     return SearchResult(Assignment(chosen, dict.fromkeys(chosen, "replicated")),
...                         "everything_replicated")
>>> "everything_replicated" in search_modes()
True
>>> unregister_search("everything_replicated")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

from jaxpar._src.errors import ContextError
from jaxpar._src.rules import OpStrategy
from jaxpar._src.search.common import Assignment, Pin, SearchSpace


@dataclasses.dataclass(frozen=True)
class SearchRequest:
    """What every search is given."""

    space: SearchSpace
    pins: tuple[Pin, ...] = ()  # fixed strategies: never changed
    ties: tuple[tuple[int, int], ...] = ()  # (input, output) nodes that share one layout
    baseline_pins: tuple[Pin, ...] | None = None  # pure data parallel's, when the batch is known
    fully_use_devices: bool = True  # MindSpore's algorithm parameter
    where: str = "jaxpar"  # the API that asked, for error messages


@dataclasses.dataclass(frozen=True)
class Detail:
    """Why one node got its strategy: its cost terms and the best alternative."""

    compute_s: float
    comm_s: float  # its own collectives
    redistribution_s: float  # layout changes to its neighbours' choices
    runner_up: OpStrategy | None
    runner_up_extra_s: float  # how much more the runner-up would cost, the rest fixed


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What an automatic search did."""

    search_mode: str
    objective_s: float  # simulated seconds per call under the cost model
    search_s: float  # wall seconds the search took
    nodes: int  # coarse nodes searched
    memory_bytes: float  # estimated peak bytes per device
    memory_budget: float
    optimal: bool | None = None  # proven optimal (the exact search)
    baseline_s: float | None = None  # pure data parallel under the same model
    used_baseline: bool = False
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What every search returns."""

    assignment: Assignment
    search_mode: str  # what decided: a mode, "none", or a strategy file
    report: SearchReport | None = None  # automatic searches
    details: Mapping[int, Detail] = dataclasses.field(default_factory=dict)


class Search(Protocol):
    """A search mode."""

    def __call__(self, request: SearchRequest) -> SearchResult: ...


_SEARCHES: dict[str, Search] = {}


def register_search(name: str) -> Callable[[Search], Search]:
    """Registers a search mode under ``name`` (a decorator); registering a name again replaces
    the earlier search."""

    def deco(search: Search) -> Search:
        _SEARCHES[name] = search
        return search

    return deco


def unregister_search(name: str) -> None:
    _SEARCHES.pop(name, None)


def search_modes() -> tuple[str, ...]:
    """The registered modes, in registration order."""
    return tuple(_SEARCHES)


def get_search(name: str, *, where: str = "jaxpar") -> Search:
    try:
        return _SEARCHES[name]
    except KeyError:
        raise ContextError(f"{where}: search_mode {name!r} is not one of "
                           f"{list(search_modes())}.") from None
