"""Width-sliced sub-models (HeteroFL, FedRolex, Federated Dropout, FjORD)."""
