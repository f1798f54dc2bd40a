"""Fusion methods without Flower: one object per method (width slicing, LoRA, distillation, generative) behind
the :class:`~fedfusion.fusion.base.FusionMethod` protocol; the Flower strategy and the in-process driver run them.

Each method lives in its own folder (``fedfusion.fusion.submodel``, ``.lora``, ``.distill``, ``.generative``): the
method, its ``build``, its plan view and, where it has them, what floors below read: its recipe section
(``config.py``, on the config floor), its message specs (``spec.py``, the wire floor) and its reply format
(``reply.py``, the models floor). This package imports nothing, so the recipe composes a method's section, and a
client role reads its spec, without loading anything else.
"""
