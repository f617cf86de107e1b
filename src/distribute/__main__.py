"""``python -m distribute``: the main job (see ``cli.py``)."""

import sys

from distribute.cli import main

sys.exit(main())
