import sys

from interp_runner.verify import main

sys.exit(main())
