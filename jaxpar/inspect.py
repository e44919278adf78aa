"""What XLA did with a program: collectives, per-device memory and FLOPs.

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
from jaxpar._src.yardstick import Yardstick as Yardstick
from jaxpar._src.yardstick import yardstick as yardstick

__all__ = ["CollectiveRecord", "Collectives", "collectives", "flops", "hlo_text", "memory",
           "saved_activations", "Yardstick", "yardstick"]
