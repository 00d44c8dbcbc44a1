"""The router process is torch-free (docs/architecture.md: the router imports only the torch-free
modules of `engine`), and so is all of `wire`: importing its entry points and building its app, in a fresh interpreter,
loads neither torch nor triton, with the default model's real tokenizer. Static import rules are `lint-imports` ([tool.importlinter] in
pyproject.toml); this checks what a router really loads, lazy imports in `engine` included."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `python -m router` (router/__main__.py) and the app it serves; under `pdserve serve`,
# deploy/router_process.py and what it adds to that app. An audit hook keeps the stack of the
# first import of each forbidden package: the failure says which module brought it in.
PROBE = """
import json, sys, traceback
FORBIDDEN = ("torch", "triton")
first = {}

def witness(event, args):
    if event == "import" and args[0] in FORBIDDEN and args[0] not in first:
        first[args[0]] = "".join(line for line in traceback.format_stack()[:-1] if "<frozen importlib" not in line)

sys.addaudithook(witness)

import router.__main__
import router.app
import deploy.admin
import deploy.router_process
import deploy.router_sync
import wire.convert, wire.kv_events, wire.stats  # the whole contract the workers speak, typed

main = router.__main__
# the packaged default model, as `python -m router --model default` loads it: its tokenizer comes
# from the model's converted folder (`make install` converted it)
config = main.config_from_args(main.build_parser().parse_args(["--model", "default", "--decode", "127.0.0.1:9"]))
app = router.app.create_app(config)
assert app.state.router.config is config and app.state.router.tokenizer.encode("Hello world")
print(json.dumps({name: first.get(name, "(in sys.modules, import not seen)")
                  for name in FORBIDDEN if name in sys.modules}))
"""


def test_the_router_process_imports_no_torch_or_triton():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert not loaded, "the router loaded " + ", ".join(loaded) + ":\n\n" + "\n".join(
        f"first import of {name}:\n{stack}" for name, stack in loaded.items())
