"""``python -m tensorlens``: the ``tensorlens`` command (see :mod:`tensorlens.cli`)."""

import sys

from tensorlens.cli import main

sys.exit(main())
