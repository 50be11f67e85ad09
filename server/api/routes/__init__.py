"""One routes module per resource."""
