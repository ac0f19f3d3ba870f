"""``python -m orchestrator.sweep summarize <sweep dir>`` (same as ``python -m orchestrator sweep ...``)."""

import sys

from orchestrator.sweep.driver import main

sys.exit(main())
