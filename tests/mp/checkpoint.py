"""A checkpoint saved by one job and loaded by another, for tests/test_checkpoint_mp.py:

    jaxpar run -n 2 --devices-per-process 4 tests/mp/checkpoint.py save DIR
    jaxpar run -n 4 --devices-per-process 2 tests/mp/checkpoint.py load DIR OUT

``save`` writes a train state (parameters and two optimizer moments, 192 MiB of incompressible
float32) laid out on a (dp=2, mp=4) mesh over the devices of every process.  ``load`` reads it
onto an 8-device layout the saver did not use; each process then checks its shards against the
values, and writes to ``OUT/rank_<r>.json`` the growth of its peak RSS during the load, the
bytes it read from files, and (rank 0) the checksums of what was loaded.
"""

import json
import os
import resource
import sys

import jaxpar

jaxpar.init()  # before anything touches a device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SHAPES = {"w1": (2048, 4096), "w2": (4096, 2048)}


def values() -> dict:
    """The state, the same in every process (each keeps only its devices' shards)."""
    rng = np.random.default_rng(0)
    params = {k: rng.random(s, dtype=np.float32) for k, s in SHAPES.items()}
    mu = {k: rng.random(s, dtype=np.float32) for k, s in SHAPES.items()}
    nu = {k: rng.random(s, dtype=np.float32) for k, s in SHAPES.items()}
    return {"params": params, "opt_state": ({"mu": mu, "nu": nu},)}


def serving_layouts(mesh) -> dict:
    """Columns of w1 and rows of w2 over 8 devices; the moments follow their parameters."""
    return {"w1": NamedSharding(mesh, P(None, "x")), "w2": NamedSharding(mesh, P("x"))}


def save(directory: str) -> None:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    specs = {"w1": P("dp", "mp"), "w2": P("mp", "dp")}

    def place(path, x):
        spec = specs[path[-1].key]
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    state = jax.tree_util.tree_map_with_path(place, values())
    jaxpar.save_checkpoint(state, directory)
    jaxpar.save_checkpoint({"x": jnp.zeros(8)}, directory + "_warm")  # see load()


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(directory: str, out: str) -> None:
    mesh = jaxpar.make_mesh((jax.device_count(),), ("x",))
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                            {"params": SHAPES, "opt_state": ({"mu": SHAPES, "nu": SHAPES},)},
                            is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], int))
    # first use of orbax, tensorstore and the cross-process sums: paid before measuring
    jaxpar.load_distributed_checkpoint({"x": jnp.zeros(8)}, directory + "_warm")
    rss0, read0 = _rss_now(), _io("rchar")
    state = jaxpar.load_distributed_checkpoint(abstract, directory,
                                               predict_strategy=serving_layouts(mesh))
    jax.block_until_ready(state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rss_growth": peak - rss0, "read": _io("rchar") - read0}
    want = values()
    ok = True
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(want),
                              strict=True):
        assert got.sharding.spec == serving_layouts(mesh)[path[-1].key].spec
        for shard in got.addressable_shards:
            ok &= np.asarray(shard.data).tobytes() == w[shard.index].tobytes()
    result["shards_equal"] = bool(ok)
    from jaxpar._src.checkpoint import digest

    result["sums"] = digest.tree_sums(jax.tree.leaves(state))
    with open(os.path.join(out, f"rank_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {jaxpar.get_rank()} of {jaxpar.get_group_size()}: loaded", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        load(sys.argv[2], sys.argv[3])
