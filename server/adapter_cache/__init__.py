"""Adapter cache tiers: L1 in-process LRU (materialised, on the model device), L2 Redis
(safetensors bytes under versioned keys), L3 computed from the store's skills + routing."""
