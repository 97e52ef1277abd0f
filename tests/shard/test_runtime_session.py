"""ShardRunner / ShardSession / LocalChain behaviour on tiny exports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.errors import InvalidArgument, ResourceExhausted
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.runtime import ShardRunner, compile_properties


def test_compile_properties():
    assert compile_properties("fast") == {"PERFORMANCE_HINT": "LATENCY"}
    assert compile_properties() == compile_properties("default") == compile_properties("exact")
    assert compile_properties("f32", 2) == {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
        "INFERENCE_NUM_THREADS": 2,
    }
    assert compile_properties("exact") == {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }
    assert compile_properties("fast", num_streams=2) == {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 2}
    with pytest.raises(InvalidArgument) as err:
        compile_properties("bf8")
    assert err.value.field == "precision" and "exact" in str(err.value)
    for kwargs, field in (({"num_threads": 0}, "num_threads"), ({"num_streams": -1}, "num_streams")):
        with pytest.raises(InvalidArgument) as err:
            compile_properties(**kwargs)
        assert err.value.field == field


def test_runner_ports(tiny_export):
    export = tiny_export("llama", 2)
    first, last = ShardRunner(export, 0, "f32"), ShardRunner(export, 1, "f32")
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    assert first.has_beam_idx and first.output_name == "hidden_states" and last.output_name == "logits"
    assert first.state_variables == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert first.compiled_properties()["KV_CACHE_PRECISION"]


def test_runner_threads_and_streams_reach_the_plugin(tiny_export):
    # The plugin never runs more streams than threads: ask for a setting it keeps as given.
    runner = ShardRunner(tiny_export("llama", 2), 0, "f32", 2, num_streams=2)
    chosen = runner.compiled_properties()
    assert (chosen["INFERENCE_NUM_THREADS"], chosen["NUM_STREAMS"]) == ("2", "2")


def test_session_validation(tiny_export):
    export = tiny_export("llama", 2)
    first, last = ShardRunner(export, 0, "f32").new_session(), ShardRunner(export, 1, "f32").new_session()
    with pytest.raises(InvalidArgument) as err:
        first.run(np.zeros((2, 3), np.int64))
    assert err.value.field == "input_ids"
    with pytest.raises(InvalidArgument) as err:
        first.run(np.zeros((1, 3), np.float32))
    assert err.value.field == "input_ids"
    with pytest.raises(InvalidArgument) as err:
        last.run(np.zeros((1, 2, 32), np.float32))
    assert err.value.field == "hidden_states"
    with pytest.raises(InvalidArgument) as err:
        first.run(np.zeros((1, 3), np.int64), np.arange(2)[None])
    assert err.value.field == "position_ids"
    with pytest.raises(InvalidArgument) as err:
        last.run(np.zeros((1, 2, 64), np.float32), return_last=3)
    assert err.value.field == "return_last"
    assert first.past_length == 0 and last.past_length == 0  # nothing ran
    first.run(np.zeros(4, np.int64))  # 1-D ids are taken as one row
    with pytest.raises(InvalidArgument) as err:
        first.invalidate(2, 5)
    assert err.value.field == "invalidate"


def test_context_limit(tiny_export):
    session = ShardRunner(tiny_export("llama", 1), 0, "f32").new_session()
    session.run(np.zeros((1, 120), np.int64))
    with pytest.raises(ResourceExhausted):
        session.run(np.zeros((1, 9), np.int64))
    assert session.past_length == 120
    session.run(np.zeros((1, 8), np.int64))
    assert session.past_length == 128


def test_reset_reproduces(tiny_export):
    session = ShardRunner(tiny_export("qwen2", 1), 0, "f32").new_session()
    ids = np.arange(10, 20, dtype=np.int64)[None]
    a = session.run(ids)
    b = session.run(ids[:, :1])
    session.reset()
    assert session.past_length == 0 and session.valid_length == 0
    np.testing.assert_array_equal(session.run(ids), a)
    np.testing.assert_array_equal(session.run(ids[:, :1]), b)


def test_sessions_are_independent(tiny_export):
    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    s1, s2 = runner.new_session(), runner.new_session()
    ids = np.arange(5, 12, dtype=np.int64)[None]
    s1.run(ids)
    s2.run(np.arange(40, 60, dtype=np.int64)[None])
    s2.invalidate(0, 10)
    got = s1.run(ids[:, :1])
    fresh = runner.new_session()
    fresh.run(ids)
    np.testing.assert_array_equal(got, fresh.run(ids[:, :1]))
    assert s1.past_length == 8 and s2.past_length == 20 and s2.valid_length == 10


@pytest.mark.parametrize("stages", [1, 3])
def test_local_chain_greedy_matches_hf(stages, tiny_model, tiny_export):
    _, hf = tiny_model("mistral")
    chain = LocalChain(tiny_export("mistral", stages), precision="f32")
    prompt = [3, 141, 59, 26, 53, 58, 97]
    res = chain.generate_greedy(prompt, 12, eos_ids=[], top2_margins=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert res.token_ids == ref[0, len(prompt) :].tolist()
    assert res.finish_reason == "length" and res.prompt_tokens == 7 and res.completion_tokens == 12
    assert res.ttft_s > 0 and res.tok_s > 0 and len(res.margins) == 12 and min(res.margins) >= 0
    stop = chain.generate_greedy(prompt, 12, eos_ids=[res.token_ids[3]])
    assert (
        stop.finish_reason == "stop"
        and stop.token_ids == res.token_ids[: res.token_ids.index(res.token_ids[3]) + 1]
    )
    ignored = chain.generate_greedy(prompt, 12, eos_ids=[res.token_ids[3]], ignore_eos=True)
    assert ignored.token_ids == res.token_ids


def test_local_chain_rejects_bad_requests(tiny_export):
    chain = LocalChain(tiny_export("llama", 2), precision="f32")
    with pytest.raises(InvalidArgument) as err:
        chain.generate_greedy([], 4)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidArgument) as err:
        chain.generate_greedy([1] * 200, 4)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidArgument) as err:
        chain.generate_greedy([1], 0)
    assert err.value.field == "max_tokens"
    res = chain.generate_greedy([1] * 120, 50, ignore_eos=True)  # capped by max_context 128
    assert res.completion_tokens == 9 and res.finish_reason == "length"
