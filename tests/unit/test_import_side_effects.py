"""``import zinf`` changes nothing in the process ([Note: integrations are activated, not imported] in
zinf/integrations/__init__.py): no finder in ``sys.meta_path``, no import hook, and transformers' ``PreTrainedModel``
and ``Trainer`` keep their own methods, whether transformers was imported before zinf or after it. Entering
``zinf.Init`` does wrap them: at once for a module already loaded, through an import hook for one loaded later.

Each case runs in a fresh interpreter (nothing of this test session's imports can leak in). The methods checked are
the ones the integrations wrap; the scripts check that their lists are the integrations' ``_WRAPPED``."""

from __future__ import annotations

import sys

import pytest

import processes

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # two fresh interpreters importing torch and transformers: about 11 s

_COMMON = """
import builtins, sys

MODEL = ("from_pretrained", "get_init_context", "_load_pretrained_model", "_move_missing_keys_from_meta_to_device",
         "_initialize_missing_keys")
TRAINER = ("_save", "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
           "_load_best_model")


def hooks():
    # every way code can run when a module is imported later
    return ([(id(f), type(f)) for f in sys.meta_path], [id(h) for h in sys.path_hooks], id(builtins.__import__))


def zinf_hooks():
    return [h for h in sys.meta_path + sys.path_hooks if type(h).__module__.split(".")[0] == "zinf"]


def methods(cls, names):
    return {n: cls.__dict__.get(n) for n in names}


def same(before, after):
    return all(after[n] is before[n] for n in before)


def owner(cls, name):
    attr = cls.__dict__[name]
    return getattr(attr, "__func__", attr).__module__


def import_zinf():
    import zinf
    import zinf.integrations.trainer, zinf.integrations.transformers  # importing them does nothing either
    assert zinf.integrations.trainer._WRAPPED == TRAINER, zinf.integrations.trainer._WRAPPED
    assert zinf.integrations.transformers._WRAPPED == MODEL, zinf.integrations.transformers._WRAPPED
    assert not zinf.integrations.active()
    return zinf
"""

_TRANSFORMERS_FIRST = _COMMON + """
import transformers.modeling_utils, transformers.trainer
from transformers import PreTrainedModel, Trainer

hooks0, model0, trainer0 = hooks(), methods(PreTrainedModel, MODEL), methods(Trainer, TRAINER)
assert all(owner(PreTrainedModel, n) == "transformers.modeling_utils" for n in MODEL)
zinf = import_zinf()
assert hooks() == hooks0, (hooks0, hooks())
assert same(model0, methods(PreTrainedModel, MODEL)), "import zinf replaced a PreTrainedModel method"
assert same(trainer0, methods(Trainer, TRAINER)), "import zinf replaced a Trainer method"

with zinf.Init(zinf.ZeroConfig()):  # both modules are loaded: wrapped at once, no import hook needed
    pass
assert zinf.integrations.active()
assert hooks() == hooks0, (hooks0, hooks())
assert all(owner(PreTrainedModel, n) == "zinf.integrations.transformers" for n in MODEL), \
    methods(PreTrainedModel, MODEL)
assert all(owner(Trainer, n) == "zinf.integrations.trainer" for n in TRAINER), methods(Trainer, TRAINER)
print("ok")
"""

_ZINF_FIRST = _COMMON + """
hooks0 = hooks()
zinf = import_zinf()
assert hooks() == hooks0, (hooks0, hooks())
assert not [m for m in sys.modules if m.split(".")[0] == "transformers"], "import zinf imported transformers"
assert "torch._dynamo" not in sys.modules, "import zinf imported torch._dynamo (a torch.compiler call at import)"

import transformers.modeling_utils
from transformers import PreTrainedModel

assert "transformers.trainer" not in sys.modules
# transformers adds finders of its own; none is zinf's, so nothing of zinf runs when transformers.trainer is imported
assert not zinf_hooks() and hooks()[2] == hooks0[2], (hooks0, hooks())
assert all(owner(PreTrainedModel, n) == "transformers.modeling_utils" for n in MODEL), methods(PreTrainedModel, MODEL)

finders = list(sys.meta_path)
with zinf.Init(zinf.ZeroConfig()):  # modeling_utils is loaded: wrapped at once; trainer is not: an import hook
    pass
assert all(owner(PreTrainedModel, n) == "zinf.integrations.transformers" for n in MODEL), \
    methods(PreTrainedModel, MODEL)
assert [f for f in sys.meta_path if not any(f is g for g in finders)] == zinf_hooks() and len(zinf_hooks()) == 1
from transformers import Trainer

assert all(owner(Trainer, n) == "zinf.integrations.trainer" for n in TRAINER), methods(Trainer, TRAINER)
print("ok")
"""


def _run(script: str) -> None:
    proc = processes.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout


def test_import_zinf_after_transformers_changes_nothing_until_init() -> None:
    _run(_TRANSFORMERS_FIRST)


def test_import_zinf_before_transformers_changes_nothing_until_init() -> None:
    _run(_ZINF_FIRST)
