"""`python -m jaxinfer ...`: the same as the `jaxinfer` command."""

import sys

from jaxinfer.cli import main

sys.exit(main())
