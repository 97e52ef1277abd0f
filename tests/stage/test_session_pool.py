"""The session table's pool of released sessions: reused, but never more than MAX_IDLE_SESSIONS kept
(each holds the buffers of the largest step it ran, so a burst of sessions would hold them for good)."""

from __future__ import annotations

from pipeshard.services.stage.sessions import MAX_IDLE_SESSIONS, SessionTable


class FakeSession:
    past_length = 0

    def __init__(self):
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_released_sessions_are_reused_up_to_the_idle_pool_bound():
    made: list[FakeSession] = []

    def factory() -> FakeSession:
        made.append(FakeSession())
        return made[-1]

    table = SessionTable(factory, max_sessions=64, idle_timeout_s=300)
    burst = 2 * MAX_IDLE_SESSIONS
    for i in range(burst):
        table.open("hog", f"s{i}")
    for i in range(burst):
        assert table.release("hog", f"s{i}")
    assert all(session.resets == 1 for session in made)
    for i in range(burst):
        table.open("user", f"u{i}")
    # The second burst reused the MAX_IDLE_SESSIONS kept; the rest were dropped and made anew.
    assert len(made) == burst + burst - MAX_IDLE_SESSIONS
