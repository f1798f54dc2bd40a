"""Flower client-side roles (installed as ``fedfusion.clients``)."""
