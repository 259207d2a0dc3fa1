"""`agentgrpo envs`: the environments a spec can name, built-in, installed, and by form.

Three paragraphs: each built-in (``env:Name``) with the first line of its docstring; each
environment an installed package declares (``NAME``, see `environments.packages`) with the
class it stands for, its package and version and the first line of the class's docstring; then
every form of spec `run` and `eval` take, and reasoning-gym's tasks where it is installed.
"""

from __future__ import annotations

import argparse
import collections

from environments.packages import EnvironmentPackage

# The forms of spec `run` and `eval` take, listed after the environments themselves.
ENVIRONMENT_SOURCES = (
    ("env:Name", "a built-in above"),
    ("NAME", "an environment an installed package declares (above; `agentgrpo init`)"),
    ("package.module:Class", "a class in an importable module"),
    ("path/file.py:Class", "a class in a file (relative to the current directory)"),
    ("gym:ENV_ID", "a registered gymnasium env with a text observation (ansi or Text), such"),
    ("", "as the toy-text gym:FrozenLake-v1, gym:Taxi-v4 and gym:CliffWalking-v1;"),
    ("", "arguments for gymnasium.make follow the id: gym:FrozenLake-v1,is_slippery=false;"),
    ("", "a plugin package's ids after its module: gym:minigrid:MiniGrid-Empty-5x5-v0"),
    ("gem:ENV_ID", "a GEM game or task, e.g. gem:game:GuessTheNumber-v0-easy ('agentgrpo[gem]')"),
    ("ta:GAME_ID", "a TextArena game, e.g. ta:GuessTheNumber-v0 (extra: textarena);"),
    ("", "games of two or more players have seats (ta:TicTacToe-v0, players=N),"),
    ("", "or an opponent plays one inside the tool (ta:TicTacToe-v0,opponent=random)"),
    ("openenv:module:Class", "an OpenEnv environment played in this process, or one an OpenEnv"),
    ("", "server serves: openenv:http://host:port ('agentgrpo[openenv]')"),
    ("agent:file.py:function", "an agent function driving an OpenAI client (also"),
    ("", "agent:package.module:function); rows from --dataset"),
    ("vf:ENV_ID", "an installed verifiers environment (its taskset's id): its tasks, harness"),
    ("", "and rewards; its env config as --env-args JSON ('agentgrpo[verifiers]')"),
    ("rg:TASK", "a reasoning-gym task, generated rows scored by the task (the tasks follow)"),
)


def envs(namespace: argparse.Namespace) -> int:
    """Print the built-ins, the installed environment packages, then every source; status 0."""
    from environments import BUILTIN_ENVIRONMENTS, EnvironmentSpecError
    from environments.reasoning_gym_tasks import INSTALL, task_listing

    width = max(map(len, BUILTIN_ENVIRONMENTS)) + len("env:")
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        print(f"{'env:' + name:<{width}}  {_summary(cls)}")
    print(f"\n{installed_listing(BUILTIN_ENVIRONMENTS)}")
    width = max(len(form) for form, _ in ENVIRONMENT_SOURCES)
    print("\nenvironment sources (for run and eval):")
    for form, meaning in ENVIRONMENT_SOURCES:
        print(f"  {form:<{width}}  {meaning}")
    try:
        print(task_listing())
    except EnvironmentSpecError:
        print(f"rg:TASK, reasoning-gym's generated tasks: not installed ({INSTALL})")
    return 0


def installed_listing(builtins: dict[str, type]) -> str:
    """The installed environments, one line each: name, class, package and version, summary.

    A name `resolve_environment` would refuse (a built-in's, or declared twice) says so in
    place of its summary, with the spec that reaches its class anyway; so does a package whose
    class does not import.
    """
    from environments.packages import ENTRY_POINT_GROUP, installed_environments

    installed = installed_environments()
    if not installed:
        return (
            "installed environment packages: none (`agentgrpo init NAME` writes one; a package "
            f"declares its environments under the entry point group {ENTRY_POINT_GROUP!r})"
        )
    declared = collections.Counter(entry.name for entry in installed)
    rows = [
        (entry.name, entry.target, entry.origin, _note(entry, builtins, declared[entry.name]))
        for entry in installed
    ]
    name_w, target_w, origin_w = (max(len(row[column]) for row in rows) for column in range(3))
    lines = ["installed environment packages (agentgrpo run NAME):"]
    for name, target, origin, note in rows:
        lines.append(f"  {name:<{name_w}}  {target:<{target_w}}  {origin:<{origin_w}}  {note}")
    return "\n".join(lines)


def _note(entry: EnvironmentPackage, builtins: dict[str, type], declared: int) -> str:
    """What `envs` says after an installed environment: its summary, or why NAME fails."""
    from environments import EnvironmentSpecError

    if entry.name in builtins:
        return f"refused as NAME: also the built-in env:{entry.name}; use {entry.target}"
    if declared > 1:
        return f"refused as NAME: {declared} packages declare it; use {entry.target}"
    try:
        return _summary(entry.load())
    except EnvironmentSpecError:
        return f"does not load: `agentgrpo doctor {entry.name}` says why"


def _summary(obj: object) -> str:
    """The first line of `obj`'s docstring, or nothing."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""
