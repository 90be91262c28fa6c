"""Baseline training scripts: the same model, data and faults as Unicron, without Unicron."""
