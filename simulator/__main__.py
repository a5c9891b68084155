"""``python -m simulator`` is ``themis-sim``."""

import sys

from simulator.cli import main

sys.exit(main())
