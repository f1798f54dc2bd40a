"""Phones as clients: device programs, their runtime, the reference device, the gateway."""
