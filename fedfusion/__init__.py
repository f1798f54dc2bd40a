"""fedfusion: every device trains what it can hold, and one large model learns from all of them."""

__version__ = "0.1.0"
