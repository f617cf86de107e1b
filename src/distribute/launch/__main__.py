"""`python -m distribute.launch`: see `distribute.launch`."""

import sys

from distribute.launch._cli import main

sys.exit(main())
