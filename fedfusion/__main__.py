"""``python -m fedfusion``: the ``fedfusion`` command, from whichever fedfusion is first on the path."""

import sys

from fedfusion.cli import main

sys.exit(main())
