"""How many layers each chunk runs: the stage split.

The layers are identical, so a split is a count per chunk, ``k_0 .. k_{C-1}`` summing to the
layer count.  In lock-step ticks a tick lasts as long as the busiest stage, so the step time is
governed by the most expensive chunk: the first chunk also runs the prologue (embedding), the
last the epilogue and its backward (head and loss).  The split minimises that maximum, priced by
the cost model (the plan's FLOPs at the profile's FLOP rate plus its collectives, per
micro-batch), by dynamic programming over contiguous partitions (Alpa's stage DP, here with the
lock-step objective), under the memory budget: the weights are stacked with as many slots as the
largest chunk, so a per-device memory estimate bounds ``max k``.  Among splits within 2% of the
fastest, the one with the fewest slots (least memory) wins.  A padded chunk (fewer layers than
the slots) is not free: every stage walks all the slots, an idle one under ``lax.cond`` passing
its input through and zeroing its weights' gradients (``idle_s`` per idle slot, its forward).

>>> s = choose_split(8, stages=2, repeats=1, layer_s=1.0, prologue_s=0.1, epilogue_s=7.0)
>>> s.counts  # head and loss, forward and backward, cost more than two layers: one layer moves
(5, 3)
"""

from __future__ import annotations

import dataclasses

BACKWARD_FACTOR = 2.0  # a layer's backward costs about twice its forward (two matmuls per one)
SLACK = 0.02  # splits within 2% of the fastest count as equally fast


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Layers per chunk, with what the split was priced at.

    Attributes:
      counts: layers per chunk ``c`` (chunk ``c`` runs on stage ``c % S``).
      stages: ``S``.
      layer_s: seconds of one layer's forward for one micro-batch (cost model).
      prologue_s: the prologue's forward (first chunk).
      epilogue_s: the epilogue's forward and backward (last chunk).
      layer_bytes: one layer's weights per device.
      residual_bytes: one layer's saved activations per micro-batch per device (estimate).
      how: ``"balanced"`` (chosen here) or ``"markers"`` (the user's stage markers).
      even_cost_s: the slowest chunk of the even split, for comparison.
      fits: whether the memory estimate fits the budget.
      memory_bytes: the memory estimate per device the budget was checked with, for this
        split's slots (``early.early_memory``; 0 for marked stages: not checked).
      idle_s: an idle slot's forward (a padded chunk's slots beyond its layers).
    """

    counts: tuple[int, ...]
    stages: int
    layer_s: float = 0.0
    prologue_s: float = 0.0
    epilogue_s: float = 0.0
    layer_bytes: float = 0.0
    residual_bytes: float = 0.0
    how: str = "balanced"
    even_cost_s: float = 0.0
    fits: bool = True
    memory_bytes: float = 0.0
    idle_s: float = 0.0

    @property
    def chunks(self) -> int:
        return len(self.counts)

    @property
    def slots(self) -> int:
        """Layer slots per chunk in the stacked weights: the largest chunk."""
        return max(self.counts)

    @property
    def padded(self) -> bool:
        """Whether some chunk is shorter than the stacked slots (its last slots idle)."""
        return min(self.counts) != max(self.counts)

    def first_layer(self, chunk: int) -> int:
        return sum(self.counts[:chunk])

    def chunk_forward_s(self) -> tuple[float, ...]:
        """Per chunk, its forward seconds per micro-batch (without prologue and epilogue)."""
        return tuple(k * self.layer_s for k in self.counts)

    def chunk_cost_s(self, chunk: int) -> float:
        """A chunk's forward and backward, with the prologue or epilogue it carries."""
        return _chunk_cost(self.counts[chunk], chunk, self.chunks, self.layer_s,
                           self.prologue_s, self.epilogue_s, self.slots, self.idle_s)

    def stage_lines(self) -> list[str]:
        out = []
        for s in range(self.stages):
            parts = []
            for c in range(s, self.chunks, self.stages):
                a = self.first_layer(c)
                rng = f"layer {a}" if self.counts[c] == 1 else \
                    f"layers {a}-{a + self.counts[c] - 1}"
                extra = (" + prologue" if c == 0 else "") + \
                    (" + epilogue" if c == self.chunks - 1 else "")
                parts.append(f"{rng}{extra} ({_ms(self.chunk_cost_s(c))} fwd+bwd)")
            out.append(f"stage {s}: " + ", ".join(parts))
        return out


