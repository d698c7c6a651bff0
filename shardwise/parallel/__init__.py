"""One module per way of splitting training; each applies itself to a model."""
