import sys

from raysim.cli import main

sys.exit(main())
