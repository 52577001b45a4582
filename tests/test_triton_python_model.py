# SPDX-License-Identifier: Apache-2.0
"""The Python-backend sequence model (``trtllm_replayssm/triton_model.py``) in process, without a server:
``SequenceModel`` driven through a stand-in of ``triton_python_backend_utils`` whose tensors exist only
as DLPack (``as_numpy`` raises, so the numpy path that numpy 2.x breaks in the real stub is never taken),
the slot table with an injected clock, and the repository config of ``make_triton_repo.py --backend python``.
tests/test_triton_server.py runs the same model in a real tritonserver.

Oracles: the patched transformers model (``builders.nemotron_h.patch_replayssm``, float64 SSM backend,
fp32 weights) per sequence, one token at a time; tolerance 1e-4 on logits of std ~1 (fp32 rounding in a
different order over <= 8 layers and 16 steps, measured <= 4e-6; tests/test_triton_server.py's docstring).
Bookkeeping (slots, lengths, cursors, which rows get errors) exactly. On CUDA (``gpu`` marker) the same
model with the kernels against itself on the CPU (float64 reference), tolerance below.
"""

import functools
import importlib.util
import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")

from builders import triton_repo as tr  # noqa: E402  (the repository writer)
from trtllm_replayssm import triton_model as tm  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("make_triton_repo", ROOT / "scripts" / "make_triton_repo.py")
mtr = importlib.util.module_from_spec(spec)  # its command line
spec.loader.exec_module(mtr)

TOL = 1e-4  # module docstring
MAX_SEQ, L = 16, 4


# ---- a stand-in of triton_python_backend_utils (the calls SequenceModel makes) ------------------------------
class Tensor:
    def __init__(self, name, t):
        self._name, self.t = name, t

    def name(self):
        return self._name

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.t)

    @classmethod
    def from_dlpack(cls, name, capsule):
        return cls(name, torch.from_dlpack(capsule))

    def as_numpy(self):
        raise AssertionError("the numpy path was used (wrong under numpy 2.x in Triton 2.51's stub)")


class TritonError(Exception):
    INVALID_ARG = 3

    def __init__(self, msg, code=None):
        super().__init__(msg)
        self.code = code


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.t for t in output_tensors}
        self.error = error


class FakePb:
    Tensor, TritonError, InferenceResponse = Tensor, TritonError, InferenceResponse

    class Logger:
        lines = []
        log_info = log_warn = staticmethod(lambda msg: FakePb.Logger.lines.append(msg))

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)


def request(corrid, token, start=False, end=False, ready=True):
    i32 = lambda v: Tensor("", torch.tensor([[int(v)]], dtype=torch.int32))  # noqa: E731
    return {"START": i32(start), "END": i32(end), "READY": i32(ready),
            "CORRID": Tensor("", torch.tensor([[corrid]], dtype=torch.uint64)),
            "input_ids": Tensor("", torch.tensor([[token]], dtype=torch.int64))}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make_args(tmp_path, tiny="nemotron_h", slots=4, idle_us=1_000_000, device="cpu", shadow="none"):
    target = tr.make_python_repo(tmp_path / "repo", "m", tiny=tiny, device=device, max_slots=slots,
                                  max_seq_len=MAX_SEQ, buffer_len=L, idle_us=idle_us, shadow=shadow)
    from google.protobuf import json_format, text_format

    mc = text_format.Parse((target / "config.pbtxt").read_text(), pb2.ModelConfig())
    # Triton hands the config to initialize() as JSON with the proto field names
    cfg = json_format.MessageToDict(mc, preserving_proto_field_name=True)
    return {"model_config": json.dumps(cfg), "model_instance_kind": "CPU", "model_instance_device_id": "0"}


