"""A small watched training job and a real Prometheus server scraping it, for tests.

Shared by tests/integrations/test_prometheus.py and tests/test_dashboards.py.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess

import pytest
import torch
import yaml

import flashwatch as fw
from examples.gpt import GPT, GPTConfig

SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
# The Makefile's `prometheus` target prints the same hint when it cannot install them.
PROMETHEUS_HINT = ("prometheus and promtool are missing; the Prometheus tests need them. Install "
                   "Debian's package as root: sudo apt-get install -y --no-install-recommends "
                   "prometheus (or run sudo make prometheus)")


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`; fails the test with the install hint."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found on PATH: {PROMETHEUS_HINT}", pytrace=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyTrainer:
    """A small bf16 GPT, watched on every step; step() is one optimizer step."""

    def __init__(self, sinks):
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**SMALL))
        self.watcher = fw.watch(self.model, every_n_steps=1, sinks=sinks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.gen = torch.Generator().manual_seed(0)

    def step(self):
        idx = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"] + 1),
                            generator=self.gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = self.model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.watcher.step()


@contextlib.contextmanager
def prometheus_server(tmp_path, target_port: int, *, job: str = "flashwatch",
                      rule_files=()):
    """Run Debian's prometheus on a free loopback port, scraping 127.0.0.1:target_port
    every second; yields (web address "127.0.0.1:port", process). Stopped by PID."""
    binary = prometheus_tool("prometheus")
    web = f"127.0.0.1:{free_port()}"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(r) for r in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [
            {"targets": [f"127.0.0.1:{target_port}"]}]}]}))
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={web}"],
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            yield web, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
