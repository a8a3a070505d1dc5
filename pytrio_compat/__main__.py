"""``python -m pytrio_compat run SCRIPT.py [ARGS...]``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