@functools.cache
def oracle(tiny="nemotron_h"):
    """logits(tokens) of the patched transformers model, one token at a time."""
    from transformers import DynamicCache

    from builders.nemotron_h import load_nemotron_h, patch_replayssm
    from builders.qwen3_next import FAMILIES, patch_gdn_replayssm, tiny_model

    if tiny in FAMILIES:  # Qwen3-Next / Qwen3.5: the GDN layers on the float64 ReplaySSM GDN reference
        model = tiny_model(tiny, seed=0)

        @torch.no_grad()
        def run_gdn(tokens):
            dec = patch_gdn_replayssm(model, buffer_len=L)
            try:
                cache = DynamicCache(config=model.config)
                return torch.stack([model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float()
                                    for t in tokens])
            finally:
                dec.unpatch()

        return run_gdn
    model = load_nemotron_h(tiny=tiny, seed=0)
    # dt clamp as the config says (time_step_limit, (0, inf) here), as transformers >= 5.25 and our step
    # do; 5.24's mixer clamps softplus(dt) at time_step_min instead (1e-3 logit differences on this
    # model, and 0.0 once the limit is the config's: bench/NOTES.md, "transformers 5.24 dt clamp")
    for mod in model.modules():
        if hasattr(mod, "time_step_limit"):
            mod.time_step_limit = tuple(model.config.time_step_limit)
    dec = patch_replayssm(model, buffer_len=L)

    @torch.no_grad()
    def run(tokens):
        dec.reset()
        cache = DynamicCache(config=model.config)
        return torch.stack([model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float()
                            for t in tokens])

    return run


def err(resp):
    return None if resp.error is None else str(resp.error)


# ---- the model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiny", ("nemotron_h", "nemotron3", "qwen3_next", "qwen3_5", "qwen3_5_moe"))
def test_batches_with_bad_rows_match_the_patched_model(tmp_path, tiny):
    """Three sequences through 16 batches of changing composition (start, continue, end at different
    steps), bad rows mixed into the same batches; every good row's logits match the oracle and the bad
    rows change nothing (the oracle would notice)."""
    clock = Clock()
    m = tm.SequenceModel(FakePb, make_args(tmp_path, tiny), clock=clock)
    gen = torch.Generator().manual_seed(3)
    seqs = {7: torch.randint(0, 256, (MAX_SEQ,), generator=gen).tolist(),
            8: torch.randint(0, 256, (6,), generator=gen).tolist(),
            9: torch.randint(0, 256, (10,), generator=gen).tolist()}
    begin = {7: 0, 8: 2, 9: 5}
    got = {c: [] for c in seqs}
    slots = {}
    for step in range(MAX_SEQ + 1):
        clock.t += 0.01
        reqs, who = [], []
        for c, toks in seqs.items():
            k = step - begin[c]
            if 0 <= k < len(toks):
                reqs.append(request(c, toks[k], start=k == 0, end=k == len(toks) - 1))
                who.append(c)
        bad = [request(42, 1), request(8, 256), request(7, 3, ready=False)]  # unknown; vocab; READY = 0
        if step == MAX_SEQ:
            bad.append(request(7, 1))  # 7 ended at step 15 (its 16th token carried END)
        reqs, who = bad[:2] + reqs + bad[2:], ["bad", "bad"] + who + ["bad"] * (len(bad) - 2)
        out = m.execute(reqs)
        assert len(out) == len(reqs)
        for c, resp in zip(who, out):
            if c == "bad":
                assert resp.error is not None
                continue
            assert resp.error is None, err(resp)
            got[c].append(resp.outputs["logits"][0])
            slots.setdefault(c, set()).add(int(resp.outputs["slot"][0, 0]))
        msgs = [err(r) for r in out[:2]]
        assert "sequence 42 is unknown" in msgs[0] and "sequence_start=True" in msgs[0]
        # the bad row of 8 comes before 8's own row: unknown at step 2 (its START is later in the batch)
        assert ("input_ids: expected a token in [0, 256), got 256" in msgs[1]) == (3 <= step <= 7), (step, msgs)
    assert "sequence 7 is over (ended by sequence_end)" in err(out[-1])
    for c, toks in seqs.items():
        torch.testing.assert_close(torch.stack(got[c]), oracle(tiny)(toks), rtol=0, atol=TOL)
    assert [len(slots[c]) for c in seqs] == [1, 1, 1] and len({min(s) for s in slots.values()}) == 3
    assert not m.table.live  # every sequence ended: every slot free
    assert m.step.cache.num_free == 4


