import sys

from aioload._tools.cli import main

sys.exit(main())
