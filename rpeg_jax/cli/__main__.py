"""`python -m rpeg_jax.cli COMMAND ...` = `rpeg COMMAND ...` (the Makefile's `plan` target)."""

import sys

from rpeg_jax.cli import main

sys.exit(main())
