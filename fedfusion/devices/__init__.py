"""Device tiers: the catalog, energy and carbon pricing, training memory (what a way of training holds on a tier),
availability, meters, the host's accelerator."""
