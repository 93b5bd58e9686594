"""`python -m bridge.cli …`, as `rdq …`."""

import sys

from bridge.cli.main import main

sys.exit(main())