@pytest.mark.parametrize("tiny, shadow", [("nemotron_h", "bf16"), ("nemotron3", "fp8"), ("qwen3_next", "bf16")])
def test_shadow_model_reads_its_shadow_and_stays_near_the_oracle(tmp_path, tiny, shadow):
    """``make_triton_repo --shadow``: the cache keeps a shadow of each checkpoint that non-flush steps read (the
    float64 reference reads it too on the CPU, as the kernels do). A sequence over 3L + 1 tokens stays within
    the shadow's rounding of the fp32 oracle, is not equal to it (the shadow is read), and after the last flush
    every live slot's shadow is quantize_shadow of its checkpoint."""
    from trtllm_replayssm.reference import quantize_shadow

    m = tm.SequenceModel(FakePb, make_args(tmp_path, tiny, shadow=shadow), clock=Clock())
    assert m.params["shadow"] == shadow
    toks = torch.randint(0, 256, (3 * L + 1,), generator=torch.Generator().manual_seed(4)).tolist()
    got = torch.stack([m.execute([request(5, t, start=k == 0)])[0].outputs["logits"][0] for k, t in enumerate(toks)])
    want = oracle(tiny)(toks)
    diff = float((got - want).abs().max())
    assert 0 < diff < (2e-2 if shadow == "bf16" else 1e-1) * float(want.abs().max()), diff
    c, slot = m.step.cache, m.table.live[5].slot
    if c.num_layers:  # Mamba-2: the shadow of the stored checkpoint (the last flush wrote both)
        kind = torch.bfloat16 if shadow == "bf16" else torch.float8_e4m3fn
        q = torch.empty(c.state[:, slot].shape, dtype=kind)
        scale = None if shadow == "bf16" else torch.empty(c.state[:, slot].shape[:-1])
        quantize_shadow(c.state[:, slot], q, scale)
        assert torch.equal(c.shadow[:, slot].view(torch.uint8), q.view(torch.uint8))


def test_shadow_options_are_checked(tmp_path):
    with pytest.raises(tr.RepoError, match="there is no fp8 GDN shadow"):
        tr.make_python_repo(tmp_path / "r", "q", tiny="qwen3_next", device="cpu", shadow="fp8")
    with pytest.raises(tr.RepoError, match="--shadow: expected none, bf16 or fp8"):
        tr.make_python_repo(tmp_path / "r", "q", device="cpu", shadow="fp4")
    assert not (tmp_path / "r").exists()


