"""Pausing Python's cyclic garbage collector while jaxpar plans.

Tracing, planning and lowering allocate millions of small objects (jaxpr equations, layouts,
strategies, cost tables) that all live until the plan is built.  Each collection of the oldest
generation rescans every one of them, so the collector's cost grows with the square of the
model: at 24 GPT layers it was a third of jaxpar's time.  Nothing is freed by collecting then,
so jaxpar pauses the collector for the duration, as compilers written in Python commonly do.

Turning the collector back on is not free either: everything made during the pause is in the
youngest generation, so the next allocation collects it all (a plan's survivors: 0.35-0.4 s at
24 GPT layers), and ten collections later the middle generation rescans the same objects again
(during the first call's placing of the arguments: another 0.4 s).  Neither freed anything
there.  So after a pause that made many objects, they go straight to the oldest generation
(``gc.freeze()`` then ``gc.unfreeze()``: two list splices, no scan), where only a full collection
visits them, as it would visit them after the two scans anyway (measured after the 24-layer
GPT step's plan, load 9: the young scan 0.37 s CPU, the middle one 0.18 s).  The price: cyclic
garbage made during the pause is freed by the next full collection instead of the next young
one (after that plan, 246k objects, mostly the search's tuples and sets: host memory held a
while longer, never leaked).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# Objects made (net) during a pause above which they are moved to the oldest generation: a
# trace, a plan or a lowering (hundreds of thousands); a call that only dispatches makes a few.
PROMOTE_ABOVE = 20_000


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Runs the block with the cyclic collector off (restored after, also on errors).

    >>> import gc
    >>> with paused_gc():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            _promote()
            gc.enable()


def _promote() -> None:
    """Moves every tracked object to the oldest generation without scanning it, when the pause
    made more than :data:`PROMOTE_ABOVE` (and nobody else has frozen objects: ``unfreeze``
    would release theirs too).

    >>> import gc
    >>> gc.disable(); keep = [[] for _ in range(PROMOTE_ABOVE + 1)]; _promote(); gc.enable()
    >>> gc.get_count()[0] < PROMOTE_ABOVE, gc.get_freeze_count()
    (True, 0)
    """
    if gc.get_count()[0] > PROMOTE_ABOVE and not gc.get_freeze_count():
        gc.freeze()  # every generation into the permanent one (young count reset) ...
        gc.unfreeze()  # ... and all of it back into the oldest
