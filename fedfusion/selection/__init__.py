"""Who trains in a round: selectors and the participation draw."""