def test_over_long_end_and_two_requests_of_one_sequence(tmp_path):
    m = tm.SequenceModel(FakePb, make_args(tmp_path), clock=Clock())  # no idle timeout however slow the machine
    toks = list(range(10, 10 + MAX_SEQ))
    out = [m.execute([request(1, t, start=k == 0)])[0] for k, t in enumerate(toks)]
    assert all(r.error is None for r in out)
    over = m.execute([request(1, 5)])[0]
    assert f"sequence 1 holds {MAX_SEQ} tokens = max_seq_len {MAX_SEQ}" in err(over)
    assert m.table.live[1].length == MAX_SEQ and int(m.step.lengths[m.table.live[1].slot]) == MAX_SEQ
    assert "max_seq_len" in err(m.execute([request(1, 5, end=True)])[0])  # refused, but the END frees the slot
    assert 1 not in m.table.live and m.step.cache.num_free == 4
    # two requests of one sequence in one batch (the oldest strategy never sends this): run in order
    a, b = m.execute([request(2, 10, start=True), request(2, 11)])
    assert a.error is None and b.error is None
    want = oracle()([10, 11])
    torch.testing.assert_close(torch.stack([a.outputs["logits"][0], b.outputs["logits"][0]]), want, rtol=0, atol=TOL)
    # START for a live sequence begins again from zeros
    again = m.execute([request(2, 10, start=True)])[0]
    torch.testing.assert_close(again.outputs["logits"][0], want[0], rtol=0, atol=TOL)
    # two requests of one sequence one token short of max_seq_len: the first runs, the second is refused for
    # room before any step (it used to pass the room check too, then fail inside the step and drop the sequence)
    for t in range(11, 10 + MAX_SEQ - 1):
        assert m.execute([request(2, t)])[0].error is None
    assert m.table.live[2].length == MAX_SEQ - 1
    a, b = m.execute([request(2, 7), request(2, 8)])
    assert a.error is None and f"holds {MAX_SEQ - 1} tokens + 1 earlier in this batch = max_seq_len" in err(b)
    assert m.table.live[2].length == MAX_SEQ  # the sequence lives on


def _fail_next_attention(m, monkeypatch) -> None:
    """The model's next attention call raises RuntimeError("injected"); later calls run as before."""
    orig, boom = m.step._attention, {"n": 1}

    def failing(*a, **k):
        if boom["n"]:
            boom["n"] -= 1
            raise RuntimeError("injected")
        return orig(*a, **k)

    monkeypatch.setattr(m.step, "_attention", failing)


@pytest.mark.parametrize("tiny", ("nemotron_h", "qwen3_5_moe"))
def test_a_failed_step_drops_its_sequences_and_the_model_serves_on(tmp_path, tiny, monkeypatch):
    """A step that raises mid-model: its sequences are dropped with an error, the cache's open step is aborted,
    and the next batch runs (the cache refused to open a step over one with verified layers)."""
    m = tm.SequenceModel(FakePb, make_args(tmp_path, tiny=tiny), clock=Clock())
    assert m.execute([request(1, 10, start=True)])[0].error is None
    _fail_next_attention(m, monkeypatch)
    assert "step failed (RuntimeError: injected)" in err(m.execute([request(1, 11)])[0])
    assert 1 not in m.table.live
    got = [m.execute([request(2, t, start=k == 0)])[0] for k, t in enumerate((10, 11, 12))]
    assert all(r.error is None for r in got)
    want = oracle(tiny)([10, 11, 12])
    torch.testing.assert_close(torch.stack([r.outputs["logits"][0] for r in got]), want, rtol=0, atol=TOL)


def test_a_restart_or_end_later_in_the_batch_leaves_the_new_sequence_fresh(tmp_path):
    """A START (or an END, then a START) of a sequence whose earlier request is in the same batch: the earlier
    row used to run after the restart had freed its slot and handed it to the new sequence (the lowest free
    slot: the same one), so the new sequence began on the old one's token; and the batch's END was applied
    at its end, freeing the sequence that started after it."""
    m = tm.SequenceModel(FakePb, make_args(tmp_path), clock=Clock())
    a, b = m.execute([request(2, 10, start=True), request(2, 11, start=True)])
    assert a.error is None and b.error is None
    torch.testing.assert_close(a.outputs["logits"][0], oracle()([10])[0], rtol=0, atol=TOL)
    torch.testing.assert_close(b.outputs["logits"][0], oracle()([11])[0], rtol=0, atol=TOL)  # from zeros
    a, b = m.execute([request(2, 12, end=True), request(2, 13, start=True)])
    assert a.error is None and b.error is None
    torch.testing.assert_close(a.outputs["logits"][0], oracle()([11, 12])[1], rtol=0, atol=TOL)
    torch.testing.assert_close(b.outputs["logits"][0], oracle()([13])[0], rtol=0, atol=TOL)
    c = m.execute([request(2, 14)])[0]  # the sequence that started after the END lives on
    assert c.error is None, err(c)
    torch.testing.assert_close(c.outputs["logits"][0], oracle()([13, 14])[1], rtol=0, atol=TOL)
    a, b = m.execute([request(2, 15, end=True), request(2, 16)])  # a request after the END: the sequence is over
    assert a.error is None and "sequence 2 is over (ended by sequence_end)" in err(b)
    assert not m.table.live and m.step.cache.num_free == 4


