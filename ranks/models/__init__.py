"""Model families (registry, families/) and the torch modules that run them."""
