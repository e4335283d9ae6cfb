import sys

from vllm_loopspec.disagg.launcher import main

sys.exit(main())
