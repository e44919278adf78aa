"""Strategy searches over an :class:`OpGraph`; every one respects the pins it is given."""

from jaxpar._src.search.common import Assignment, Pin, SearchSpace
from jaxpar._src.search.propagation import best_response, propagate

__all__ = ["Assignment", "Pin", "SearchSpace", "best_response", "propagate"]
