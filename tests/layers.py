"""The layer map of zinf and its front ends, bottom up: ``tests/unit/test_package_structure.py`` checks that no import
points to a higher layer, ``tests/distributed/test_forward_walk.py`` that no call on the forward path does."""

from __future__ import annotations

# Every module of the three packages in one layer, bottom up; a module imports (annotation-only imports included)
# only modules of its own layer or of a lower one. A name matches itself and the modules below it; the longest match
# wins (``zinf.integrations``, the registry the wiring calls, sits low; the glue modules in it sit high).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("zinf.errors", "zinf.units", "zinf.config_types", "zinf.config_sections", "zinf.config_build",
              "zinf.config", "zinf.device_memory", "zinf.report", "zinf.heap", "zinf.host_memory", "zinf.host_room",
              "zinf.file_io",
              "zinf._native", "zinf.integrations")),
    ("native", ("zinf.native",)),
    ("runtime", ("zinf.runtime",)),
    ("param", ("zinf.param",)),
    ("modules", ("zinf.tiling", "zinf.frozen_linear")),
    ("schedule", ("zinf.schedule",)),
    ("offload", ("zinf.offload",)),
    ("optim", ("zinf.optim", "zinf.update")),
    ("model state", ("zinf.checkpoint", "zinf.placement", "zinf.recompute", "zinf.shutdown", "zinf.plan",
                     "zinf.compiling", "zinf.forward_pass", "zinf.backward_pass")),
    ("wiring", ("zinf.engine", "zinf.init")),
    ("face", ("zinf.integrations.after_import", "zinf.integrations.quantized", "zinf.integrations.trainer",
              "zinf.integrations.transformers", "zinf.inspect_cli", "zinf.hydra_configs", "zinf.utils", "zinf")),
    ("front ends", ("lightning_zinf", "accelerate_zinf")),
    ("commands", ("zinf.cli",)),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module``'s layer; None for a module of none (torch, ...)."""
    best: tuple[int, int] | None = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (index, len(name))
    return None if best is None else best[0]
