"""``zinf launch --config run.yaml [accelerate launch options] script.py [script args]``.

``run.yaml`` is an Accelerate config file plus a ``zinf:`` section with the engine settings. Before any
process starts the file is checked (:func:`accelerate_zinf.settings.check_launch_config`, then
Accelerate's own loader, which rejects unknown keys); then Accelerate's part is written to a temporary
config file, the engine part to a temporary YAML named by ``ZINF_CONFIG``, and ``accelerate launch``
runs :mod:`accelerate_zinf.run` on every rank, which runs the unchanged script on zinf. Everything else
on the command line goes to ``accelerate launch`` and the script as given.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import yaml
from omegaconf import OmegaConf

from accelerate_zinf.settings import ENV_CONFIG, check_launch_config
from zinf.errors import ConfigError

__all__ = ["main", "build_command"]

log = logging.getLogger(__name__)

_USAGE = ("usage: zinf launch --config FILE [accelerate launch options] script.py [script args]\n"
          "  FILE: an Accelerate config with a zinf: section (see examples/accelerate/)")


def _split(argv: list[str]) -> tuple[str | None, list[str], list[str], argparse.Namespace]:
    """(config path, accelerate launch options without it, script and its arguments, parsed options).
    ``--config`` is accepted as a spelling of Accelerate's ``--config_file`` before the script."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    toks, i = list(argv), 0
    while i < len(toks):  # up to the script: options, and the values of those that take one
        tok = toks[i]
        if tok == "--config" or tok.startswith("--config="):
            toks[i] = tok.replace("--config", "--config_file", 1)
            break
        if tok == "--config_file" or tok.startswith("--config_file=") or not tok.startswith("-"):
            break
        action = parser._option_string_actions.get(tok)  # noqa: SLF001 - which options take a value
        i += 2 if action is not None and action.nargs != 0 else 1
    ns = parser.parse_args(toks)
    script_at = len(toks) - len(ns.training_script_args) - 1
    options, skip = [], False
    for tok in toks[:script_at]:
        if skip:
            skip = False
        elif tok == "--config_file":
            skip = True
        elif not tok.startswith("--config_file="):
            options.append(tok)
    return ns.config_file, options, toks[script_at:], ns


def build_command(argv: list[str], workdir: str) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment for ``zinf launch argv``; writes the two
    temporary config files into ``workdir``. Raises ConfigError for anything wrong with the config."""
    from accelerate.commands.config.config_args import ClusterConfig

    path, options, script, ns = _split(argv)
    if path is None:
        raise ConfigError(f"zinf launch: no config given.\n{_USAGE}")
    if not os.path.isfile(path):
        raise ConfigError(f"zinf launch: the config file {path!r} does not exist; fix the path.")
    try:  # OmegaConf, so that ${oc.env:VAR,default} works in the file (e.g. for nvme_paths)
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    except Exception as exc:  # noqa: BLE001 - a syntax or interpolation error, named with its file
        raise ConfigError(f"zinf launch: {path} is not a readable YAML config ({exc}).") from exc
    accelerate_part, config = check_launch_config(data, path)

    accelerate_file = os.path.join(workdir, "accelerate.yaml")
    with open(accelerate_file, "w", encoding="utf-8") as f:
        yaml.safe_dump(accelerate_part, f)
    try:  # Accelerate's own checks (unknown keys, enum values), here instead of in every process
        ClusterConfig.from_yaml_file(accelerate_file)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"zinf launch: Accelerate refuses the settings in {path}: {exc}") from exc
    engine_file = os.path.join(workdir, "zinf.yaml")
    with open(engine_file, "w", encoding="utf-8") as f:
        yaml.safe_dump(config.to_dict(), f)

    if ns.no_python:
        raise ConfigError("zinf launch: --no_python cannot be combined with zinf (the script must run in Python).")
    if ns.module:
        options = [o for o in options if o not in ("-m", "--module")]
        script = ["--module", *script]
    elif not os.path.isfile(script[0]):
        raise ConfigError(f"zinf launch: the script {script[0]!r} is not a file; fix its path (relative to "
                          f"{os.getcwd()}), or give --module (-m) to run a module by its name.")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_file, *options,
           "-m", "accelerate_zinf.run", *script]
    env = dict(os.environ)
    env[ENV_CONFIG] = engine_file
    if accelerate_part.get("use_cpu") or ns.cpu:
        env["ACCELERATE_USE_CPU"] = "true"  # without it every CPU process would train alone
    return cmd, env


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE + "\n")
        return 0 if argv else 2
    workdir = tempfile.mkdtemp(prefix="zinf-launch-")
    try:
        try:
            cmd, env = build_command(argv, workdir)
        except ConfigError as exc:
            sys.stderr.write(f"{exc}\n")
            return 2
        log.info("zinf launch: %s", " ".join(cmd))
        return subprocess.call(cmd, env=env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
