"""Models: the target and small families, slicing, pretrained bases, adapters, sampling."""
