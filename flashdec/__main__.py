import sys

from flashdec.cli import main

sys.exit(main())
