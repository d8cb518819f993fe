"""Child processes for the demo and the refit benchmark: relays and receivers
whose first stdout lines are read, stderr logged to a file, stopped cleanly."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def env_importing_this_dcr(folder: Path) -> dict[str, str]:
    """The environment for a child in another interpreter (vLLM's own venv)
    that must import this dcr, not one its base interpreter may hold: a
    folder holding only a link to this package goes first on PYTHONPATH
    (only dcr, so the child's own numpy and the rest stay its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "dcr"
    if not link.exists():
        link.symlink_to(Path(__file__).resolve().parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return env


class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def line(self) -> str:
        assert self.p.stdout is not None
        return self.p.stdout.readline()

    def listening(self) -> str:
        """The address a `dcr relay` child printed (`LISTENING host:port`)."""
        line = self.line()
        if not line.startswith("LISTENING "):
            raise RuntimeError(f"relay did not start: {line!r}; see {self.log_path}")
        return line.split()[1]

    def wait_log(self, needle: str, count: int, timeout: float = 60.0) -> None:
        """Block until the child's log holds `needle` `count` times (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.flush()
            if self.log_path.read_text().count(needle) >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.log_path}: {needle!r} not seen {count} times in {timeout} s")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        if self.p.stdout:
            self.p.stdout.close()
        self.log.close()
