"""Print the first two ```bash blocks of README.md, one per line: the commands a newcomer runs (demo, then tests).

CI runs exactly these, so the README cannot drift from what is tested.
"""

import re
import sys

text = open(sys.argv[1] if len(sys.argv) > 1 else "README.md", encoding="utf-8").read()
blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
commands = [" ".join(line.strip() for line in block.strip().splitlines()) for block in blocks[:2]]
if len(commands) != 2 or any(not c for c in commands):
    sys.exit("README.md must start with two ```bash blocks: the demo command and the test command")
print("\n".join(commands))
