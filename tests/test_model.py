"""The block-KV model against transformers' full forward: prefill, decode, speculative, padded, for
every supported architecture (eagerly; tests/test_architectures.py runs them compiled)."""

from __future__ import annotations

import pytest
import torch
import transformers

from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.padding import PaddedCall, pad_decode, pad_prefill
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.kernels import dispatch
from neuron_buckets.model.checkpoint import load_weights
from neuron_buckets.model.llama import Llama
from neuron_buckets.model.model_config import LlamaConfig
from tests.conftest import ARCHITECTURES, PEAKED, segment, tiny_hf_model
from tests.steps_compared import FLOOR, assert_floor

BS, NUM_BLOCKS, CTX = 8, 48, 64
# Logit tolerance against transformers in the same dtype: absolute in float32; in half precision a
# share of each row's largest |logit|, since both sides round every activation, differently (nb
# attends in float32). A greedy pick within that of transformers' best logit is as good a pick (a
# near tie); at least 90% of the picks must be no near tie, so transformers' own token. The half
# precision checks run a peaked model (see conftest) whose seed decides over 95% of their picks.
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.02, torch.float16: 0.005}
HALF_MODEL = dict(PEAKED, seed=5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def hf_model(arch: str = "llama", **overrides) -> transformers.PreTrainedModel:
    return tiny_hf_model(arch, **{"initializer_range": 0.15, **overrides})


def dtype_model(arch: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """The model a check in ``dtype`` runs: the peaked one in half precision."""
    return hf_model(arch, **({} if dtype == torch.float32 else HALF_MODEL))


def ours_from(hf: transformers.PreTrainedModel) -> Llama:
    config = LlamaConfig.from_hf(hf.config.to_dict())
    return Llama(config, load_weights(config, hf.state_dict()))


class Session:
    """Requests over one NaN-filled cache (NaN proves unwritten slots never leak into outputs)."""

    def __init__(self, hf: transformers.PreTrainedModel, prompts: list[list[int]], seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        self.hf = hf.to(dtype)
        self.model, self.tol = ours_from(self.hf), LOGIT_TOLERANCE[dtype]
        self.relative = dtype != torch.float32  # float32: absolute, and transformers' own pick
        self.k = torch.full(self.model.cache_shape(NUM_BLOCKS, BS), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # shuffled
        self.seqs = [list(p) for p in prompts]
        self.cached = [0] * len(prompts)
        self.blocks: list[list[int]] = [[] for _ in prompts]
        self.decided = self.picks = 0  # picks whose reference best stands out by more than the tie

    def alloc(self, req: int, num_tokens: int) -> list[int]:
        """Blocks for actual tokens only, taken from the shuffled free list."""
        need = -(-num_tokens // BS) - len(self.blocks[req])
        self.blocks[req] += [self.free.pop() for _ in range(max(need, 0))]
        return self.blocks[req]

    def run(self, step: PaddedCall) -> torch.Tensor:
        with torch.no_grad():
            return self.model(*step.args(), self.k, self.v)[: step.num_samples]

    def reference(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].float()

    def check(self, logits: torch.Tensor, ref: torch.Tensor) -> list[int]:
        """Logits (N, vocab) within tolerance of transformers', each greedy pick transformers' own
        or a near tie with it; returns the picks."""
        if self.relative:
            tol = self.tol * ref.abs().amax(-1)
            assert ((logits - ref).abs().amax(-1) <= tol).all(), ((logits - ref).abs().amax(-1), tol)
        else:
            torch.testing.assert_close(logits, ref, rtol=self.tol, atol=self.tol)
        tie = tol if self.relative else torch.zeros(len(ref))
        greedy = logits.argmax(-1)
        top = ref.topk(2, dim=-1).values
        assert (ref.gather(-1, greedy[:, None])[:, 0] >= top[:, 0] - tie).all(), (greedy, ref.argmax(-1))
        self.decided += int((top[:, 0] - top[:, 1] > tie).sum())  # there, transformers' own pick
        self.picks += len(greedy)
        return greedy.tolist()

    def assert_decided(self) -> None:
        """Enough picks were no near tie: there the pick was transformers' own token."""
        assert_floor(self.decided, self.picks, FLOOR, "decided picks")

    def chunk(self, r: int, chunk: int | None = None) -> Segment:
        start = self.cached[r]
        ids = self.seqs[r][start : None if chunk is None else start + chunk]
        return segment(ids, start, self.alloc(r, start + len(ids)))

    def row(self, r: int, drafts: list[int]) -> Segment:
        ids = [self.seqs[r][-1], *drafts]
        return segment(ids, self.cached[r], self.alloc(r, self.cached[r] + len(ids)), len(ids))

    def prefilled(self, r: int, c: Segment, logits: torch.Tensor) -> None:
        """Check a chunk's last logits against transformers over everything cached so far; a
        chunk that ends its prompt appends its greedy token."""
        self.cached[r] += len(c.token_ids)
        ref = self.reference(self.seqs[r][: self.cached[r]])[-1:]
        [token] = self.check(logits[None], ref)
        if self.cached[r] == len(self.seqs[r]):
            self.seqs[r].append(token)

    def decoded(self, r: int, d: Segment, logits: torch.Tensor) -> None:
        """Check a (speculative) row's logits; accept matching drafts plus one bonus token, greedily."""
        n = len(d.token_ids)
        greedy = self.check(logits, self.reference(self.seqs[r] + list(d.token_ids[1:]))[-n:])
        accepted = 0
        while accepted < n - 1 and d.token_ids[1 + accepted] == greedy[accepted]:
            accepted += 1
        self.seqs[r] += greedy[: accepted + 1]
        self.cached[r] += accepted + 1  # rejected drafts' K/V stay behind, beyond cache_len

    def prefill(self, reqs: list[int], bucket: Bucket, chunk: int | None = None) -> None:
        """Prefill (a chunk of) each request's uncached prompt in one step; check the last logits."""
        chunks = [self.chunk(r, chunk) for r in reqs]
        logits = self.run(pad_prefill(chunks, bucket, BS))
        for row, (r, c) in enumerate(zip(reqs, chunks, strict=True)):
            self.prefilled(r, c, logits[row])

    def decode(self, reqs: list[int], bucket: Bucket, drafts: dict[int, list[int]]) -> None:
        """One (speculative) decode step of decode rows."""
        rows = [self.row(r, drafts.get(r, [])) for r in reqs]
        logits = self.run(pad_decode(rows, bucket, BS)).view(len(reqs), bucket.seq, -1)
        for i, (r, d) in enumerate(zip(reqs, rows, strict=True)):
            self.decoded(r, d, logits[i, : len(d.token_ids)])

    def mixed(self, chunks: dict[int, int | None], rows: dict[int, list[int]], bucket: Bucket) -> None:
        """One packed step of prefill chunks (request: tokens, None for the rest of its prompt)
        and decode rows (request: drafts) behind them, each over its own context."""
        segments = [self.chunk(r, n) for r, n in chunks.items()] + [self.row(r, d) for r, d in rows.items()]
        step = pad_prefill(segments, bucket, BS, samples=bucket.batch * 4)
        logits = self.run(step).split([c.num_samples for c in segments])
        for r, seg, out in zip([*chunks, *rows], segments, logits, strict=True):
            (self.prefilled if r in chunks else self.decoded)(r, seg, out[-1] if r in chunks else out)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_decode_and_speculative_match_transformers(arch, dtype):
    """Mistral's window (12) is shorter than most of these contexts, so it masks in every step.
    Half precision runs the same steps through the C++ attention's half-precision reads."""
    gen = torch.Generator().manual_seed(1)
    lens = [5, 8, 13, 21, 30]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    s = Session(dtype_model(arch, dtype), prompts, dtype=dtype)
    s.prefill([0, 1], Bucket("prefill", 2, 32, CTX))  # 13 tokens packed, 19 pads at the tail
    s.prefill([2, 3], Bucket("prefill", 4, 32, CTX), chunk=16)  # 3 is chunked
    s.prefill([3, 4], Bucket("prefill", 2, 48, CTX))  # 3's rest reads its cached first chunk
    for _ in range(3):
        s.decode([0, 1, 2, 3, 4], Bucket("decode", 8, 1, CTX), {})
    drafts = {r: torch.randint(0, 256, (3,), generator=gen).tolist() for r in (0, 2, 4)}
    for r in (1, 3):  # drafts a perfect draft model would propose: all accepted
        drafts[r] = s.reference(s.seqs[r])[-1:].argmax(-1).tolist()
        while len(drafts[r]) < 3:
            drafts[r].append(int(s.reference(s.seqs[r] + drafts[r])[-1].argmax()))
    s.decode([0, 1, 2, 3, 4], Bucket("decode", 8, 4, CTX), drafts)
    s.decode([4, 0, 2], Bucket("decode", 4, 4, CTX), {4: [1, 2, 3], 0: [4], 2: [5, 6]})
    s.decode([0, 1, 2, 3, 4], Bucket("decode", 8, 1, CTX), {})  # after rejected drafts
    if dtype == torch.float32:  # in half precision a near tie may reject a perfect draft
        assert len(s.seqs[3]) == 21 + 1 + 3 + 4 + 1  # the perfect drafts were all accepted
    s.assert_decided()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mixed_packed_steps_match_transformers(arch, dtype):
    """Prefill chunks beside decode rows, several continuing chunks, speculative rows: each a
    segment of one packed call over its own block-table row and context, over a NaN cache."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 19, 26, 11, 30)]
    s = Session(dtype_model(arch, dtype), prompts, dtype=dtype)
    bucket = Bucket("prefill", 6, 48, CTX)
    s.mixed({0: None, 1: 8, 2: 10}, {}, bucket)  # 1 and 2 are cut
    s.mixed({1: None, 2: 9, 3: None}, {0: []}, bucket)  # two continuing chunks and a decode row
    s.mixed({2: None, 4: 12}, {0: [], 1: [], 3: []}, bucket)  # 2 continues a second time
    drafts = {0: s.reference(s.seqs[0])[-1:].argmax(-1).tolist(), 3: [5, 6, 7]}  # one right, wrong
    s.mixed({4: None}, {0: drafts[0], 1: [], 2: [1, 2], 3: drafts[3]}, bucket)  # speculative rows
    s.mixed({}, {0: [], 1: [3], 2: [], 3: [], 4: [8, 9, 10]}, bucket)  # after rejected drafts
    assert all(len(seq) > len(p) for seq, p in zip(s.seqs, prompts, strict=True))
    s.assert_decided()


def test_llama3_rope_scaling_matches_transformers():
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 23)]
    s = Session(hf_model(rope_parameters=LLAMA3_ROPE), prompts)
    assert s.model.config.rope_scaling is not None
    s.prefill([0, 1], Bucket("prefill", 2, 64, CTX))
    s.decode([0, 1], Bucket("decode", 2, 3, CTX), {0: [7, 8], 1: [9, 10]})
    s.assert_decided()


def run_step(model: Llama, step: PaddedCall, k: torch.Tensor, v: torch.Tensor):
    k, v = k.clone(), v.clone()
    with torch.no_grad():
        logits = model(*step.args(), k, v)[: step.num_samples]
    return logits, k, v


def test_packed_requests_never_see_each_other():
    """Identical prompts packed in one step get identical logits, each equal to running alone,
    over a NaN cache: a request's mask admits neither its neighbours' tokens nor their blocks."""
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (9,), generator=gen).tolist()
    s = Session(hf_model(), [prompt, prompt, prompt[:5]])
    s.prefill([0, 1, 2], Bucket("prefill", 4, 32, CTX))
    assert s.seqs[0] == s.seqs[1]
    s.assert_decided()


@pytest.mark.parametrize("kind, make", [
    ("prefill", lambda ids, pos, blocks: segment(ids, pos, blocks)),
    ("decode", lambda ids, pos, blocks: segment(ids[:2], pos, blocks)),
])
def test_padded_and_unpadded_steps_agree(kind, make):
    """Same real requests in an exact-fit bucket and in padded or wider ones.

    BLAS does not promise the same rounding for different matrix shapes (MKL picks kernels by
    shape and CPU), so logits and the K/V written agree to a tight tolerance and give the same
    greedy tokens. What the code itself guarantees holds bit for bit: every cache byte that no
    real token writes, the null block included, is left exactly as it was.
    """
    gen = torch.Generator().manual_seed(3)
    model = ours_from(hf_model())
    k = torch.randn(model.cache_shape(NUM_BLOCKS, BS), generator=gen)
    v = torch.randn(model.cache_shape(NUM_BLOCKS, BS), generator=gen)
    ids = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (11, 6, 9)]
    starts = [9, 0, 0] if kind == "prefill" else [9, 0, 20]  # packed: only the first continues
    blocks = [[31, 4, 17, 2], [8], [40, 12, 5, 33, 26]]
    pad = {"prefill": pad_prefill, "decode": pad_decode}[kind]
    rows = [make(i, p, b) for i, p, b in zip(ids, starts, blocks, strict=True)]
    seq = max(len(r.token_ids) for r in rows) if kind == "decode" else sum(len(r.token_ids) for r in rows)

    def real(step: PaddedCall, bucket_seq: int):
        logits, k_out, v_out = run_step(model, step, k, v)
        if kind == "decode":  # every token is sampled: drop the padded columns
            logits = logits.view(3, bucket_seq, -1)[:, :seq].reshape(3 * seq, -1)
        return logits, k_out, v_out

    exact_step = pad(rows, Bucket(kind, 3, seq, CTX), BS)
    exact = real(exact_step, seq)
    padded = real(pad(rows, Bucket(kind, 8, seq + 5, CTX), BS), seq + 5)
    wider = real(pad(rows, Bucket(kind, 8, seq + 5, 2 * CTX), BS), seq + 5)
    written = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
    written[exact_step.slot_mapping[exact_step.slot_mapping >= 0]] = True
    written = written.view(NUM_BLOCKS, BS)
    assert not torch.equal(exact[1], k)  # the step did write
    for got in (exact, padded, wider):
        torch.testing.assert_close(got[0], exact[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[0].argmax(-1), exact[0].argmax(-1))
        for out, before in ((got[1], k), (got[2], v)):
            torch.testing.assert_close(out, exact[1] if out is got[1] else exact[2], rtol=1e-5, atol=1e-5)
            assert torch.equal(bits(out[:, ~written]), bits(before[:, ~written]))


def test_too_small_bucket_is_refused():
    model = ours_from(hf_model())
    k = torch.zeros(model.cache_shape(NUM_BLOCKS, BS))
    with pytest.raises(NoBucketFits, match="40 tokens"):
        pad_prefill([segment(list(range(40)), 0, [1, 2, 3, 4, 5])],
                    Bucket("prefill", 1, 32, CTX), BS)
    step = pad_decode([segment([1], 20, [3, 4, 5])], Bucket("decode", 2, 1, 24), BS)
    narrow = step.block_table[:, :2]  # a graph whose ctx (16) cannot hold the 20 cached tokens
    args = (*step.args()[:3], narrow, *step.args()[4:])
    with pytest.raises(ValueError, match="exceeds the bucket's ctx 16"):
        model(*args, k, k.clone())


def test_mismatched_cache_geometry_is_refused():
    model = ours_from(hf_model())
    step = pad_decode([segment([1], 3, [3])], Bucket("decode", 1, 1, CTX), BS)
    wrong = torch.zeros(2, NUM_BLOCKS, BS, 4, 16)  # 4 kv heads; the model has 2
    with pytest.raises(ValueError, match=r"cache geometry \(2, 48, 8, 4, 16\)"):
        model(*step.args(), wrong, wrong.clone())
    with pytest.raises(ValueError, match="must be equal 5-D"):
        model(*step.args(), wrong[0], wrong[0].clone())


def test_export_keeps_static_shapes_and_mutates_the_caches_in_place():
    model = ours_from(hf_model())
    step = pad_decode([segment([5, 6], 9, [7, 3])], Bucket("decode", 2, 2, 32), BS)
    k, v = torch.zeros(model.cache_shape(16, BS)), torch.zeros(model.cache_shape(16, BS))
    with torch.no_grad():
        ep = torch.export.export(model, (*step.args(), k, v))
        mutated = ep.run_decompositions().graph_signature.user_inputs_to_mutate
        assert sorted(mutated.values()) == ["k_cache", "v_cache"]
        want, k_want, v_want = run_step(model, step, k, v)
        got = ep.module()(*step.args(), k, v)
    assert torch.equal(got[: step.num_samples], want)
    assert torch.equal(k, k_want) and torch.equal(v, v_want)


def test_model_runs_the_kernels_a_backend_swaps_in():
    """Every layer's cache write and attention go through the dispatch, so NKI can replace them."""
    model = ours_from(hf_model())
    calls = []
    golden = dispatch.GOLDEN

    def write(*args):
        calls.append("write")
        golden.write_kv_cache(*args)

    def attend(*args):
        calls.append("attend")
        return golden.block_kv_attention(*args)

    step = pad_decode([segment([5], 9, [7, 3])], Bucket("decode", 2, 1, 32), BS)
    k = torch.zeros(model.cache_shape(16, BS))
    with torch.no_grad(), dispatch.use(dispatch.KernelSet("spy", write, attend)):
        model(*step.args(), k, k.clone())
    assert calls == ["write", "attend", "write", "attend"]
