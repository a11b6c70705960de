import sys

from headspace.cli.main import main

sys.exit(main())