def test_a_failed_step_fails_the_later_rows_of_its_sequences(tmp_path, monkeypatch):
    """Two requests of one sequence in a batch, the first round's step fails: the second row used to run on the
    dropped sequence's freed slot and come back as a success when the cache does not check rows (CUDA:
    check_values=False); the sequence's next request is told the step failed, not that it was ended."""
    m = tm.SequenceModel(FakePb, make_args(tmp_path), clock=Clock())
    m.step.cache.check_values = False  # as on CUDA
    _fail_next_attention(m, monkeypatch)
    a, b = m.execute([request(1, 10, start=True), request(1, 11)])
    assert "step failed (RuntimeError: injected)" in err(a) and "step failed (RuntimeError: injected)" in err(b)
    assert not m.table.live and m.step.cache.num_free == 4
    c = err(m.execute([request(1, 12)])[0])
    assert "sequence 1 is over (step failed (RuntimeError: injected))" in c, c


def test_idle_sequences_are_freed_and_reset(tmp_path):
    clock = Clock()
    m = tm.SequenceModel(FakePb, make_args(tmp_path, slots=2, idle_us=500_000), clock=clock)
    m.execute([request(1, 5, start=True), request(2, 6, start=True)])
    clock.t = 0.4
    m.execute([request(2, 7)])  # 2 stays fresh
    clock.t = 0.8  # 1 idle for 0.8 s > 0.5 s
    r = m.execute([request(1, 8)])[0]
    assert "sequence 1 is over (idle for more than 0.5 s" in err(r)
    assert sorted(m.table.live) == [2] and m.step.cache.num_free == 1
    new = m.execute([request(3, 9, start=True)])[0]
    torch.testing.assert_close(new.outputs["logits"][0], oracle()([9])[0], rtol=0, atol=TOL)  # reset slot
    # no free slot at START (Triton timed out one we have not expired yet): the least recently used goes
    clock.t = 0.85  # 2 idle 0.45 s, 3 idle 0.05 s: neither expired
    m.execute([request(4, 9, start=True)])
    assert sorted(m.table.live) == [3, 4] and any("no free slot" in line for line in FakePb.Logger.lines)


def test_sequence_table_bookkeeping():
    free = []
    slots = iter(range(100))
    t = tm.SequenceTable(lambda: next(slots), free.append, num_slots=2, max_seq_len=3, idle_s=1.0)
    a = t.admit(10, True, now=0.0)
    b = t.admit(11, True, now=0.5)
    assert (a.slot, b.slot) == (0, 1)
    with pytest.raises(tm.RequestError, match="sequence 12 is unknown"):
        t.admit(12, False, now=0.5)
    assert t.expire(1.2) == [10] and free == [0]  # idle 1.2 > 1.0; 11 idle 0.7
    with pytest.raises(tm.RequestError, match=r"sequence 10 is over \(idle"):
        t.admit(10, False, now=1.2)
    b.length = 3
    with pytest.raises(tm.RequestError, match="holds 3 tokens = max_seq_len 3"):
        t.check_room(b)
    b.length = 2
    t.check_room(b)
    with pytest.raises(tm.RequestError, match="holds 2 tokens . 1 earlier in this batch = max_seq_len 3"):
        t.check_room(b, pending=1)
    t.end(11)
    assert free == [0, 1] and not t.live
    c = t.admit(10, True, now=2.0)  # an expired CORRID may start again
    assert c.slot == 2 and 10 not in t.gone


