"""What a run's report says of generative distillation (its registry entry's ``report_note`` and ``trained``)."""

from __future__ import annotations

from typing import Any

# under "Who did the work": what the ledger leaves out of a generative client's price
NOTE = " A client's sampling (writing the windows it sends) is not priced; the samples' bytes are, in its upload."


def trained(client: dict[str, Any]) -> str:
    """What one client round trained, from its ledger row: the device's own model, or in a grow round (its row
    names the forward pass) the small model every device trains together."""
    if "forward" in client:
        return f"the small model every device holds (the static slice at width {client['width']:g}), before growth"
    return f"its own model (the static slice at width {client['width']:g})"
