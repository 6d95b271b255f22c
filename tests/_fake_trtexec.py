"""A stand-in ``trtexec`` (a Python script) for testing the trtexec backend without a GPU.

It logs its arguments to ``$FAKE_TRTEXEC_LOG``, answers ``--help`` like TensorRT
``$FAKE_TRTEXEC_VERSION`` (default 10.3; 8.6 has no ``--stronglyTyped`` but the ``--fp16``/
``--bf16``/``--int8`` precision flags, 11.x neither: strongly typed always), refuses an option
its help does not list (as trtexec does), "builds" an engine whose size is the model's, and
reports a GPU compute time proportional to it. ``$FAKE_TRTEXEC_MODE=fail|sleep`` makes it fail
or hang.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

FAKE = """\
import os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_TRTEXEC_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
version = os.environ.get("FAKE_TRTEXEC_VERSION", "100300")
print(f"&&&& RUNNING TensorRT.trtexec [TensorRT v{version}] # trtexec " + " ".join(args))
mode = os.environ.get("FAKE_TRTEXEC_MODE", "ok")
flags = ("--onnx --saveEngine --loadEngine --warmUp --iterations --duration --shapes "
         "--skipInference --timingCacheFile --staticPlugins --useCudaGraph --noDataTransfers")
if version.startswith("10"):
    flags += " --stronglyTyped --fp16 --bf16 --int8 --fp8"
elif version.startswith("8"):
    flags += " --fp16 --int8"
if args == ["--help"]:
    print("=== Build Options ===", flags)
    sys.exit(0)
unknown = [a for a in args if a.split("=", 1)[0] not in flags.split()]
if unknown:
    print(f"[E] Unknown option: {unknown[0]}")
    print("&&&& FAILED TensorRT.trtexec")
    sys.exit(1)
if mode == "sleep":
    time.sleep(30)
if mode == "fail":
    print("[E] Error[4]: [network.cpp::validate::3000] Error Code 4: Internal Error (bad Q/DQ)")
    print("&&&& FAILED TensorRT.trtexec")
    sys.exit(1)
opts = dict(a.lstrip("-").split("=", 1) for a in args if "=" in a)
if "saveEngine" in opts:
    with open(opts["saveEngine"], "w") as f:
        f.write(str(os.path.getsize(opts["onnx"])))
    print("&&&& PASSED TensorRT.trtexec")
    sys.exit(0)
ms = float(open(opts["loadEngine"]).read()) / 1000.0
print(f"[I] GPU Compute Time: min = {ms * 0.9} ms, max = {ms * 2} ms, mean = {ms * 1.1} ms, "
      f"median = {ms} ms, percentile(90%) = {ms * 1.2} ms")
print("[I] Total GPU Compute Time: 3.0 s")
print("&&&& PASSED TensorRT.trtexec")
"""


def write_fake_trtexec(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "trtexec"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script
