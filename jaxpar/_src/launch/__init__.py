"""Beyond one process: jax.distributed start-up, the local launcher, Kubernetes manifests."""
