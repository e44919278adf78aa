"""Which server holds which parameter tensor: split by size, as evenly as the tensors allow.

>>> assign_by_size([100, 10, 60, 50], 2)
(0, 0, 1, 1)
>>> assign_by_size([4, 4, 4], 3)
(0, 1, 2)
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpar._src.errors import PSError


def assign_by_size(sizes: Sequence[int], num_servers: int) -> tuple[int, ...]:
    """Largest tensor first onto the least loaded server (ties: the lower index); every
    server gets at least one tensor.

    >>> from jaxpar import ps
    >>> ps.assign_by_size([100, 10, 60, 50], num_servers=2)  # 100+10 on server 0, 60+50 on 1
    (0, 0, 1, 1)
    """
    if len(sizes) < num_servers:
        raise PSError(f"ParameterServerTrainer: {num_servers} servers but only {len(sizes)} "
                      f"parameter tensors; every server needs one. Use server_num <= "
                      f"{len(sizes)}.")
    load = [0] * num_servers
    owner = [0] * len(sizes)
    for leaf in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        owner[leaf] = server
        load[server] += sizes[leaf]
    return tuple(owner)
