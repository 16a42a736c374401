#!/usr/bin/env bash
# Build the wheel folders the GPU machine needs (it reaches no package index), here, from the registries:
#   .whl      dashscope (only its qwen.tiktoken: the tokenizer ranks; the full wheel is 2.4 MB) and platformdirs
#   .whl_web  the web stack for STEPS=http/warm (fastapi & co., ~2 MB), and pydantic-core (~2.2 MB)
# The device tool carries at most 64 MiB with the tracked tree (~63 MiB counted in disk blocks), so .whl
# goes alone in one call (STEPS=install ...); .whl_web does not fit beside the tree: for a web run, untrack
# the probe's two largest files for that one call (they are not needed there) and restore them after:
#   printf 'benchmarks/quality/probe/tokenizer.json\nbenchmarks/quality/probe/model-00002-of-00002.safetensors\n' >> .git/info/exclude
#   git rm -q --cached benchmarks/quality/probe/tokenizer.json benchmarks/quality/probe/model-00002-of-00002.safetensors
#   ... run(carry=[".whl_web"], command="STEPS='install warm' bash benchmarks/gpu_all.sh") ...
#   git reset -q -- benchmarks/quality/probe/tokenizer.json benchmarks/quality/probe/model-00002-of-00002.safetensors
#   (and delete the two lines from .git/info/exclude)
set -eu
cd "$(dirname "$0")/.."
P="--python-version 3.12 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: --no-deps -q"
mkdir -p .whl .whl_web
tmp=$(mktemp -d)
pip download $P -d "$tmp" dashscope==2.0.2
pip download $P -d .whl platformdirs
python3 - "$tmp"/dashscope-2.0.2-py3-none-any.whl .whl/dashscope-2.0.2-py3-none-any.whl <<'PY'
import base64, hashlib, sys, zipfile
src, dst = sys.argv[1:]
keep = {}
with zipfile.ZipFile(src) as z:
    for name in z.namelist():
        if name == "dashscope/resources/qwen.tiktoken" or (name.startswith("dashscope-2.0.2.dist-info/")
                                                            and not name.endswith(("RECORD", "entry_points.txt"))):
            keep[name] = z.read(name)
keep["dashscope/__init__.py"] = b""
meta = "dashscope-2.0.2.dist-info/METADATA"
keep[meta] = b"\n".join(l for l in keep[meta].split(b"\n") if not l.startswith(b"Requires-Dist"))
record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
          for n, d in keep.items()] + ["dashscope-2.0.2.dist-info/RECORD,,"]
keep["dashscope-2.0.2.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for n, d in keep.items():
        z.writestr(n, d)
PY
pip download $P -d .whl_web fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection \
  anyio sniffio idna uvicorn h11 click httpx httpcore certifi python-multipart prometheus-client sqlite-utils \
  sqlite-fts4 tabulate click-default-group pluggy python-dateutil six opentelemetry-api importlib-metadata zipp \
  typing-extensions
rm -rf "$tmp"
du -sh .whl .whl_web
