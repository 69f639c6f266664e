"""vLLM CPU at each setting a user would try, and what each run of it said about itself.

On x86 a vLLM CPU server keeps cores for its engine process unless told otherwise, and computes on
the rest; on a machine of few cores that halves what it computes on. So every bench that runs vLLM
runs it at its default and with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (every core for the model), and
nb is judged against the faster. A row names the peer it ran against: its distribution and version,
the ISA torch finds in its virtualenv, the thread binding from the server's log (its "OpenMP thread
binding info" lines: ``reserve_cpu_num`` and the model's ``core ids``) and its KV blocks.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

SETTINGS: dict[str, dict[str, str]] = {  # name -> vLLM CPU variables over the bench's own
    "default": {},
    "all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
}
NOT_SEEN = "not in its log"

_RESERVED = re.compile(r"reserve_cpu_num=(\d+)")
_CORES = re.compile(r"core ids=\[([\d, ]*)\]")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_BLOCKS = re.compile(r"num_(?:gpu|cpu)_blocks(?:=| is:? ?)(\d+)")
_ABOUT = """
import importlib.metadata as m, torch
dist = next(d for d in ("vllm-cpu", "vllm") if any(x.metadata["Name"] == d for x in m.distributions()))
amx = " AMX" if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() else ""
print(f"{dist} {m.version(dist)}, ISA {torch.backends.cpu.get_cpu_capability()}{amx}")
"""


def add_settings_argument(parser: argparse.ArgumentParser) -> None:
    """``--vllm-settings``: which of ``SETTINGS`` run (default: every one)."""
    parser.add_argument("--vllm-settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="vLLM CPU settings to run (default: all; nb is compared with the faster)")


def server_name(setting: str) -> str:
    """The name a vLLM server at ``setting`` goes by in a bench's rounds and logs."""
    return f"vLLM {setting}"


def row_name(base: str, setting: str) -> str:
    """A row's name for vLLM at ``setting``: ``base`` at the default (as rows from before the
    settings are named), ``base, setting`` otherwise."""
    return base if setting == "default" else f"{base}, {setting}"


def binding(log: str) -> str:
    """The thread binding a vLLM CPU log reports: ``reserve_cpu_num=N, core ids=[...]``."""
    reserved, cores = _RESERVED.search(log), _CORES.search(log)
    if not (reserved and cores):
        return NOT_SEEN
    return f"reserve_cpu_num={reserved[1]}, core ids=[{cores[1]}]"


def kv_capacity(log: str) -> str:
    """The KV capacity a vLLM log reports: its blocks, else its KV tokens."""
    if blocks := _BLOCKS.search(log):
        return f"{blocks[1]} KV blocks"
    if tokens := _KV_TOKENS.search(log):
        return f"{tokens[1]} KV tokens"
    return f"KV {NOT_SEEN}"


def about(python: Path) -> str:
    """The distribution, version and ISA of the vLLM CPU virtualenv whose python is ``python``."""
    out = subprocess.run([str(python), "-c", _ABOUT], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else f"unknown ({out.stderr.strip().splitlines()[-1:]})"


def peer_cell(python: Path, log: Path) -> str:
    """A row's "vLLM peer" cell: what the virtualenv is and what the server's log said."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return f"{about(python)}; {binding(text)}; {kv_capacity(text)}"


def env_for(setting: str, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` (the bench's vLLM environment) with ``setting``'s variables over it; any variable
    another setting sets is dropped first, so "default" is vLLM's default whatever the shell says."""
    chosen = {k for s in SETTINGS.values() for k in s}
    return {**{k: v for k, v in base.items() if k not in chosen}, **SETTINGS[setting]}
