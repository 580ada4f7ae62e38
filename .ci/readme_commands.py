"""Print the README's shell commands, one per line: each ```bash block joined into one line.

``.ci/run`` runs every one of them as written, each in a fresh environment, so that every
install tier the README documents is one CI runs (a tier CI skips breaks unseen).
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
if not blocks:
    sys.exit("README.md has no ```bash block: nothing for CI to run")
for block in blocks:
    print(" && ".join(line.strip() for line in block.strip().splitlines() if line.strip()))