def _chunk_cost(k: int, chunk: int, chunks: int, layer_s: float, prologue_s: float,
                epilogue_s: float, slots: int = 0, idle_s: float = 0.0) -> float:
    cost = (k * layer_s + max(slots - k, 0) * idle_s) * (1.0 + BACKWARD_FACTOR)
    if chunk == 0:
        cost += prologue_s * (1.0 + BACKWARD_FACTOR)
    if chunk == chunks - 1:
        cost += epilogue_s
    return cost


def choose_split(layers: int, *, stages: int, repeats: int, layer_s: float,
                 prologue_s: float = 0.0, epilogue_s: float = 0.0,
                 max_slots: int | None = None, layer_bytes: float = 0.0,
                 residual_bytes: float = 0.0, fits: bool = True,
                 idle_s: float = 0.0) -> StageSplit:
    """The split of ``layers`` identical layers into ``stages * repeats`` chunks whose most
    expensive chunk is cheapest, with at most ``max_slots`` layers per chunk (memory).

    Raises:
      ValueError: fewer layers than chunks (the caller turns it into a PlanError).
    """
    C = stages * repeats
    if layers < C:
        raise ValueError(f"{layers} layers cannot fill {C} chunks")
    even = -(-layers // C)
    cap = max(even, min(max_slots or layers, layers - C + 1))
    # each slot count priced with its idle slots (a chunk shorter than the slots pays them)
    best = {k: _partition(layers, C, k, layer_s, prologue_s, epilogue_s, idle_s)
            for k in range(even, cap + 1)}
    fastest = min(worst for worst, _ in best.values())
    # Costs are estimates: among splits within SLACK of the fastest, the fewest slots win
    # (stacked weights and residuals grow with the largest chunk).
    for k in range(even, cap + 1):
        worst, counts = best[k]
        if worst <= fastest * (1.0 + SLACK) + 1e-30:
            break
    base = [layers // C + (1 if c < layers % C else 0) for c in range(C)]
    even_cost = max(_chunk_cost(k, c, C, layer_s, prologue_s, epilogue_s, even, idle_s)
                    for c, k in enumerate(base))
    return StageSplit(tuple(counts), stages, layer_s, prologue_s, epilogue_s, layer_bytes,
                      residual_bytes, "balanced", even_cost, fits, idle_s=idle_s)


def _partition(layers: int, C: int, cap: int, layer_s: float, prologue_s: float,
               epilogue_s: float, idle_s: float = 0.0) -> tuple[float, list[int]]:
    """The contiguous split of ``layers`` into ``C`` chunks of at most ``cap`` layers whose
    slowest chunk is fastest, each chunk walking ``cap`` slots: ``(its cost, counts)``; ties
    go to the most even split."""
    inf = float("inf")
    best = [[(inf, inf)] * (layers + 1) for _ in range(C + 1)]  # (slowest, spread)
    choice = [[0] * (layers + 1) for _ in range(C + 1)]
    best[0][0] = (0.0, 0)
    for c in range(1, C + 1):
        for i in range(c, layers - (C - c) + 1):
            for k in range(1, min(cap, i - (c - 1)) + 1):
                prev = best[c - 1][i - k]
                if prev[0] == inf:
                    continue
                cost = _chunk_cost(k, c - 1, C, layer_s, prologue_s, epilogue_s, cap, idle_s)
                cand = (max(prev[0], cost), max(prev[1], k))
                if cand < best[c][i]:
                    best[c][i], choice[c][i] = cand, k
    counts = []
    i = layers
    for c in range(C, 0, -1):
        counts.append(choice[c][i])
        i -= choice[c][i]
    counts.reverse()
    return best[C][layers][0], counts


def marked_split(regions: int, *, stages: int, layer_s: float, prologue_s: float,
                 epilogue_s: float, layer_bytes: float, residual_bytes: float) -> StageSplit:
    """One marked region per chunk, as the user placed them."""
    counts = (1,) * regions
    cost = max(_chunk_cost(1, c, regions, layer_s, prologue_s, epilogue_s)
               for c in range(regions))
    return StageSplit(counts, stages, layer_s, prologue_s, epilogue_s, layer_bytes,
                      residual_bytes, "markers", cost, True)


def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"

