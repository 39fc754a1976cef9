import sys

from aioload._cli import main

sys.exit(main())
