"""``nb serve`` and ``nb generate`` on a tensor-parallel artifact start their ranks themselves: the
text they give is TP=1's, through the official ``openai`` client, and a rank killed under load
gives open requests a 503 and ends the server with one line, well within 30 s. Started by torchrun
instead (every rank the same command, joined by torch.distributed's rendezvous on 127.0.0.1, as
across machines), ``nb generate`` gives TP=1's tokens too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from neuron_buckets.cli import app
from tests.conftest import TEXT_EAGER, free_port, text_artifact, text_model, wait_for_line, write_config  # noqa: F401
from tests.test_serve import MODEL, client, nb_generate

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve-tp")]


@pytest.fixture(scope="module")
def tp_artifact(text_model, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    tmp = tmp_path_factory.mktemp("tp-text-artifact")
    config = write_config(tmp, text_model[0], TEXT_EAGER + "\n[parallel]\ntensor_parallel_size = 2\n")
    args = ["compile", str(config), "--out", str(tmp / "art"), "--cache-dir", str(tmp / "c")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp / "art"


@contextmanager
def nb_serve(directory: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(directory), "--port", "0",
           "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        m, _ = wait_for_line(proc, r"serving 'tiny' at (http://127\.0\.0\.1:\d+)")
        yield m.group(1), proc
    finally:
        for child in children(proc.pid):
            subprocess.run(["kill", "-9", str(child)], check=False)
        proc.kill()


def children(pid: int) -> list[int]:
    """The processes ``pid`` started: its follower ranks."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_serve_and_generate_on_two_ranks_give_one_ranks_text(tp_artifact, text_artifact):  # noqa: F811
    prompt, n = "hello world", 12
    sampled = ["--temperature=0.9", "--top-p=0.9", "--seed=7"]
    want_greedy = nb_generate(text_artifact, "--prompt", prompt, f"--max-new-tokens={n}")
    want_sampled = nb_generate(text_artifact, "--prompt", prompt, f"--max-new-tokens={n}", *sampled)
    assert nb_generate(tp_artifact, "--prompt", prompt, f"--max-new-tokens={n}") == want_greedy
    with nb_serve(tp_artifact) as (base, proc):
        assert len(children(proc.pid)) == 1  # rank 1
        c = client(base)
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert out.choices[0].text + "\n" == want_greedy
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.9, top_p=0.9,
                                   seed=7)
        assert out.choices[0].text + "\n" == want_sampled
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=n, temperature=0, stream=True)
        chat = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        want_chat = nb_generate(text_artifact, "--prompt", prompt, f"--max-new-tokens={n}", "--chat")
        assert chat + "\n" == want_chat
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read()


def test_a_killed_rank_gives_503_and_ends_the_server_with_one_line(tp_artifact):
    with nb_serve(tp_artifact) as (base, proc):
        (follower,) = children(proc.pid)
        stream = client(base).completions.create(
            model=MODEL, prompt=[3, 4, 5], max_tokens=100, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        subprocess.run(["kill", "-9", str(follower)], check=True)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as refused:
            for _ in chunks:
                pass
        assert "503" in str(refused.value) or "engine loop stopped" in str(refused.value)
        assert proc.wait(30) == 2
        assert time.monotonic() - killed < 30
        lines = [line for line in proc.stderr.read().splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "rank" in lines[0], lines


def test_torchrun_starts_nb_generate_as_every_rank(tp_artifact, text_artifact):  # noqa: F811
    """Two processes of one ``nb generate`` command: rank 0 generates, rank 1 follows it."""
    args = ["--prompt-ids", "5,6,7,8,9", "--max-new-tokens=8"]
    want = nb_generate(text_artifact, *args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "-m", "neuron_buckets.cli", "generate", str(tp_artifact), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == want
    assert "Traceback" not in result.stderr
