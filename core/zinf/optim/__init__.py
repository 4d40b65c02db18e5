"""Optimizers for zinf."""

from zinf.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
