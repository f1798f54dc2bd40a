"""Device tiers: the catalog, energy and carbon pricing, availability, meters, the host's accelerator."""
