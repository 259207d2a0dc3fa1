"""`python -m agentgrpo` is the `agentgrpo` command."""

from agentgrpo.cli import command

command()
