"""The GRPO demos. Their modules import each other by plain name (`from grpo_lib import ...`, as a script next
to them does), so importing them as `recipes.<module>` puts this folder on the path first."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
