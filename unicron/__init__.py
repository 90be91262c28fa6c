"""Unicron: self-healing large-model training on PyTorch's distributed engine.

The public worker-facing API is :func:`unicron.worker.train`; the command line is
``unicron`` (see :mod:`unicron.cli`).
"""

__version__ = "0.1.0"
