"""``python -m orchestrator.convert ...`` — see :mod:`orchestrator.convert.cli`."""

import sys

from orchestrator.convert.cli import main

sys.exit(main())
