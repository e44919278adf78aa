"""What XLA did with a program: collectives, per-device memory and FLOPs; and the searches side
by side on a program (:func:`compare_searches`).

>>> import jaxpar
>>> callable(jaxpar.inspect.collectives)
True
"""

from jaxpar._src.inspection import CollectiveRecord as CollectiveRecord
from jaxpar._src.inspection import Collectives as Collectives
from jaxpar._src.inspection import collectives as collectives
from jaxpar._src.inspection import flops as flops
from jaxpar._src.inspection import hlo_text as hlo_text
from jaxpar._src.inspection import memory as memory
from jaxpar._src.inspection import saved_activations as saved_activations
from jaxpar._src.search.compare import SearchComparison as SearchComparison
from jaxpar._src.search.compare import compare_searches as compare_searches
from jaxpar._src.yardstick import Yardstick as Yardstick
from jaxpar._src.yardstick import yardstick as yardstick

__all__ = ["CollectiveRecord", "Collectives", "SearchComparison", "collectives",
           "compare_searches", "flops", "hlo_text", "memory", "saved_activations", "Yardstick",
           "yardstick"]
