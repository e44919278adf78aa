"""Strategy searches over an :class:`OpGraph`; every one respects the pins it is given.

Importing this package registers the built-in search modes (``modes.py``); the planner runs a
mode by name through the registry (``registry.py``).
"""

from jaxpar._src.search import modes
from jaxpar._src.search.common import Assignment, Pin, SearchSpace
from jaxpar._src.search.propagation import propagate
from jaxpar._src.search.registry import (
    Search,
    SearchReport,
    SearchRequest,
    SearchResult,
    get_search,
    register_search,
    search_modes,
)

__all__ = ["Assignment", "Pin", "Search", "SearchReport", "SearchRequest", "SearchResult",
           "SearchSpace", "get_search", "propagate", "register_search",
           "search_modes"]
del modes
