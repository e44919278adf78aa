"""The searches side by side on one program: what each plan costs as XLA runs it, and how long
each search took.  The benchmark calls it on its models to check that the fast searches stay
close to one another (``recursive_programming`` within 2% of ``dynamic_programming``) and to the
exact optimum.

>>> import jax.numpy as jnp
>>> import jaxpar
>>> mesh = jaxpar.make_mesh((4,), ("x",))
>>> def loss(w, x):
...     return jnp.mean(jnp.tanh(x @ w) ** 2)
>>> c = compare_searches(loss, jnp.ones((16, 16)), jnp.ones((64, 16)), mesh=mesh)
>>> c.gap("recursive_programming") <= 0.02
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MODES = ("recursive_programming", "dynamic_programming", "optimal")


@dataclasses.dataclass(frozen=True)
class SearchComparison:
    """Per search mode: the plan's simulated seconds per call (combined collectives, as
    ``ShardingPlan.step_time``) and the search's wall seconds.

    >>> c = SearchComparison({"optimal": 1e-3, "dynamic_programming": 1.1e-3}, {})
    >>> round(c.gap("optimal"), 3)
    -0.091
    """

    step_s: Mapping[str, float]
    search_s: Mapping[str, float]

    def gap(self, mode: str, reference: str = "dynamic_programming") -> float:
        """How much more ``mode``'s plan costs than ``reference``'s (0.02 = 2% more)."""
        return self.step_s[mode] / self.step_s[reference] - 1.0


def compare_searches(fn: Callable, *args: Any, mesh: Any, hardware: Any = None,
                     modes: Sequence[str] = MODES, **options: Any) -> SearchComparison:
    """Plans ``fn(*args)`` with every search in ``modes`` (``options`` go to
    ``jaxpar.parallelize``) and returns their costs and search times.

    >>> import jax.numpy as jnp, jaxpar
    >>> c = compare_searches(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 8)), jnp.ones((16, 8)),
    ...                      mesh=jaxpar.make_mesh((2,), ("x",)), modes=("optimal",))
    >>> sorted(c.step_s), c.search_s["optimal"] >= 0
    (['optimal'], True)
    """
    from jaxpar._src.api import parallelize

    step, took = {}, {}
    for mode in modes:
        entry = parallelize(fn, mesh=mesh, parallel_mode="auto_parallel", search_mode=mode,
                            hardware=hardware, **options).compiled_entry(*args)
        step[mode] = entry.plan.step_time()
        took[mode] = entry.timings["search"]
    return SearchComparison(step, took)
