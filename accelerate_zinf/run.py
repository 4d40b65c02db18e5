"""``python -m accelerate_zinf.run script.py [args]``: run an unchanged Accelerate script on zinf.

``zinf launch`` starts this module on every rank (through ``accelerate launch -m``). It makes
``accelerate.Accelerator`` mean :class:`accelerate_zinf.Accelerator` before the script (or a library
it imports, such as transformers' ``Trainer``) looks it up, and makes transformers' ``from_pretrained``
(in the script, or in TRL given a model name) build the model partitioned over all ranks with the launch's engine
config (joining the ranks first if the script loads before building its Accelerator) and load it streaming (see
[Note: from_pretrained under zinf] in zinf/integrations/transformers.py) and transformers' ``Trainer`` save and
resume the engine ([Note: Trainer checkpoints under zinf] in zinf/integrations/trainer.py): zinf's integrations are
activated here, before the script runs. Then it runs the script as ``__main__`` with the script's own command line.
``--module name`` runs a module instead of a file.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys

import accelerate
import accelerate.accelerator
from accelerate.state import PartialState
from accelerate.utils import parse_flag_from_env

from accelerate_zinf.accelerator import Accelerator
from accelerate_zinf.settings import engine_config, with_mixed_precision
from zinf import integrations
from zinf.integrations import transformers as hf_models

__all__ = ["install", "main"]


def install() -> None:
    """Make ``from accelerate import Accelerator`` (in scripts and in libraries imported after this call)
    give the zinf Accelerator; it is a subclass, so ``isinstance`` checks against Accelerate's still hold."""
    accelerate.Accelerator = Accelerator  # type: ignore[misc]
    accelerate.accelerator.Accelerator = Accelerator  # type: ignore[misc]
    already = [name for name, mod in sys.modules.items()
               if name.startswith("transformers.trainer") and getattr(mod, "Accelerator", None) is not None]
    for name in already:  # imported before us (a sitecustomize, a plugin): point them at ours too
        sys.modules[name].Accelerator = Accelerator  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m accelerate_zinf.run script.py [args...] | --module name [args...]")
    install()
    integrations.activate()  # from_pretrained and Trainer's saving and resuming on zinf, before the script runs
    # the engine config as the Accelerator will see it (ZINF_CONFIG, with the launch's mixed precision), so the
    # groups from_pretrained builds are the ones the engine keeps
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    hf_models.enable(with_mixed_precision(engine_config(), mixed), start=_join_ranks)
    if args[0] == "--module":
        if len(args) < 2:
            raise SystemExit("accelerate_zinf.run: --module needs a module name")
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` does
    namespace = runpy.run_path(args[0], run_name="__main__")
    _finish(namespace)


def _join_ranks() -> None:
    """A ``from_pretrained`` runs before the script built its Accelerator (or Trainer): start the launch's process
    group now, as they will (Accelerate's ``PartialState``, which they reuse), so that the model is partitioned over
    every rank instead of being built whole on each one."""
    PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def _finish(namespace: dict) -> None:
    """The script ended normally: end the process as Python would (the script's objects released, so its
    open files are flushed and closed; exit handlers run, zinf's swap-file removal among them), then leave
    without the interpreter's own teardown, where torch 2.13's gloo threads can abort a run that succeeded
    ("terminate called without an active exception"; docs/known_issues.md), which ``accelerate launch``
    would report as a failed run and answer by stopping the other ranks."""
    namespace.clear()
    gc.collect()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