# ---- the repository config --------------------------------------------------------------------------------
def test_python_repo_config_and_model_py(tmp_path):
    from google.protobuf import text_format

    target = tr.make_python_repo(tmp_path / "r", "nh", device="cpu", max_slots=3, max_seq_len=32, buffer_len=8,
                                  idle_us=2_000_000)
    mc = text_format.Parse((target / "config.pbtxt").read_text(), pb2.ModelConfig())
    assert mc.backend == "python" and mc.max_batch_size == 3 and not mc.sequence_batching.state  # no implicit state
    assert mc.sequence_batching.oldest.max_candidate_sequences == 3
    assert [c.name for c in mc.sequence_batching.control_input] == ["START", "END", "READY", "CORRID"]
    assert [(i.name, list(i.dims)) for i in mc.input] == [("input_ids", [1])]
    assert [(o.name, list(o.dims)) for o in mc.output] == [("logits", [256]), ("slot", [1])]
    assert mc.instance_group[0].kind == pb2.ModelInstanceGroup.KIND_CPU
    p = {k: v.string_value for k, v in mc.parameters.items()}
    assert p["python_path"].split(":")[0] == str(ROOT) and p["tiny"] == "nemotron_h" and p["buffer_len"] == "8"
    compile((target / "1" / "model.py").read_text(), "model.py", "exec")
    with pytest.raises(tr.RepoError, match="already exists"):
        tr.make_python_repo(tmp_path / "r", "nh", device="cpu")


def test_model_py_refuses_another_python(tmp_path):
    ns = {}
    exec(compile(tr.MODEL_PY, "model.py", "exec"), ns)
    cfg = {"parameters": {"python_version": {"string_value": "2.7"}, "python_libdir": {"string_value": "/x/lib"}}}
    with pytest.raises(RuntimeError, match="built with Python 2.7.*LD_LIBRARY_PATH=/x/lib"):
        ns["_setup_path"](cfg)


@pytest.mark.parametrize("kw, match", [
    (dict(buffer_len=0), "--buffer-len: expected 1..32"),
    (dict(buffer_len=33), "--buffer-len: expected 1..32"),
    (dict(max_slots=0), "--max-slots"),
    (dict(max_seq_len=0), "--max-seq-len"),
    (dict(dtype="int8"), "--dtype"),
    (dict(tiny="nope"), "--tiny: expected one of"),
    (dict(model_dir=pathlib.Path("/nonexistent")), "--model: expected a checkpoint directory"),
])
def test_python_repo_rejects_bad_options(tmp_path, kw, match):
    with pytest.raises(tr.RepoError, match=match):
        tr.make_python_repo(tmp_path / "r", "nh", **{"device": "cpu", **kw})
    assert not (tmp_path / "r" / "nh").exists()


def test_cli_python_backend(tmp_path, capsys):
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu"]) == 0
    assert (tmp_path / "r" / "nemotron_h_replayssm" / "1" / "model.py").is_file()
    assert "wrote" in capsys.readouterr().out
    assert mtr.main(["--repo", str(tmp_path / "r2")]) == 2  # tensorrt_plan needs --engine-dir


@pytest.mark.parametrize("tiny", ["qwen3_5_moe", "nemotron3"])
def test_default_name_follows_the_model(tmp_path, tiny):
    """The repository's model is named after the model it serves (was nemotron_h_replayssm for every model);
    --name still sets it."""
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu", "--tiny", tiny]) == 0
    assert (tmp_path / "r" / f"{tiny}_replayssm" / "1" / "model.py").is_file()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe", "vocab_size": 64}')
    assert tr.default_name(model_dir=ckpt) == "qwen3_5_moe_replayssm"
    assert tr.default_name(engine_cfg={"model": {"source": "x"}}) == "nemotron_h_replayssm"


