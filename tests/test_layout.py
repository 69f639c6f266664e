"""The package's shape, as a reader meets it: arrows run downwards, and the compile wing stays in
parts a reader can hold (the plan, the artifact writer, the piece queue) instead of one hub."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import neuron_buckets

PACKAGE = Path(neuron_buckets.__file__).parent
COMPILE = PACKAGE / "compile"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, kernels and all, wherever its files live."""
    from neuron_buckets import kernels

    roots = [(PACKAGE, "neuron_buckets"), (Path(kernels.__path__[0]), "neuron_buckets.kernels")]
    found = {}
    for root, name in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            dotted = ".".join((name, *parts)).removesuffix(".__init__")
            found.setdefault(dotted, path)
    return found


def _imports(path: Path) -> set[str]:
    """The modules a file imports (``from X import y`` gives X and X.y: y may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_module_imports_the_package_front():
    """The front names the whole public API, so a stage that imports it imports every stage: the
    one arrow that would run back up. The version lives in ``_version.py`` for that reason."""
    offenders = {name for name, path in _modules().items() if name != "neuron_buckets"
                 and "neuron_buckets" in _imports(path)}
    assert offenders == set()


def test_the_compiler_is_a_short_join_of_small_parts():
    assert len((COMPILE / "compiler.py").read_text().splitlines()) < 250
    sizes = {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for path in COMPILE.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert {"compiler.py:Compiler", "artifact_writer.py:ArtifactWriter", "piece_queue.py:PieceQueue",
            "build_plan.py:BuildPlan"} <= set(sizes)
    assert {name: n for name, n in sizes.items() if n > 200} == {}


def test_the_dry_run_reads_the_build_plan_not_the_compiler():
    """``nb compile --dry-run`` prints a ``BuildPlan``: nothing it imports, directly or through
    another module, is the compiler, so it cannot reach into the compiler's attributes."""
    modules = _modules()
    seen, todo = set(), ["neuron_buckets.compile.compile_plan"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo += [i for i in _imports(modules[name]) if i.startswith("neuron_buckets.")]
    assert "neuron_buckets.compile.compile_plan" in seen and "neuron_buckets.compile.build_plan" in seen
    assert "neuron_buckets.compile.compiler" not in seen
    source = (COMPILE / "compile_plan.py").read_text()
    assert "def plan_compile(build: BuildPlan, cache: GraphCache)" in source


def test_the_step_plan_is_the_one_step_record_between_engine_and_runtime():
    """The runtime runs ``StepPlan``s (``run_plan``) and nothing else: ``PrefillChunk`` is only the
    input of ``BucketRuntime.prefill``, the public convenience the contract names, so only the
    runtime and the package front import it, and the runtime has no other step helper."""
    from neuron_buckets.runtime.bucket_runtime import BucketRuntime

    users = {name for name, path in _modules().items()
             if "neuron_buckets.runtime.prefill_chunk" in _imports(path)}
    assert users == {"neuron_buckets", "neuron_buckets.runtime.bucket_runtime"}
    steps = {name for name in vars(BucketRuntime) if name in ("decode", "prefill", "run_plan", "step")}
    assert steps == {"prefill", "run_plan"}


def test_kernels_and_manifests_are_reached_without_links():
    """They stay at the top of the repository; the package reaches them by ``__path__`` in a
    checkout and by pyproject's ``package-dir`` once built, so no tool has to follow a link."""
    import tomllib

    from neuron_buckets import kernels, manifests

    root = PACKAGE.parent
    assert [p for p in PACKAGE.rglob("*") if p.is_symlink()] == []
    assert Path(kernels.__path__[0]) == root / "kernels" and Path(manifests.__path__[0]) == root / "manifests"
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {f"neuron_buckets.{name}": name for name in ("kernels", "manifests")}
    assert setuptools["package-dir"] == mapped



def _strings(path: Path) -> list[str]:
    """The string constants of a file's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    documented = (n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef))
    docs = {id(n.body[0].value) for n in documented if ast.get_docstring(n) is not None}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_the_kernel_libraries_are_written_once_and_chosen_once():
    """``kernels/libraries.py`` holds the list of native libraries an artifact may carry and the
    choice of which it carries: the writer, the runtime, the build plan and the backend read it
    there, and no other module names a library or lists their builds (``X.LIBRARY``) side by side."""
    from neuron_buckets.kernels.libraries import LIBRARIES

    registry = "neuron_buckets.kernels.libraries"
    assert len(LIBRARIES) >= 4
    modules = _modules()
    naming = {name for name, path in modules.items() if name != registry
              and set(LIBRARIES) & set(_strings(path))}
    assert naming == set()
    listing = {
        name for name, path in modules.items() if name != registry
        for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Tuple | ast.List | ast.Set)
        and sum(isinstance(e, ast.Attribute) and e.attr == "LIBRARY" for e in node.elts) > 1
    }
    assert listing == set()
    readers = {"neuron_buckets.compile.artifact_writer", "neuron_buckets.compile.build_plan",
               "neuron_buckets.runtime.bucket_runtime"}
    for name in readers:
        kernels = {i for i in _imports(modules[name]) if i.startswith("neuron_buckets.kernels.")}
        assert registry in kernels and not {i.split(".")[2] for i in kernels} & set(LIBRARIES), name
    assert registry in _imports(modules["neuron_buckets.backends.inductor"])
    choosers = {name for name, path in modules.items() if "block_kv_cpu.applies(" in path.read_text()}
    assert choosers == {registry, "neuron_buckets.kernels.dispatch"}  # dispatch: the call's own kernel


def test_kernels_import_their_siblings_relatively():
    """Inside ``kernels/`` a sibling is imported as ``from .x import y``, not through the
    ``neuron_buckets.kernels`` shim, so a reader and import-linter see the kernels' own graph."""
    from neuron_buckets import kernels

    files = sorted(Path(kernels.__path__[0]).glob("*.py"))
    through_shim = {path.name for path in files
                    if any(i.startswith("neuron_buckets.kernels") for i in _imports(path))}
    relative = {path.name for path in files for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert len(files) > 10 and through_shim == set()
    assert {"libraries.py", "linear_choice.py", "dispatch.py"} <= relative


def test_the_benches_are_a_package_that_never_edits_sys_path():
    """``bench/`` is a package run as ``python -m bench.NAME``: its modules import each other as
    package modules, so neither a bench nor a test of one puts a folder on ``sys.path``."""
    root = PACKAGE.parent
    benches = sorted((root / "bench").glob("*.py"))
    assert (root / "bench" / "__init__.py") in benches and len(benches) > 10
    editing = [path.relative_to(root).as_posix() for path in [*benches, *(root / "tests").glob("*.py")]
               if re.search(r"sys\.path\.(insert|append)\(", path.read_text()) and path != Path(__file__)]
    assert editing == []
    siblings = {path.stem for path in benches}
    plain = {path.name for path in benches if {i.split(".")[0] for i in _imports(path)} & siblings}
    assert plain == set()

# Figures a run measured on one day belong in the CHANGELOG and bench results, not in the code.
MEASUREMENT = re.compile(
    r"\b\d+(\.\d+)? ?(ms|µs)\b(?! per)|\b\d+(\.\d+)?x (faster|slower|the time)|\b20\d\d-\d\d-\d\d\b(?! \d)"
    r"|\b\d+(\.\d+)? ?(GFLOP/s|GB/s|tok/s)"
)


def _prose(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    docs = [doc for n in nodes if (doc := ast.get_docstring(n))]
    comments = [line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line]
    return docs + comments


def test_no_docstring_or_comment_holds_a_measurement_of_one_day():
    benches = {f"bench/{p.name}": p for p in (PACKAGE.parent / "bench").glob("*.py")}
    found = {
        name: hit.group(0) for name, path in {**_modules(), **benches}.items()
        for text in _prose(path) if (hit := MEASUREMENT.search(text))
    }
    assert len(benches) > 10 and found == {}


SERVER = PACKAGE / "server"


def test_the_http_front_is_one_room_per_endpoint_over_a_short_shared_base():
    """vLLM's ``entrypoints/openai`` shape: a serving base, a module per endpoint with its wire
    format beside it, the app apart; no file a reader cannot hold, and a base class of one idea."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in SERVER.glob("*.py")}
    rooms = {"serving.py", "serving_completion.py", "serving_chat.py", "serving_embedding.py",
             "api_server.py", "openai_protocol.py", "completion_protocol.py", "chat_protocol.py",
             "embedding_protocol.py"}
    assert rooms <= set(sizes)
    assert {name: n for name, n in sizes.items() if n > 300} == {}
    classes = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse((SERVER / "serving.py").read_text())) if isinstance(node, ast.ClassDef)
    }
    assert 0 < classes["OpenAIServing"] <= 200


def test_busy_and_unknown_model_are_said_by_one_helper_each():
    """Every route and stage says them the same way: only ``errors.py`` writes their text."""
    for phrase in ("open requests; retry later", "does not exist; this server serves"):
        writers = sorted(p.name for p in SERVER.glob("*.py") if phrase in p.read_text())
        assert writers == ["errors.py"], phrase


def manifest_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every read of a ``manifest.json`` from now on, by path."""
    reads: list[Path] = []
    real = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        if self.name == "manifest.json":
            reads.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    return reads


@pytest.mark.parametrize("rank", ["0", "1"])
def test_opening_an_artifact_to_serve_reads_its_manifest_once(
    compiled_dir, embedding_dir, rank, monkeypatch
):
    """``nb serve`` decides what serves an artifact from one reading of its manifest: the engine,
    the embedder (runtime and tokenizer both take the manifest read) and, for a rank other than 0
    of a single-rank artifact, the engine still."""
    from neuron_buckets.engine.embedder import Embedder
    from neuron_buckets.engine.llm_engine import LLMEngine
    from neuron_buckets.engine.open_artifact import open_artifact

    monkeypatch.setenv("RANK", rank)
    reads = manifest_reads(monkeypatch)
    engine = open_artifact(compiled_dir)
    assert isinstance(engine, LLMEngine) and engine.runtime.directory == compiled_dir
    assert reads == [compiled_dir / "manifest.json"]
    embedder = open_artifact(embedding_dir, pooling="mean")
    assert isinstance(embedder, Embedder) and embedder.pooler.pooling == "mean"
    assert reads == [compiled_dir / "manifest.json", embedding_dir / "manifest.json"]
    engine.runtime.close()
    embedder.runtime.close()


def test_a_follower_rank_is_decided_and_opened_from_the_one_reading(
    compiled_dir, tmp_path, monkeypatch, capsys
):
    """Rank 1 of a two-rank artifact follows: the manifest read to decide so is the one its
    runtime opens with (here it then finds no graph files, and ends with one line and status 1)."""
    import json

    from neuron_buckets.engine.open_artifact import open_artifact
    from neuron_buckets.runtime.rank_worker import RankFollower

    manifest = json.loads((compiled_dir / "manifest.json").read_text())
    manifest["parallel"] = {"tensor_parallel_size": 2}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("RANK", "1")
    reads = manifest_reads(monkeypatch)
    follower = open_artifact(tmp_path)
    assert isinstance(follower, RankFollower) and follower.manifest.parallel.tensor_parallel_size == 2
    with pytest.raises(SystemExit) as ended:
        follower.run()
    assert ended.value.code == 1 and capsys.readouterr().err.startswith("error: rank 1: ")
    assert reads == [tmp_path / "manifest.json"]


def _places(path: Path, name: re.Pattern[str]) -> set[int]:
    """The lines of the statements in ``path``'s code (imports left out) that use a name matching
    ``name``: where a concept reaches into a module, prose not counted."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        used = {ast.Name: "id", ast.Attribute: "attr", ast.keyword: "arg", ast.arg: "arg"}.get(type(node))
        if used is None or not name.search(getattr(node, used) or ""):
            continue
        while not isinstance(node, ast.stmt):
            node = parents[node]
        if not isinstance(node, ast.Import | ast.ImportFrom):
            found.add(node.lineno)
    return found


def test_sampling_is_a_stage_and_the_grammar_reaches_the_engine_twice_at_most():
    """The step sampler owns what is done with a step's logits (grammar masks, early stops,
    acceptance, logprobs), so the engine neither imports their modules nor reaches into the
    grammar: it builds the grammar's manager and calls the sampler once a step. A grammar's
    compile is a verb of the manager, called when a request is validated, not in the engine."""
    engine = PACKAGE / "engine" / "llm_engine.py"
    assert 1 <= len(_places(engine, re.compile("grammar|structured", re.IGNORECASE))) <= 2
    stages = {f"neuron_buckets.engine.{m}" for m in ("sampler", "rejection_sampler", "logprobs")}
    assert _imports(engine) & stages == set()
    assert "neuron_buckets.engine.step_sampler" in _imports(engine)
    tree = ast.parse(engine.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine"]
    assert cls.end_lineno - cls.lineno + 1 <= 200
    calls = [n.func for n in ast.walk(cls) if isinstance(n, ast.Call)]
    called = [f.attr for f in calls if isinstance(f, ast.Attribute)]
    assert called.count("sample") == 1 and "compile" not in called and "mask" not in called
    sampler = (PACKAGE / "engine" / "step_sampler.py").read_text()
    assert "self.grammar.compile(" in sampler and "self.grammar.mask(" in sampler


KV_STATE = {"blocks", "cached", "draft_cached", "block_hashes", "prefill_hashes", "recomputed"}


def _kv_writers(path: Path) -> set[str]:
    """The KV-state attributes a file assigns, augments or deletes (``x.blocks = ...``,
    ``del x.block_hashes[n:]``), by name."""
    written = set()
    for node in ast.walk(ast.parse(path.read_text())):
        todo = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        todo += node.targets if isinstance(node, ast.Assign | ast.Delete) else []
        while todo:
            target = todo.pop()
            if isinstance(target, ast.Tuple | ast.List):
                todo += target.elts
            elif isinstance(target, ast.Subscript | ast.Starred):
                todo.append(target.value)
            elif isinstance(target, ast.Attribute) and target.attr in KV_STATE:
                written.add(target.attr)
    return written


def test_the_kv_cache_manager_owns_every_requests_kv_state():
    """vLLM's ``req_to_blocks``: a request's blocks, cached tokens and block names live in the KV
    cache manager, one record per request id from ``add`` to ``release``, and only the manager
    writes them. ``Request`` holds none of them, so nothing can read them off a request."""
    from dataclasses import fields

    from neuron_buckets.engine.block_pool import BlockPool
    from neuron_buckets.engine.kv_cache_manager import KVCacheManager, RequestKV
    from neuron_buckets.engine.request import Request
    from neuron_buckets.engine.sampling_params import SamplingParams

    assert {f.name for f in fields(RequestKV)} == KV_STATE
    request_fields = {f.name for f in fields(Request)}
    assert {"request_id", "token_ids", "prompt_len"} <= request_fields and not request_fields & KV_STATE
    assert not {"prefill_len", "prefilled"} & set(vars(Request))
    manager = "neuron_buckets.engine.kv_cache_manager"
    writers = {name: found for name, path in _modules().items() if (found := _kv_writers(path))}
    assert set(writers) == {manager}
    assert {"blocks", "cached", "draft_cached", "recomputed"} <= writers[manager]

    kv = KVCacheManager(BlockPool(4, 2))
    req = Request(7, [1, 2, 3], 3, SamplingParams())
    kv.add(req)
    assert kv.admit(req, [], alone=True) and kv.grow(req, 3)
    assert list(kv.req_to_kv) == [7] and len(kv.blocks(req)) == 2 and kv.num_cached(req) == 0
    kv.release(req)
    assert kv.req_to_kv == {} and kv.pool.num_free == 3


def test_make_test_needs_no_torch_xla():
    """``make test`` (what CI runs) checks the Neuron route through StableHLO only: the deprecated
    torch-xla route's second environment is built by ``make test-xla``, optional, never by ``test``."""
    makefile = (PACKAGE.parent / "Makefile").read_text()
    target = re.search(r"^test:(.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "pytest" in target[2]
    assert "xla" not in target[0].lower()
    assert re.search(r"^test-xla: ", makefile, re.M)


def test_lora_is_a_transform_of_the_layer_piece_not_branches_in_the_layer_code():
    """The LoRA math lives in model/lora.py (the piece) and model/lora_weight.py (the delta); the
    decoder layer and the pieces never mention it, and a projection takes it in one place."""
    for name in ("llama.py", "pieces.py", "weights.py"):
        assert "lora" not in (PACKAGE / "model" / name).read_text().lower(), name
    assert (PACKAGE / "model" / "linear.py").read_text().count("isinstance(weight, AdaptedWeight)") == 1
    runtime = (PACKAGE / "runtime" / "bucket_runtime.py").read_text()
    assert len(re.findall(r"lora", runtime, re.IGNORECASE)) <= 14  # a hook: the slots live in lora_slots.py


def test_the_ttft_trace_reaches_the_engine_in_two_places_and_is_off_by_default():
    """The opt-in TTFT trace lives in its own module: the engine makes it (None unless asked for) and
    hands it each step, nothing else; the server feeds it arrivals."""
    engine = PACKAGE / "engine" / "llm_engine.py"
    tree = ast.parse(engine.read_text())
    places = _places(engine, re.compile("ttft", re.IGNORECASE))
    methods = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               and any(f.lineno <= line <= f.end_lineno for line in places)}
    assert methods == {"__init__", "step"} and len(places) <= 3, (methods, sorted(places))
    assert "TTFTTrace.from_env()" in engine.read_text()


RUNTIME = PACKAGE / "runtime"


def _none_checks(path: Path, attr: str) -> set[int]:
    """The lines of ``path`` that compare ``<x>.attr`` with None (``is``, ``is not``)."""
    return {
        node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Attribute) and node.left.attr == attr
        and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
    }


def test_the_runtime_runs_every_artifact_one_way():
    """A group of one (``SoloRank``) stands where a tensor-parallel artifact's ranks do, and the
    output head chosen at open says what a call returns: no runtime module asks whether it has
    ranks, a degree above one, or an embedding, and ``BucketRuntime`` stays a class a reader can
    hold."""
    from neuron_buckets.runtime.rank_group import RankGroup
    from neuron_buckets.runtime.solo_rank import SoloRank

    files = sorted(RUNTIME.glob("*.py"))
    assert len(files) > 10
    asking = {path.name: lines for path in files
              if (lines := _none_checks(path, "ranks") | _places(path, re.compile(r"^embeds$")))}
    assert asking == {}
    degree = re.compile(r"\btp\.size\s*[=!<>]|[=!<>]=?\s*self\.tp\.size\b")
    assert not degree.search((RUNTIME / "bucket_runtime.py").read_text())
    group = {name for name, value in vars(RankGroup).items()
             if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    assert {"loaded", "send", "receive", "in_step", "close", "abandon", "leads"} <= group
    assert group - {"join"} <= set(dir(SoloRank))
    tree = ast.parse((RUNTIME / "bucket_runtime.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BucketRuntime"]
    assert cls.end_lineno - cls.lineno + 1 <= 200


def test_tensor_parallelism_and_quantization_each_live_in_one_folder():
    """Both are transforms of the model as it loads (gpt-fast's ``tp.py`` and ``quantize.py``):
    their modules sit together under ``model/tp/`` and ``model/quant/``, none loose in ``model/``,
    and the runtime reaches a rank's weights through the one load ``tp/rank_weights.py`` makes."""
    model = PACKAGE / "model"
    tp = {p.name for p in (model / "tp").glob("*.py")}
    quant = {p.name for p in (model / "quant").glob("*.py")}
    assert {"tensor_parallel.py", "sharding.py", "rank_weights.py"} <= tp
    assert {"quant_scheme.py", "quantized_weight.py", "quantized_linear.py",
            "compressed_tensors_format.py"} <= quant
    assert not (tp | quant) - {"__init__.py"} & {p.name for p in model.glob("*.py")}
    runtime = {i for i in _imports(RUNTIME / "bucket_runtime.py") if i.startswith("neuron_buckets.model.tp")}
    assert "neuron_buckets.model.tp.rank_weights" in runtime
    assert "neuron_buckets.model.tp.sharding" not in runtime
