# SPDX-License-Identifier: Apache-2.0
"""The prefill/decode hand-off of the generation engine (builders/generation.py, issue 38): ``Request(export=True)``
/ ``Engine.export_request`` end a request with its state as bytes (``Output.state``), ``Request(resume_from=...)``
continues it in another engine, here or in another process.

Oracle: one engine doing both (no export), on the same seeded tiny models as tests/test_generation.py (Nemotron-H)
and tests/test_prefix_cache.py (Qwen3.5): the first token from the prefill side followed by the decode side's tokens
must equal its tokens exactly, greedy and seeded-sampled (the state crosses bit for bit: the step's tensors and the
cache's snapshot, safetensors inside a versioned, crc-checked frame; a seeded draw depends on (seed, position)
only); greedy ones also equal transformers' ``generate``. Across processes: two subprocesses on the CPU load a
checkpoint written with ``save_pretrained`` (the project's loader, builders/triton_generate.py ``load_model``). A
state that does not fit (another family, dtype, SSM mode, ring length, a corrupted or foreign byte string, a
prompt or max_tokens that contradicts it) is refused at submit with a RequestError naming it, nothing queued.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import STATE_MAGIC, Engine, Request, RequestError  # noqa: E402
from builders.qwen3_next import tiny_model  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

from .test_generation import Collect, reference  # noqa: E402
from .test_preemption import assert_no_leak  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = pathlib.Path(__file__).resolve().parent.parent
JOBS = [dict(prompt=[5, 9, 13, 200, 7, 1, 2, 3, 4], max_tokens=10),  # greedy
        dict(prompt=[100] * 6, max_tokens=9, temperature=0.9, top_p=0.95, seed=77)]  # seeded sampling
KW = dict(max_seq_len=48, mode="replay", buffer_len=4)


def make(family):
    if family == "nemotron_h":
        return build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    return tiny_model(family, seed=0)


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return make(family)


def one_process(model, **kw):
    """Every job prefilled and decoded by one engine: the oracle."""
    eng = Engine(model, max_slots=2, **{**KW, **kw})
    got = Collect()
    ids = [eng.submit(Request(on_output=got, **j)) for j in JOBS]
    eng.run_until_idle()
    return [got.tokens[i] for i in ids]


def _worker(role: str, model_dir: str, work: str) -> None:
    """One side of the hand-off in its own process: "prefill" exports every job's state to WORK/state<k>.bin and its
    outputs to WORK/prefill.json; "decode" resumes them (prompt and seed taken from the state) into WORK/decode.json."""
    from builders.triton_generate import load_model

    torch.set_num_threads(1)
    work = pathlib.Path(work)
    model = load_model(dict(model_dir=model_dir, dtype="float32"), torch.device("cpu"))
    got = Collect()
    if role == "prefill":
        eng = Engine(model, max_slots=2, **KW)
        ids = [eng.submit(Request(on_output=got, export=True, **j)) for j in JOBS]
        eng.run_until_idle()
        for k, i in enumerate(ids):
            (work / f"state{k}.bin").write_bytes(got.final[i].state)
        out = [dict(tokens=got.tokens[i], reason=got.final[i].finish_reason) for i in ids]
    else:  # another geometry of slots: more of them, a longer K/V row (the state does not depend on either)
        eng = Engine(model, max_slots=3, max_seq_len=64, mode="replay", buffer_len=4)
        ids = [eng.submit(Request([], j["max_tokens"], temperature=j.get("temperature", 0.0), top_p=j.get("top_p", 1.0),
                                  resume_from=(work / f"state{k}.bin").read_bytes(), on_output=got))
               for k, j in enumerate(JOBS)]
        eng.run_until_idle()
        assert_no_leak(eng)
        out = [dict(tokens=got.tokens[i], reason=got.final[i].finish_reason,
                    completion=got.final[i].completion_tokens, prompt=got.final[i].prompt_tokens) for i in ids]
        out = dict(jobs=out, imports=eng.stats["imports"])
    (work / f"{role}.json").write_text(json.dumps(out))


def _spawn(role, model_dir, work):
    code = f"from tests.test_handoff import _worker; _worker({role!r}, {str(model_dir)!r}, {str(work)!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{role} process failed:\n{r.stderr[-4000:]}"
    return json.loads((work / f"{role}.json").read_text())


def test_prefill_in_one_process_decode_in_another(family, model, tmp_path):
    """save_pretrained; process 1 prefills both jobs and exports them (first token, then "exported"); process 2
    (3 slots, longer K/V rows) resumes them; first token + continuation == one engine doing both (== generate for
    the greedy job)."""
    model.save_pretrained(tmp_path / "model")
    pre = _spawn("prefill", tmp_path / "model", tmp_path)
    dec = _spawn("decode", tmp_path / "model", tmp_path)
    want = one_process(model)
    assert want[0] == reference(model, JOBS[0]["prompt"], JOBS[0]["max_tokens"])
    assert dec["imports"] == 2
    for k, j in enumerate(JOBS):
        assert pre[k]["reason"] == "exported" and len(pre[k]["tokens"]) == 1
        d = dec["jobs"][k]
        assert (d["reason"], d["completion"], d["prompt"]) == ("length", j["max_tokens"], len(j["prompt"]))
        assert pre[k]["tokens"] + d["tokens"] == want[k], k
    assert (tmp_path / "state0.bin").read_bytes()[:8] == STATE_MAGIC


def test_export_of_a_running_and_a_swapped_out_request(model):
    """Engine.export_request on a request mid-decode (live) and on one swapped out by preemption: each ends with
    "exported"; another engine resumes it (into a slot other than its own) and the whole equals one engine."""
    want = one_process(model)
    src = Engine(model, max_slots=1, preempt=True, preempt_quantum=3, **KW)
    got = Collect()
    ids = [src.submit(Request(on_output=got, **j)) for j in JOBS]
    while not src.swapped:
        src.step_once()
    swapped, live = src.swapped[0].req.request_id, src.live[0].req.request_id
    assert src.export_request(swapped) and src.export_request(live) and not src.export_request("nope")
    src.step_once()
    assert src.stats["exports"] == 2 and not src.pending()
    assert_no_leak(src)
    dst = Engine(model, max_slots=3, **KW)
    dst.submit(Request([1], 3))  # takes slot 0 first: the resumed ones land elsewhere
    more = Collect()
    res = {}
    for k, i in enumerate(ids):
        assert got.final[i].finish_reason == "exported"
        j = JOBS[k]
        res[i] = dst.submit(Request(j["prompt"], j["max_tokens"], temperature=j.get("temperature", 0.0),
                                    top_p=j.get("top_p", 1.0), resume_from=got.final[i].state, on_output=more))
    dst.run_until_idle()
    for k, i in enumerate(ids):
        assert got.tokens[i] + more.tokens[res[i]] == want[k], k
        assert more.final[res[i]].completion_tokens == JOBS[k]["max_tokens"]
    assert_no_leak(dst)


def test_export_states_a_conventional_engine_too(model):
    """The conventional SSM mode hands its fp32 state over as tensors (no cache snapshot): the same equality."""
    want = one_process(model, mode="conventional")
    src, dst = (Engine(model, max_slots=2, **{**KW, "mode": "conventional"}) for _ in range(2))
    got, more = Collect(), Collect()
    ids = [src.submit(Request(on_output=got, export=True, **j)) for j in JOBS]
    src.run_until_idle()
    res = [dst.submit(Request([], j["max_tokens"], temperature=j.get("temperature", 0.0), top_p=j.get("top_p", 1.0),
                              resume_from=got.final[i].state, on_output=more)) for i, j in zip(ids, JOBS)]
    dst.run_until_idle()
    for k, (i, r) in enumerate(zip(ids, res)):
        assert got.tokens[i] + more.tokens[r] == want[k], k


def test_mismatched_states_are_refused_naming_the_difference():
    """Each mismatch is a RequestError at submit naming what differs; nothing is queued."""
    nem = make("nemotron_h")
    src = Engine(nem, max_slots=1, **KW)
    got = Collect()
    i = src.submit(Request([5, 9, 13], 8, export=True, on_output=got))
    src.run_until_idle()
    state = got.final[i].state
    assert got.final[i].finish_reason == "exported" and got.final[i].completion_tokens == 1
    bf16 = build_model(model_config(tiny=True), "cpu", torch.bfloat16, seed=0)
    bad_crc = bytearray(state)
    bad_crc[-100] ^= 1
    cases = [
        (Engine(nem, max_slots=1, **{**KW, "buffer_len": 8}), state, {}, "buffer_len: 4 in the snapshot, 8 in the cache"),
        (Engine(nem, max_slots=1, **{**KW, "mode": "conventional"}), state, {},
         "ssm_mode: 'replay' in the state, 'conventional' in this engine"),
        (Engine(nem, max_slots=1, **{**KW, "mode": "replay_bf16"}), state, {}, "ssm_mode: 'replay' in the state"),
        (Engine(bf16, max_slots=1, **KW), state, {}, "dtype: 'float32' in the state, 'bfloat16' in this engine"),
        (Engine(make("qwen3_5"), max_slots=1, **KW), state, {}, "model_type: 'nemotron_h' in the state"),
        (Engine(nem, max_slots=1, **KW), bytes(bad_crc), {}, "resume_from: .*crc32"),
        (Engine(nem, max_slots=1, **KW), b"RSSMSNAP" + state[8:], {}, "resume_from: wrong magic"),
        (Engine(nem, max_slots=1, **KW), state[:8] + (2).to_bytes(4, "little") + state[12:], {},
         "resume_from: format version 2"),
        (Engine(nem, max_slots=1, **KW), state[:-5], {}, "resume_from: truncated"),
        (Engine(nem, max_slots=1, **KW), "text", {}, "resume_from: expected bytes"),
        (Engine(nem, max_slots=1, **KW), state, dict(prompt=[5, 9, 14]), "prompt: differs from the exported"),
        (Engine(nem, max_slots=1, **KW), state, dict(max_tokens=1), "max_tokens: 1, but the exported request has "
                                                                     "generated 1"),
    ]
    for eng, data, kw, match in cases:
        with pytest.raises(RequestError, match=match):
            eng.submit(Request(**{"prompt": [], "max_tokens": 8, "resume_from": data, **kw}))
        assert eng.pending() == 0 and eng.stats["imports"] == 0
    ok = Engine(nem, max_slots=1, **KW)  # the untouched state still goes in
    ok.submit(Request([5, 9, 13], 8, resume_from=state))
    ok.run_until_idle()
    assert ok.stats["imports"] == 1
