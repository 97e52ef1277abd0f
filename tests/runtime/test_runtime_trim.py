"""ShardSession.trim: the physical KV cut that the mask-based rewind is the cheap equivalent of."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.shard.runtime import ShardRunner, time_trim


def _greedy(session, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(np.argmax(session.run(np.array([[token]]))[0, -1]))
        out.append(token)
    return out


def test_trim_bookkeeping(tiny_export):
    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    session = runner.new_session()
    session.run(np.arange(10, 20)[None])
    with pytest.raises(InvalidArgument) as err:
        session.trim(11)
    assert err.value.field == "trim"
    session.invalidate(2, 4)  # a hole before the cut stays masked
    session.trim(8)
    assert (session.past_length, session.valid_length) == (8, 6)
    assert session.mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1]
    assert all(s.state.shape[2] == 8 for s in session.infer_request.query_state())
    got = session.run(np.array([[7]]))  # logical position 6, the number of valid positions
    ref = runner.new_session()  # never saw tokens 18, 19
    ref.run(np.arange(10, 18)[None])
    ref.invalidate(2, 4)
    np.testing.assert_allclose(got, ref.run(np.array([[7]])), rtol=1e-5, atol=1e-5)
    session.trim(0)
    assert (session.past_length, session.valid_length) == (0, 0)


def test_time_trim_restores_the_session(tiny_export):
    session = ShardRunner(tiny_export("llama", 1), 0, "f32").new_session()
    session.run(np.arange(30)[None])
    seconds = time_trim(session, 5)
    assert 0 < seconds < 1 and session.past_length == 30 and session.valid_length == 30
    with pytest.raises(InvalidArgument):
        time_trim(ShardRunner(tiny_export("llama", 1), 0, "f32").new_session(), 3)


@pytest.mark.slow
def test_trim_and_invalidate_equal_never_seen(smollm2_export, chat_prompt_ids):
    """SmolLM2 fp32 at f32: 5 junk tokens rewound by invalidate or by trim, then 32 greedy tokens:
    both token for token what a session that never saw the junk decodes."""
    runner = ShardRunner(smollm2_export(1, "fp32"), 0, precision="f32")
    prompt = np.asarray([chat_prompt_ids[0]], dtype=np.int64)
    junk = np.array([[504, 3575, 282, 4649, 314]])
    n = prompt.shape[1]
    first = int(np.argmax(runner.new_session().run(prompt)[0, -1]))

    clean = runner.new_session()
    clean.run(prompt)
    want = _greedy(clean, first, 32)
    results = {}
    for how in ("invalidate", "trim"):
        session = runner.new_session()
        session.run(prompt)
        session.run(junk, return_last=5)
        if how == "invalidate":
            session.invalidate(n, n + 5)
        else:
            session.trim(n)
        results[how] = _greedy(session, first, 32)
        assert session.valid_length == n + 32
    assert results["invalidate"] == results["trim"] == want
