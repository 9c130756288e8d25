import sys

from hotfix.cli import main

sys.exit(main())
