"""The recipe: its typed schema, loading with overrides, and every allowed-value list. Imports nothing of fedfusion."""
