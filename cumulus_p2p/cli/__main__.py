"""``python -m cumulus_p2p.cli``: what the ``cumulus-node`` script runs."""

import sys

from . import main

sys.exit(main())
