"""Eight emulated CPU devices for every test and doctest, set before JAX starts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import jaxpar  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_context():
    """Every test starts from the default auto-parallel context."""
    jaxpar.reset_auto_parallel_context()
    jaxpar.reset_algo_parameters()
    jaxpar.set_context(mode=jaxpar.GRAPH_MODE)
    yield
    jaxpar.reset_auto_parallel_context()
    jaxpar.reset_algo_parameters()
    jaxpar.set_context(mode=jaxpar.GRAPH_MODE)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(jaxpar=jaxpar, jnp=jnp, P=PartitionSpec,
                             make_mesh=jaxpar.make_mesh, jax=jax)
