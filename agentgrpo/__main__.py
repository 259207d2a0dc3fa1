"""`python -m agentgrpo` is the `agentgrpo` command."""

import sys

from agentgrpo.cli import main

sys.exit(main())
