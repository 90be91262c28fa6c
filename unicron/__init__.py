"""Unicron: self-healing large-model training on PyTorch's distributed engine.

The public worker-facing API is :mod:`unicron.worker`: :func:`~unicron.worker.train`, or the
step API (:class:`~unicron.worker.Loop`) for a script with its own loop; the command line is
``unicron`` (see :mod:`unicron.cli`).
"""

__version__ = "0.1.0"
