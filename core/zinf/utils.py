"""Helpers for code that drives a zinf engine from outside (front ends, training loops).

``map_tensors`` is the walk the engine itself uses on a module's inputs: every tensor in a nested structure
(tuples, lists, dicts, named tuples, registered pytree nodes such as ``transformers``' ``ModelOutput``, plain
dataclasses) replaced by a function of it, the structure rebuilt around the results.
"""

from zinf.schedule.tensors import map_tensors

__all__ = ["map_tensors"]
