"""Mixed precision: AMP levels as a jaxpr transform, and loss scaling."""
