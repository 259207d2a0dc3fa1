"""`agentgrpo init NAME [--dir DIR]`: write an installable environment package.

The package, in ``DIR/NAME`` (`package_template` has its files): a ``pyproject.toml`` whose
entry point (group ``agentgrpo.environments``) names the class, so that once it is installed
``agentgrpo run NAME`` finds it (`environments.packages`); ``src/NAME/env.py``, a small working
environment (a tool, a reward, task rows, demonstrations); ``tests/test_env.py``, which runs
`check_environment` and ``agentgrpo doctor NAME`` on it; and a README saying what to do next.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import keyword
import re
from pathlib import Path

from agentgrpo.cli.options import UsageError
from agentgrpo.cli.package_template import FILES

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def add_parser(sub: argparse._SubParsersAction, handler: object) -> argparse.ArgumentParser:
    """The `init` subcommand's parser, its handler set to `handler`."""
    help_text = "write an installable environment package that `agentgrpo run NAME` finds"
    parser = sub.add_parser("init", help=help_text, description=help_text, allow_abbrev=False)
    parser.set_defaults(handler=handler)
    parser.usage = "agentgrpo init NAME [--dir DIR]"
    parser.add_argument(
        "name",
        metavar="NAME",
        help="the package's name: its import name, and the name `agentgrpo run` takes "
        "(lowercase letters, digits and _, starting with a letter)",
    )
    parser.add_argument(
        "--dir",
        default=".",
        help="the folder to write the package's folder NAME in (default: the current one)",
    )
    return parser


def init(namespace: argparse.Namespace) -> int:
    """Write the package `namespace.name` into ``namespace.dir/NAME``, say what is next; 0.

    Raises:
        UsageError: The name is not a lowercase identifier, or is already a module Python
            imports, or ``DIR/NAME`` exists and is not an empty folder.

    """
    name = namespace.name
    check_name(name)
    folder = Path(namespace.dir).expanduser() / name
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UsageError(
            f"{folder} already exists and is not an empty folder; agentgrpo init writes a new "
            f"package: pick another NAME or --dir"
        )
    written = write_package(folder, name)
    print(f"wrote the environment package {name} ({class_name(name)}):")
    for path in written:
        print(f"  {path}")
    print(
        f"next: install it (its entry point lets `agentgrpo run {name}` find it), test it "
        f"(`agentgrpo doctor {name}` included), train on it:\n"
        f"  pip install -e '{folder}[test]'\n  python -m pytest {folder}\n  agentgrpo run {name}"
    )
    return 0


def check_name(name: str) -> None:
    """Refuse a package name that is not a lowercase identifier or that Python already imports.

    Raises:
        UsageError: Naming the rule the name breaks.

    """
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise UsageError(
            f"agentgrpo init takes NAME as lowercase letters, digits and _, starting with a "
            f"letter and not a Python keyword (it is the package's import name and the name "
            f"`agentgrpo run` takes), e.g. word_games; not {name!r}"
        )
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:  # a namespace folder is not a module
        raise UsageError(
            f"a module named {name!r} is already importable ({spec.origin}); a package of that "
            f"name would shadow it or be shadowed: pick another NAME"
        )


def class_name(name: str) -> str:
    """The environment class's name for package `name`: ``word_games`` -> ``WordGames``."""
    return "".join(part.capitalize() for part in name.split("_"))


def write_package(folder: Path, name: str) -> list[Path]:
    """Write the package's files under `folder` (created as needed); returns their paths."""
    values = {
        "name": name,
        "class_name": class_name(name),
        "version": importlib.metadata.version("agentgrpo"),
    }
    written = []
    for path, text in FILES.items():
        target = folder / path.replace("$name", name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text.substitute(values))
        written.append(target)
    return written
