"""Recipes run as forks of one process that has imported them: `run(script, args)` is `subprocess.run` of
`python script args` (`run("-m infra.data.tasks", args)`: of `python -m infra.data.tasks args`) without the ~3.5 s of
imports (torch, transformers, accelerate) every new interpreter pays.

For the tests that start a recipe only to see it refuse something in one line (a bad config, a model that cannot be
loaded, damaged data): the fork runs the script as `python script` would (`__main__`, its argv, its environment, its
working directory, fresh stdout and stderr) from the point where its imports are done, and exits with the code the
recipe's entry point chose. What an import reads from the environment (say HF_HUB_OFFLINE) was read once, with
`BASE_ENV`; a test whose point is the process's start or end (its interpreter, its exit after threads) starts a real
interpreter instead. Forking a process that has imported torch is what the DataLoader's workers do: torch resets its
thread pools in the child.

The server (`python -m tests.recipe_forks`) reads one JSON request a line and answers each with the child's pid, then
its exit code; one runs per pytest session, started on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # what the imports see; every test's runs are offline


def serve() -> None:
    """Import every recipe, say so, then fork one child a request."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what anything prints goes to the server's log, not into the answers
    for script in sorted((REPO / "recipes").glob("*.py")):  # their imports are what the children skip
        if script.stem != "__init__":
            __import__(f"recipes.{script.stem}")
    import infra.data.tasks  # noqa: F401  (the preparation of the recipes' data, run as a module)

    answer.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(**request)
        answer.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")


def child(script: str, args: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """Become `python script *args` in `cwd` with `env` (never returns)."""
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.argv = [script, *args]
        if script.startswith("-m "):
            runpy.run_module(script.removeprefix("-m "), run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(script).parent)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:  # what the interpreter would make of it
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Server:
    """The client side: one server process, its requests one at a time."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="infra-recipe-forks-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.recipe_forks"],
            cwd=REPO,
            env={**os.environ, **BASE_ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.folder / "server.log", "w"),  # noqa: SIM115 (the server's lifetime)
            text=True,
        )
        assert self.read(300) == "ready", (self.folder / "server.log").read_text()[-3000:]
        self.count = 0

    def read(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        assert line, f"the recipe fork server ended: {(self.folder / 'server.log').read_text()[-3000:]}"
        return line.strip()

    def run(self, script: str, args: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        request = {"script": script, "args": args, "cwd": cwd, "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.read(60))["pid"]
        line = self.read(timeout)
        if line is None:  # as subprocess.run's timeout: the child is killed, the caller told
            os.kill(pid, signal.SIGKILL)
            self.read(60)
            raise subprocess.TimeoutExpired([script, *args], timeout, out.read_text(), err.read_text())
        code = json.loads(line)["code"]
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess([sys.executable, script, *args], code, stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        with contextlib.suppress(OSError):
            for path in self.folder.iterdir():
                path.unlink()
            self.folder.rmdir()


_server: Server | None = None


def run(script: str | Path, args: list[str], cwd: str | Path = REPO, env: dict[str, str] | None = None, timeout: float = 120):
    """`subprocess.run([python, script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    forked from the server (started on first use; ended at exit)."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = Server()
        atexit.register(_server.close)
    return _server.run(str(script), [str(a) for a in args], str(cwd), {**BASE_ENV, **(env or {})}, timeout)


if __name__ == "__main__":
    serve()
