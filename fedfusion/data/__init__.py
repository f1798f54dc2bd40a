"""Client data: sources, partitioners, tokenizers, and the population (who holds what)."""
