"""`python -m deploy ...` is `pdserve ...`."""
import sys

from deploy.cli import main

sys.exit(main())
