"""Semi-automatic Megatron MLP and sharding propagation, checked against one device.

    python examples/megatron_mlp.py [--smoke]

1. Both weights annotated (column split, then row split) and the batch on ``dp``: one
   all-reduce over ``mp`` in the forward pass.
2. Only the first matmul annotated with ``jaxpar.shard``: propagation row-splits the second
   weight by itself, and the program is the same.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar  # noqa: E402


def mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="smaller sizes for CI")
    args = parser.parse_args(argv)
    b, d, h = (16, 64, 128) if args.smoke else (64, 1024, 4096)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, d))
    w1 = jax.random.normal(k[1], (d, h)) / np.sqrt(d)
    w2 = jax.random.normal(k[2], (h, d)) / np.sqrt(h)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))

    annotated = jaxpar.parallelize(mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                                   in_strategy=((2, 1), (1, 4), (4, 1)))
    print("1. every weight annotated")
    print(annotated.plan(x, w1, w2).explain())
    print(jaxpar.inspect.collectives(annotated.lower(x, w1, w2)).table())
    err = float(jnp.max(jnp.abs(annotated(x, w1, w2) - mlp(x, w1, w2))))
    print(f"max |parallel - single device| = {err:.2e}\n")

    def one_annotation(x, w1, w2):
        first = jaxpar.shard(lambda x, w: x @ w, in_strategy=((2, 1), (1, 4)))
        return jax.nn.relu(first(x, w1)) @ w2

    propagated = jaxpar.parallelize(one_annotation, mesh=mesh, parallel_mode="semi_auto_parallel")
    print("2. only the first matmul annotated; the rest propagated")
    plan = propagated.plan(x, w1, w2)
    print(plan.explain())
    print("w2 layout chosen by propagation:", plan.input_layouts()["w2"])
    print(jaxpar.inspect.collectives(propagated.lower(x, w1, w2)).table())
    err = float(jnp.max(jnp.abs(propagated(x, w1, w2) - mlp(x, w1, w2))))
    print(f"max |parallel - single device| = {err:.2e}")


if __name__ == "__main__":
    main()