# ---- CUDA: the kernels behind the same model ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shadow", ("none", "bf16", "fp8"))
def test_cuda_model_matches_the_cpu_model(tmp_path, shadow):
    """The kernels (fp32 state and activations) against the float64 reference path, both through
    SequenceModel with the same weights: 3 sequences, 16 steps, several folds of the L = 4 ring, the
    cursors and lengths exactly. Tolerance 2e-3 absolute on logits of std ~1: fp32 kernel sums (dstate +
    L terms per output; tests/test_cache_gpu.py: 2e-5 relative) and fp32 GEMMs (TF32 off) through 8
    layers and 16 steps. The model is built from transformers' classes directly (not load_nemotron_h),
    so this runs under the H200 image's transformers 5.17 too."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    from transformers import NemotronHConfig, NemotronHForCausalLM

    from builders.nemotron_h import TINY_CONFIG, randomize_

    model = randomize_(NemotronHForCausalLM(NemotronHConfig(**TINY_CONFIG)), 0).eval()
    _cuda_against_cpu(tmp_path, model, "nemotron_h", shadow)


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", ("qwen3_next", "qwen3_5", "qwen3_5_moe"))
def test_cuda_qwen_model_matches_the_cpu_model(tmp_path, tiny):
    """As above for Qwen3-Next / Qwen3.5 (QwenSlotStep): the GDN kernels (gdn_replay_verify on the rings,
    T = 1, fp32 state) against the float64 GDN reference, same tolerance (the GDN sums have 2K + L terms
    per output; tests/test_gdn_cache_gpu.py: 2e-5 relative on the state)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from builders.qwen3_next import tiny_model

    _cuda_against_cpu(tmp_path, tiny_model(tiny, seed=0), tiny)


def _cuda_against_cpu(tmp_path, model, tiny, shadow="none"):
    """(shadow: both read the same shadow; the fp8 one rounds the same way, reference.quantize_shadow)"""
    import copy

    clock = Clock()  # not the wall clock: the first CUDA step compiles kernels for longer than the idle timeout
    cpu = tm.SequenceModel(FakePb, make_args(tmp_path / "c", tiny, shadow=shadow), clock=clock, model=model)
    gpu = tm.SequenceModel(FakePb, make_args(tmp_path / "g", tiny, device="cuda", shadow=shadow), clock=clock,
                           model=copy.deepcopy(model).cuda())
    assert gpu.step.cache.uses_kernels and not cpu.step.cache.uses_kernels
    gen = torch.Generator().manual_seed(5)
    seqs = {c: torch.randint(0, 256, (n,), generator=gen).tolist() for c, n in ((1, 16), (2, 9), (3, 13))}
    worst = 0.0
    for step in range(MAX_SEQ):
        reqs = [request(c, t[step], start=step == 0, end=step == len(t) - 1) for c, t in seqs.items()
                if step < len(t)]
        for a, b in zip(cpu.execute(reqs), gpu.execute(reqs)):
            assert a.error is None and b.error is None, (err(a), err(b))
            assert int(a.outputs["slot"][0, 0]) == int(b.outputs["slot"][0, 0])
            worst = max(worst, float((a.outputs["logits"] - b.outputs["logits"]).abs().max()))
        if step == 5:  # mid-run, every slot live: the bookkeeping exactly
            torch.testing.assert_close(gpu.step.cache.cursor.cpu(), cpu.step.cache.cursor, rtol=0, atol=0)
            torch.testing.assert_close(gpu.step.lengths.cpu(), cpu.step.lengths, rtol=0, atol=0)
    print(f"CUDA vs CPU model: max |logit difference| {worst:.3g}")
    # with a shadow, an fp32 difference in a flushed checkpoint can round one shadow value to the neighbouring
    # bf16 / e4m3 value on one side only: one ulp of one element (2^-8 / 2^-3 relative) in one state read
    assert worst < {"none": 2e-3, "bf16": 5e-3, "fp8": 3e-2}[shadow], worst
    assert gpu.step.cache.num_free == cpu.step.cache.num_free == 4
