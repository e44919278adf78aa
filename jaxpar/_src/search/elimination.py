"""``search_mode="dynamic_programming"``: MindSpore's elimination dynamic programming.

The coarse graph is shrunk one node at a time, each elimination folding a node's costs into its
neighbours and recording, for every choice of what remains, the best choice of what went:

* parallel edges between two nodes are summed (MindSpore's *edge elimination*);
* a node with one neighbour is folded into it (*merge* / *contract elimination*);
* a node with two neighbours becomes an edge between them (*operator elimination*; when the two
  are already joined this is the *triangle elimination*);
* when every node has three or more neighbours, the node with fewest neighbours is merged with
  the neighbour it shares most neighbours with into one node whose candidates are their pairs
  (exact; this turns the ladder a forward and a backward pass make into a chain), as long as the
  pair list stays small;
* otherwise, when what is left is small enough, that *final graph* is solved exactly (MindSpore
  enumerates its final graph; here the integer program of ``optimal.py`` does it).  "Small" is
  the size of that program (:data:`CORE_VARIABLES`), not the number of nodes: on a mesh of
  three axes an operator has 64 to 125 candidates, an edge up to 15,000 candidate pairs, and a
  core of a hundred nodes is an integer program of a million variables that takes minutes;
* otherwise the lightest node is folded into its heaviest neighbour, its own choice fixed per
  choice of that neighbour (*star elimination*, the first approximate step; the other is a
  final graph whose relaxation is not integral, solved over the candidates the relaxation
  uses).

A node left alone takes its cheapest candidate; the recorded decisions are then replayed in
reverse to recover every choice.  Without approximate steps (chains, trees, series-parallel
graphs, ladders) the result is the exact optimum of the cost model; the statistics say whether
a solve approximated (and how large its tables and integer program were), and when it did, the
search polishes the result (``polish.py``).  Costs are seconds of compute plus communication;
the memory limit is applied by the caller, which re-solves with memory priced in when a plan
does not fit.

References: MindSpore ``auto_parallel/dp_algo_costmodel.cc``, ``graph_costmodel.cc``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq

import numpy as np

from jaxpar._src.errors import PlanError
from jaxpar._src.search.optimal import IlpResult, Seen, ilp_variables, solve_optimal
from jaxpar._src.search.problem import Problem

PAIR_LIMIT = 1024  # largest candidate list a merged pair of nodes may have
WORK_LIMIT = 4e6  # largest table (candidate triples) an exact elimination may build
# Largest integer program (variables) that solves the final graph exactly; about a second of
# HiGHS on one core.  Beyond it, star eliminations shrink the graph until it fits.
CORE_VARIABLES = 40_000
CORE_TIME_LIMIT = 20.0  # seconds (a safety: the relaxation of such a program takes one)
# Final graphs solved lately, by content: the polishing passes re-solve the same problem (a
# refinement that keeps every candidate), and a final graph's integer program is most of an
# elimination's time (a second of a ResNet's search).  The answer is a function of the
# tables alone, so remembering it changes no plan.
CORE_MEMORY = 16
_solved_cores: collections.OrderedDict[bytes, IlpResult] = collections.OrderedDict()


@dataclasses.dataclass
class EliminationStats:
    """What an elimination solve did; ``exact`` when no step approximated."""

    leaf: int = 0
    operator: int = 0
    pair: int = 0
    star: int = 0
    core: int = 0  # nodes left for the exact solve of the final graph
    core_variables: int = 0  # its integer program's size
    core_exact: bool = True  # its relaxation was integral (else: a neighbourhood's optimum)
    largest_table: int = 0  # entries of the largest table an elimination built
    # A proven lower bound of the optimum (seconds, memory priced in): the plan's objective when
    # exact; else the final graph's relaxation when no star elimination came before it (the
    # exact eliminations lose nothing, so the final graph's optimum is the problem's); None.
    bound: float | None = None

    @property
    def exact(self) -> bool:
        return not self.star and self.core_exact


def solve_elimination(problem: Problem, *, memory_price: float = 0.0,
                      core_variables: int | None = None
                      ) -> tuple[dict[int, int], EliminationStats]:
    """Eliminates ``problem``'s nodes (module docstring); its final graph is solved by an
    integer program of at most ``core_variables`` (default :data:`CORE_VARIABLES`)."""
    if core_variables is None:
        core_variables = CORE_VARIABLES
    cost = {r: problem.cost[r] + memory_price * problem.mem[r] for r in problem.reps}
    for r, k in problem.forced.items():
        mask = np.full(len(cost[r]), np.inf)
        mask[k] = 0.0
        cost[r] = cost[r] + mask
    edges: dict[tuple[int, int], np.ndarray] = {}
    adjacency: dict[int, set[int]] = {r: set() for r in problem.reps}
    for (u, v), m in problem.edges.items():
        edges[(u, v)] = m.copy()
        adjacency[u].add(v)
        adjacency[v].add(u)

    def edge(a: int, b: int) -> np.ndarray:
        return edges[(a, b)] if a < b else edges[(b, a)].T

    def add_edge(a: int, b: int, m: np.ndarray) -> None:
        key, m = ((a, b), m) if a < b else ((b, a), m.T)
        edges[key] = edges[key] + m if key in edges else m
        adjacency[a].add(b)
        adjacency[b].add(a)

    def drop(v: int) -> None:
        for u in adjacency.pop(v):
            adjacency[u].discard(v)
            edges.pop((u, v) if u < v else (v, u), None)

    stats = EliminationStats()
    records: list[tuple] = []
    alive = set(problem.reps)
    next_id = max(problem.reps, default=0) + 1  # ids of merged pairs
    def work(n: int) -> float:
        """Size of the table eliminating ``n`` builds (inf: three or more neighbours)."""
        nbrs = adjacency[n]
        if len(nbrs) > 2:
            return np.inf
        size = float(len(cost[n]))
        for u in nbrs:
            size *= len(cost[u])
        return size

    recheck = len(alive)  # try the final graph's exact solve once it has this many nodes
    counted: Seen = {}  # ilp_variables' memory of the edges it counted, and their classes
    heap = [(work(n), n) for n in alive]
    heapq.heapify(heap)
    by_degree = [(len(adjacency[n]), n) for n in alive]  # for when no step is exact
    heapq.heapify(by_degree)

    def touch(nodes: set[int]) -> None:
        for n in nodes:
            if n in alive:
                heapq.heappush(heap, (work(n), n))
                heapq.heappush(by_degree, (len(adjacency[n]), n))

    while alive:
        v = None
        while heap:
            w_v, n = heap[0]
            if n not in alive or w_v != work(n):
                heapq.heappop(heap)  # stale entry
                continue
            if w_v <= WORK_LIMIT:
                v = heapq.heappop(heap)[1]
            break
        if v is None and len(alive) <= recheck:
            # No exact step left: solve the remaining core exactly, as MindSpore solves its
            # final graph (there by enumeration, here by the integer program), if it is small
            # enough; else look again once star eliminations have shrunk it by a quarter.
            core = _core_problem(problem, alive, cost, edges)
            size = ilp_variables(core, limit=core_variables, seen=counted)
            solved = None
            if size <= core_variables:  # (digesting a core too large to solve is waste)
                key = _fingerprint(core)
                solved = _solved_cores.get(key)
                if solved is None:
                    solved = _solve_core(core, counted)
                    if solved is not None:
                        _solved_cores[key] = solved
                        while len(_solved_cores) > CORE_MEMORY:
                            _solved_cores.popitem(last=False)
                else:
                    _solved_cores.move_to_end(key)
            if solved is not None:
                records.append(("core", solved.choice))
                stats.core, stats.core_variables = len(alive), size
                stats.core_exact = solved.optimal
                if not stats.star and not solved.optimal:
                    stats.bound = solved.bound
                break
            recheck = (3 * len(alive)) // 4
        while v is None:  # every node is costly or has three or more neighbours
            d, n = heapq.heappop(by_degree)
            if n in alive and d == len(adjacency[n]):
                v = n
        nbrs = sorted(adjacency[v])
        exact = work(v) <= WORK_LIMIT  # else: too large (or too connected) to do exactly
        if exact and len(nbrs) == 0:
            records.append(("root", v, int(cost[v].argmin())))
        elif exact and len(nbrs) == 1:
            (u,) = nbrs
            total = edge(u, v) + cost[v][None, :]
            best = total.argmin(axis=1)
            stats.largest_table = max(stats.largest_table, total.size)
            cost[u] = cost[u] + total[np.arange(total.shape[0]), best]
            records.append(("leaf", v, u, best))
            stats.leaf += 1
        elif exact and len(nbrs) == 2:
            u, w = nbrs
            total = edge(u, v)[:, :, None] + cost[v][None, :, None] + edge(v, w)[None, :, :]
            best = total.argmin(axis=1)
            stats.largest_table = max(stats.largest_table, total.size)
            new = np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :]
            records.append(("operator", v, u, w, best))
            drop(v)
            alive.discard(v)
            add_edge(u, w, new)
            stats.operator += 1
            touch({u, w})
            continue
        else:
            pair = _best_pair(v, adjacency, cost)
            if pair is not None:
                a, b = pair
                p = next_id
                next_id += 1
                nb = len(cost[b])
                joint = cost[a][:, None] + cost[b][None, :] + edge(a, b)
                stats.largest_table = max(stats.largest_table, joint.size * max(
                    (len(cost[w]) for w in adjacency[a] | adjacency[b]), default=1))
                cost[p] = joint.reshape(-1)
                adjacency[p] = set()
                for w in (adjacency[a] | adjacency[b]) - {a, b}:
                    m = 0.0
                    if w in adjacency[a]:
                        m = m + edge(a, w)[:, None, :]
                    if w in adjacency[b]:
                        m = m + edge(b, w)[None, :, :]
                    m = np.broadcast_to(m, (len(cost[a]), nb, len(cost[w])))
                    add_edge(p, w, m.reshape(-1, len(cost[w])))
                drop(a)
                drop(b)
                alive -= {a, b}
                alive.add(p)
                records.append(("pair", p, a, b, nb))
                stats.pair += 1
                touch(adjacency[p] | {p})
                continue
            # Star: fix v's choice per choice of its heaviest neighbour, estimating the others.
            u = max(nbrs, key=lambda n: float(edge(n, v).max()))
            others = [w for w in nbrs if w != u]
            outlook = cost[v] + sum(edge(v, w).min(axis=1) for w in others)
            total = edge(u, v) + outlook[None, :]
            best = total.argmin(axis=1)
            cost[u] = cost[u] + edge(u, v)[np.arange(len(best)), best] + cost[v][best]
            for w in others:
                add_edge(u, w, edge(v, w)[best, :])
            records.append(("star", v, u, best))
            stats.star += 1
        touched = set(adjacency[v])
        drop(v)
        alive.discard(v)
        touch(touched)
    choice: dict[int, int] = {}
    for rec in reversed(records):
        kind, v = rec[0], rec[1]
        if kind == "core":
            choice.update(v)
        elif kind == "root":
            choice[v] = rec[2]
        elif kind in ("leaf", "star"):
            choice[v] = int(rec[3][choice[rec[2]]])
        elif kind == "pair":
            _, p, a, b, nb = rec
            choice[a], choice[b] = divmod(choice.pop(p), nb)
        else:
            _, _, u, w, best = rec
            choice[v] = int(best[choice[u], choice[w]])
    out = {r: int(choice[r]) for r in problem.reps}
    if stats.exact:
        stats.bound = problem.objective(out) + memory_price * sum(
            float(problem.mem[r][out[r]]) for r in problem.reps)
    return out, stats


def _core_problem(problem: Problem, alive: set[int], cost: dict[int, np.ndarray],
                  edges: dict[tuple[int, int], np.ndarray]) -> Problem:
    reps = sorted(alive)
    return dataclasses.replace(
        problem, reps=reps, cands={r: tuple(range(len(cost[r]))) for r in reps},
        cost={r: cost[r] for r in reps}, mem={r: np.zeros(len(cost[r])) for r in reps},
        edges={k: m for k, m in edges.items() if k[0] in alive and k[1] in alive},
        forced={}, groups=[], members=None)


def _fingerprint(core: Problem) -> bytes:
    """A digest of a final graph's cost tables (nodes, their costs, edges and theirs)."""
    h = hashlib.blake2b(digest_size=20)
    for r in core.reps:
        c = np.ascontiguousarray(core.cost[r], dtype=float)
        h.update(np.array([r, c.size], dtype=np.int64).tobytes())
        h.update(c.tobytes())
    for (u, v) in sorted(core.edges):
        m = np.ascontiguousarray(core.edges[(u, v)], dtype=float)
        h.update(np.array([u, v, *m.shape], dtype=np.int64).tobytes())
        h.update(m.tobytes())
    return h.digest()


def _solve_core(core: Problem, seen: Seen | None = None) -> IlpResult | None:
    """Exact when the relaxation is integral; else the relaxation's neighbourhood (no
    branching: its time is what this bound is for).  ``seen``: the edges' classes
    :func:`ilp_variables` found counting the core, not found again."""
    try:
        return solve_optimal(core, time_limit=CORE_TIME_LIMIT, branch=False, seen=seen)
    except PlanError:  # nothing found in time: go on with star eliminations
        return None


def _best_pair(v: int, adjacency: dict[int, set[int]], cost: dict[int, np.ndarray]
               ) -> tuple[int, int] | None:
    """``v`` and the neighbour sharing most of its neighbours, if their pair list is small."""
    best, best_key = None, None
    for u in adjacency[v]:
        size = len(cost[u]) * len(cost[v])
        if size > PAIR_LIMIT:
            continue
        key = (-len(adjacency[v] & adjacency[u]), size, u)
        if best_key is None or key < best_key:
            best, best_key = (min(u, v), max(u, v)), key
    return best
