"""Training runtime: gradient reduction, replicas, seeds, mixed precision, the Model API."""
