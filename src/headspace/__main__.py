"""``python -m headspace``: the ``headspace`` command."""

import sys

from headspace.cli.main import main

sys.exit(main())
