"""The `report_to` experiment trackers: the check that each one asked for is installed.

transformers' Trainer does the logging, through its callbacks (tensorboard, wandb, trackio,
...); a missing package surfaces there only as a traceback once the model has loaded, naming
a bare `pip install`. This check runs first and names the command that installs the version
agentgrpo was tested with.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# report_to name -> (the modules, any one of which serves it; the command that installs one).
_TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "trackio": (("trackio",), "pip install 'agentgrpo[trackio]'"),
    "wandb": (("wandb",), "pip install wandb"),
    "tensorboard": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
}


def check_trackers(report_to: Sequence[str] | str | None) -> None:
    """Fail when a tracker in `report_to` is not installed, naming the command that installs it.

    Trackers agentgrpo does not list here are left to transformers' own check.

    >>> check_trackers(["none"])
    >>> check_trackers(None)

    Raises:
        ImportError: The first missing tracker's name and its install command.
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        modules, install = _TRACKERS.get(name, ((), ""))
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
            raise ImportError(
                f"report_to={name!r} needs {modules[0]}, which is not installed: {install} "
                f"(or leave {name} out of report_to)"
            )
