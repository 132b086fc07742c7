"""Write a tiny random DeepSeek-V4 checkpoint (see deepinfer_core.tools.tiny_checkpoint)."""

import sys

from deepinfer_core.tools.tiny_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
