"""The benchmarked systems, one module each: ``unicron``, ``torchrun``, ``torchft``, ``ddp``."""
